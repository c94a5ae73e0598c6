"""ReCoVerHSDPStrategy: the Lightning strategy that adapts Lightning's hooks to the recovery protocol.

Layout: the MPI world is W replicas x S shard ranks. torch's default process group is
*replica-local* (:mod:`~lightning_recover.strategies.replica_group`), so Lightning's own
hidden collectives never cross replicas; FSDP2 shards the model inside the replica and
*sums* (:mod:`~lightning_recover.strategies.sharding`). Cross-replica traffic runs over the
ULFM communicator. The protocol itself is the step engine's
(:mod:`lightning_recover.recovery.engine`); this class only connects it to Lightning:

1. ``process_dataloader`` swaps the train loader for step tickets; microbatches are
   identified by global id (:mod:`lightning_recover.data`) and loaded ahead by the user's
   loader settings, the plan driving its batch sampler (:mod:`lightning_recover.loading`).
2. ``training_step`` receives a ticket: the engine plans the step and the replica's first
   planned microbatch runs inside Lightning's closure (so ``self.log`` and the closure
   bookkeeping work as usual).
3. ``optimizer_step`` runs the closure, then the engine computes the remaining
   microbatches and reduces until one membership commits; only then do
   ``on_before_optimizer_step``, gradient clipping and ``optimizer.step`` run, on the
   reduced gradient divided by the constant ``B * S``.
4. With ``rejoin=True`` every step boundary (``on_train_batch_start``) gives the
   :class:`~lightning_recover.rejoin.Recruiter` its turn: replacements for lost replicas are
   spawned while the survivors train, and admitted once ready -- Lightning's checkpoint,
   dumped in memory, goes to them over MPI, and Lightning restores it as from a file.
5. The engine's recovery hooks are dispatched to every callback in ``trainer.callbacks``
   that implements them (:mod:`lightning_recover.recovery.hooks`); the default protocol
   callbacks are installed before Lightning's setup hooks run.

Loss convention: ``training_step`` returns the mean loss over its (shard's slice of the)
microbatch. The committed gradient is the mean over the step's B microbatches, exactly as
a single process accumulating ``loss / B`` over the same B microbatches would get.
"""
from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_recover import _lightning, lifecycle, rejoin
from lightning_recover.callbacks import (
    BoundaryScheduler,
    BufferSync,
    CorruptionCheck,
    EpochCheck,
    ReductionBuffers,
    fallback_checkpoint,
)
from lightning_recover.callbacks.checkpoint import is_fallback
from lightning_recover.communicator import FaultTolerantComm
from lightning_recover.config import ConfigurationError, RecoverConfig
from lightning_recover.data import MicrobatchSource, StepTicket, TicketLoader
from lightning_recover.ledger import LeaderLedger
from lightning_recover.loading import EnginePlan, MicrobatchFeed
from lightning_recover.membership import admission
from lightning_recover.policy import WorkloadPolicy
from lightning_recover.process_group import ProcessGroupULFM
from lightning_recover.recovery.engine import StepEngine
from lightning_recover.recovery.hooks import dispatcher
from lightning_recover.recovery.job import JobHost, RecoveryJob
from lightning_recover.slurm import refuse_direct_launch
from lightning_recover.strategies import checkpoint_io, metrics
from lightning_recover.strategies.environment import ReplicaEnvironment
from lightning_recover.strategies.evaluation_loader import EvaluationLoader
from lightning_recover.strategies.probes import StrategyProbes, install_progress_hooks
from lightning_recover.strategies.replica_group import init_replica_group, is_comm_error
from lightning_recover.strategies.replica_plane import resolve_replica_plane, use_replica_plane
from lightning_recover.strategies.sharding import (
    is_sharded,
    local,
    on_gradient_ready,
    replica_mesh,
    set_gradient_sync,
    shard_model,
)
from lightning_recover.strategies.step_logging import StepLogging

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The protocol's own callbacks, installed when the user did not pass configured ones.
DEFAULT_CALLBACKS = (ReductionBuffers, EpochCheck, BoundaryScheduler, BufferSync)


def _splittable(dataloader: object) -> bool:
    """A DataLoader over a map-style dataset: evaluation can split it by sample index."""
    dataset = getattr(dataloader, "dataset", None)
    return (
        isinstance(dataloader, torch.utils.data.DataLoader)
        and not isinstance(dataset, torch.utils.data.IterableDataset)
        and hasattr(dataset, "__len__")
    )


class _Runner:
    """The engine's MicrobatchRunner for one optimizer step: forward and backward through Lightning."""

    def __init__(self, strategy: ReCoVerHSDPStrategy, optimizer: Optimizer) -> None:
        self.strategy = strategy
        self.optimizer = optimizer

    def run_microbatch(self, offset: int) -> None:
        self.strategy.run_microbatch(offset, self.optimizer)

    def local_grads(self) -> list[Tensor]:
        grads = []
        for p in self.strategy.trainable_parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(local(p.grad))
        return grads


class ReCoVerHSDPStrategy(ParallelStrategy):
    """HSDP with in-place recovery from replica failures; see the module docstring.

    Pass ``config=RecoverConfig(...)`` or its fields as keywords (``shards``,
    ``grad_accum``, ``target_replicas``, ``policy``, ``min_replicas``, ``bucket_mb``, ``data_plane``,
    ``replica_plane``, ``ledger_path``, ``seed``, ``timeout_s``, ``hang_timeout_s``, ``stuck_timeout_s``, and
    ``checkpoint_dir`` / ``checkpoint_every_n_steps`` / ``checkpoint_async_save`` / ``checkpoint_consolidate`` for ``checkpoint``,
    ``sdc_every_n_steps`` / ``sdc_action`` for ``sdc``, ``rejoin`` and its ``rejoin_*`` settings); every setting is
    documented and validated in :class:`lightning_recover.config.RecoverConfig`.

    Checkpoints resume with ``trainer.fit(..., ckpt_path=resolve_ckpt_path("last", dir))``,
    also on a different number of replicas: B, G_init, T and the sample order come from
    the checkpoint, not from these settings, and on a different shard count (DCP reshards;
    keep ``batch_size * shards`` of the train DataLoader, the samples of one microbatch).
    """

    strategy_name = "recover_hsdp"

    def __init__(self, config: RecoverConfig | None = None, **settings: Any) -> None:
        # Tasks that srun started (no mpiexec) stop here, before the Trainer prints or writes anything
        # as "rank 0" on each of them (lifecycle.prepare_mpi checks again for other ways into MPI).
        refuse_direct_launch()
        super().__init__(cluster_environment=ReplicaEnvironment())
        if config is not None and settings:
            raise ConfigurationError(
                f"pass either config=RecoverConfig(...) or keyword settings, not both (got config and {sorted(settings)})"
            )
        #: The running job: communicator, policy, engine, watchdog, ledger, recruiter (:mod:`~lightning_recover.recovery.job`).
        self.job = RecoveryJob(config if config is not None else RecoverConfig.from_arguments(**settings))
        self.data: MicrobatchSource | None = None
        self.feed: MicrobatchFeed | None = None
        self._replica_collectives: tuple[Any, ...] = ()
        self._batch_idx = 0
        #: The ledger record of the last committed step (also on ranks that do not write the ledger).
        self.last_record: dict[str, Any] | None = None
        self._device_mesh: DeviceMesh | None = None
        self._logging = StepLogging(lambda: self.lightning_module)
        #: Inside validation_step / test_step / predict_step (their batches differ in number across ranks).
        self._evaluating_batch = False
        self._eval_batches = 0
        # Whether FSDP2 reduce-scatters inside the replica on the next backward.
        self._syncing = True
        self._trainable: list[torch.nn.Parameter] = []

    # ------------------------------------------------------------------ the job, as attributes
    config = property(lambda self: self.job.config, doc="The settings (B, G_init, T and the seed from the checkpoint once resumed).")
    comm = property(lambda self: self.job.comm, doc="The ULFM communicator (None before setup_environment).")
    engine = property(lambda self: self.job.engine, doc="The step engine (None before setup_environment).")
    policy = property(lambda self: self.job.policy, doc="The workload policy (None before setup_environment).")
    ledger = property(lambda self: self.job.ledger, doc="The step ledger (None without recover.ledger_path).")
    recruiter = property(lambda self: self.job.recruiter, doc="The re-join recruiter (None without recover.rejoin).")
    watchdog = property(lambda self: self.job.watchdog, doc="The hang watchdog (None with it off).")
    probes = property(lambda self: self.job.probes, doc="The watchdog and fault-injection probes.")
    hang_timeout_s = property(lambda self: self.job.hang_timeout_s, doc="Seconds without a heartbeat before a rank counts as hung.")
    stuck_timeout_s = property(lambda self: self.job.stuck_timeout_s, doc="Seconds computing without progress (None: off).")

    # ------------------------------------------------------------------ ranks
    @property
    @override
    def root_device(self) -> torch.device:
        if torch.cuda.is_available() and self.accelerator is not None and type(self.accelerator).__name__ == "CUDAAccelerator":
            return torch.device("cuda", self.cluster_environment.local_rank() % torch.cuda.device_count())  # type: ignore[union-attr]
        return torch.device("cpu")

    @property
    @override
    def global_rank(self) -> int:
        # The rank in the *current* world: when rank 0's replica dies, the lowest survivor becomes 0.
        return self.job.global_rank if self.comm is not None else self.cluster_environment.global_rank()  # type: ignore[union-attr]

    @property
    @override
    def world_size(self) -> int:
        if self.comm is not None and self.comm.world is None:
            return self.comm.layout.world_size
        return self.comm.world.Get_size() if self.comm is not None else self.cluster_environment.world_size()  # type: ignore[union-attr]

    @property
    @override
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank()  # type: ignore[union-attr]

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def is_distributed(self) -> bool:
        # Lightning reduces `self.log(..., sync_dist=True)` only for distributed strategies
        # (through `reduce`, see there). Data placement stays ours: setup_environment turns
        # Lightning's DistributedSampler off.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def replica(self) -> int:
        assert self.comm is not None
        return self.comm.replica

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 1-D mesh (``"data_parallel"``) over this replica's shard ranks; see :func:`~.sharding.replica_mesh`.

        The LightningModule sees it as ``self.device_mesh`` in ``configure_model``, as under
        ``ModelParallelStrategy``; a model sharded there keeps its FSDP units."""
        if self._device_mesh is None:
            raise RuntimeError("the device mesh is created in setup_environment(); it is available from configure_model() on")
        return self._device_mesh

    @property
    def replica_group(self) -> ProcessGroupULFM:
        """This rank's shard index across the live replicas as a ``torch.distributed`` process group
        (backend ``"ulfm"``): ``dist.all_reduce(t, group=strategy.replica_group)`` and friends, where a peer's
        death is repaired and the call retried over the survivors. One object for the whole job; its size and
        rank follow the membership. See :mod:`lightning_recover.process_group` for the contract."""
        if self.job.replica_group is None:
            raise RuntimeError("replica_group is built in setup_environment(); it is available from configure_model() on")
        return self.job.replica_group

    @property
    def replica_plane(self) -> str:
        """What carries FSDP2's collectives inside the replica: ``"mpi"`` or ``"torch"`` (``recover.replica_plane``, settled)."""
        return self.job.replica_plane

    @property
    def replica_plane_calls(self) -> int:
        """FSDP2 all-gathers and reduce-scatters this rank ran on the MPI replica plane so far."""
        return sum(c.calls for c in self._replica_collectives)

    @property
    def B(self) -> int:
        assert self.policy is not None
        return self.policy.B

    @property
    def faults_seen(self) -> int:
        """Replicas this job lost so far."""
        return self.engine.faults_seen if self.engine is not None else 0

    @property
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The sharded trainable parameters, in a fixed order (the engine's gradients; set in ``setup``)."""
        return self._trainable

    def _set_ranks(self) -> None:
        """Lightning's rank-zero gates follow this rank's place in the current world."""
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        # fit, validate, test and predict each call this; the job's MPI world, process group
        # and engine are made once, by the first.
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if self.comm is None:
            joining = rejoin.seat()
            if joining is None:
                self.job.start(self._host(trainer))
            else:
                self.job.start_replacement(joining, self._host(trainer))
                StepLogging.take_logger_versions(trainer, joining.seat.context.get("logger_versions", []))
        _lightning.no_distributed_sampler(trainer)
        self._install_callbacks(trainer)
        super().setup_environment()
        if self._device_mesh is None:
            # After the accelerator selected this rank's device, which DeviceMesh would otherwise guess.
            self._device_mesh = replica_mesh(self.root_device.type, self.config.shards)
        _lightning.set_device_mesh(self.lightning_module, self._device_mesh)

    def _host(self, trainer: Trainer) -> JobHost:
        """What the job gets of Lightning: this trainer's callbacks, step and loggers, and the strategy's gates."""
        return JobHost(
            device_type=lambda: self.root_device.type,
            devices=lambda: len(self.parallel_devices or ()),
            callbacks=lambda: trainer.callbacks,
            dispatch=dispatcher(lambda: trainer.callbacks, lambda: (trainer, self.lightning_module)),
            make_probes=lambda rank, watchdog: StrategyProbes(rank, watchdog, lambda: trainer.callbacks),
            step=lambda: trainer.global_step,
            logger_versions=lambda: [getattr(lg, "version", None) for lg in self.lightning_module.trainer.loggers],  # type: ignore[union-attr]
            evaluating=lambda: self._evaluating_batch,
            on_ranks=self._set_ranks,
            on_membership=self._on_membership,
            resolve_replica_plane=resolve_replica_plane,
            init_replica_group=init_replica_group,
            end_of_job=self.shutdown,
        )

    def _install_callbacks(self, trainer: Trainer) -> None:
        """The protocol's callbacks (unless the user configured their own) and the fallback checkpoint.

        Runs in ``setup_environment``, before Lightning calls any callback's ``setup``."""
        for cls in DEFAULT_CALLBACKS:
            if not any(isinstance(c, cls) for c in trainer.callbacks):
                trainer.callbacks.append(cls())
        sdc = self.config.sdc
        if sdc.enabled and not any(isinstance(c, CorruptionCheck) for c in trainer.callbacks):
            trainer.callbacks.append(CorruptionCheck(sdc.every_n_steps, sdc.action))
        ckpt = self.config.checkpoint
        if ckpt.enabled and not any(is_fallback(c, ckpt.dir) for c in trainer.callbacks):  # type: ignore[arg-type]
            trainer.callbacks.append(fallback_checkpoint(ckpt.dir, ckpt.every_n_steps))  # type: ignore[arg-type]

    @override
    def setup(self, trainer: Trainer) -> None:
        self._validate_trainer(trainer)
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.config.shards > 1 or is_sharded(self.model):
            shard_model(self.model, self.device_mesh)
            if self.replica_plane == "mpi":
                self._replica_collectives = use_replica_plane(self.model, self.job.mates)
        if self.watchdog is not None and self.watchdog.stuck_timeout is not None:
            install_progress_hooks(self.model, self.watchdog.tick)
        # The sharded parameters, kept: between forward and backward FSDP2 registers a unit's
        # unsharded parameters on the module instead, so model.parameters() would name those.
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        on_gradient_ready(self._trainable, self._gradient_ready)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        metrics.route_metric_sync(self.lightning_module, self.job, lambda: self.world_size)
        if self.job.joining is not None:
            admission.join_world(
                self.job, self.job.joining, mesh=self._device_mesh if self.config.shards > 1 else None, device=self.root_device,
                state_key=checkpoint_io.STATE_KEY, restore=lambda checkpoint: _lightning.hand_over_checkpoint(trainer, checkpoint),
            )
            return
        self._logging.sync_logger_versions(
            trainer, rank=lambda: self.global_rank, broadcast=self.broadcast,
            live_replicas=lambda: len(self.comm.alive_replicas) if self.comm is not None else 0,
        )
        assert self.comm is not None and self.engine is not None and self.model is not None
        admission.sync_initial_state(self.job, [local(t.data) for t in [*self.model.parameters(), *self.model.buffers()]])

    def _validate_trainer(self, trainer: Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ConfigurationError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}: ReCoVerHSDPStrategy accumulates itself; "
                "remove accumulate_grad_batches from the Trainer and set grad_accum on the strategy (recover.grad_accum)"
            )
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            raise ConfigurationError(
                f"precision={trainer.precision!r} uses a GradScaler, whose skipped steps would desynchronise replicas; "
                "use precision='bf16-mixed' or '32-true'"
            )
        if not self.lightning_module.automatic_optimization:  # type: ignore[union-attr]
            raise ConfigurationError("ReCoVerHSDPStrategy needs automatic optimization (self.automatic_optimization = True)")

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ hot re-join
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The step boundary of hot re-join: the recruiter's turn (see :mod:`lightning_recover.membership.admission`)."""
        admission.step_boundary(self.job, batch_idx, dump=self._dump_for_transfer, guard=self.replica_guard)

    def _dump_for_transfer(self) -> dict[str, Any]:
        """Lightning's own checkpoint of this moment, plus the protocol's state, for a replacement."""
        checkpoint = _lightning.dump_checkpoint(self.lightning_module.trainer)  # type: ignore[union-attr]
        state = checkpoint[checkpoint_io.STATE_KEY] = self._protocol_state()
        state["faults_seen"] = self.faults_seen
        return checkpoint

    def _on_membership(self) -> None:
        """The world changed (a repair or a join): Lightning's rank-zero gates and the log scaling follow."""
        self._set_ranks()
        self._logging.on_membership(self.world_size, self.global_rank == 0)

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and not trainer.training and _splittable(dataloader):
            assert self.comm is not None and self.engine is not None and self.probes is not None
            return EvaluationLoader(dataloader, self.comm, self.config.shards, self.engine.repaired, self.probes.waiting)  # type: ignore[arg-type]
        if trainer is None or not trainer.training or isinstance(dataloader, TicketLoader):
            return dataloader
        assert self.policy is not None and self.comm is not None and self.engine is not None
        self.data = data = MicrobatchSource(dataloader, self.policy.B, self.config.shards, self.comm.shard, self.config.seed)
        if self.job.resumed is not None:
            data.planner.load_state_dict(self.job.resumed["planner"])
        if self.feed is not None:
            self.feed.close()
        # The user's loader settings (workers, pinning) load the planned microbatches ahead.
        self.feed = feed = MicrobatchFeed(data, dataloader, EnginePlan(self.engine, lambda: data.planner.next_step))
        steps, max_steps = data.steps_per_epoch(), trainer.max_steps

        def start_epoch() -> None:
            first = data.planner.next_step
            end = first + steps if max_steps is None or max_steps < 0 else min(first + steps, max_steps)
            feed.start_epoch(first, end)

        return TicketLoader(steps, on_epoch=start_epoch)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, StepTicket):
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    # ------------------------------------------------------------------ one step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not (args and isinstance(args[0], StepTicket)):
            return super().training_step(*args, **kwargs)
        assert self.engine is not None
        self._batch_idx = args[1] if len(args) > 1 else 0
        if self.job.joining is not None:
            admission.first_step(self.job)
        self.engine.begin(self.lightning_module.trainer.global_step)  # type: ignore[union-attr]
        # The microbatches planned now run first; the last of them reduce-scatters inside the
        # replica and overlaps the cross-replica reduction (see backward).
        first = self.engine.start_planned()
        self._logging.begin_step()
        with self._abandon_step_on_error():
            self._logging.start()
            return self._forward(first)

    def run_microbatch(self, offset: int, optimizer: Optimizer) -> None:
        """Forward and backward of the step's microbatch ``offset`` through Lightning, its logged values captured."""
        assert self.engine is not None
        self._logging.start()
        out = self._forward(offset)
        self.backward(out["loss"] if isinstance(out, Mapping) else out, optimizer)
        self._logging.capture(self.engine)

    def _forward(self, offset: int) -> Any:
        """Forward of one microbatch (step-local id ``offset``) with its own RNG stream."""
        assert self.engine is not None and self.engine.state is not None and self.data is not None and self.probes is not None
        st = self.engine.state
        self._logging.offset = offset
        self.probes.fault_point("forward", step=st.step, microbatch=st.microbatches_run)
        self.probes.tick()
        assert self.feed is not None
        # Seeds torch for this microbatch (the same on every replica), however it was loaded.
        batch = self.batch_to_device(self.feed.get(st.step, offset))
        with self.replica_guard("forward"), self._logging.as_batch(batch, first=st.microbatches_run == 0):
            out = super().training_step(batch, self._batch_idx)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise TypeError(f"training_step must return a loss tensor (or a dict with 'loss'), got {type(out).__name__}")
        self.engine.record(offset, float(loss.detach().float()))
        return out

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        engine = self.engine
        inflight = None
        if engine is not None and engine.state is not None and self.probes is not None:
            sync, final = engine.before_backward(self._logging.offset, sync_every_microbatch=self.config.sync_every_microbatch)
            self._gradient_sync(sync)
            if final and self.model is not None:
                inflight = engine.start_overlap(_Runner(self, optimizer))  # type: ignore[arg-type]
        try:
            with self.replica_guard("backward"):
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            if inflight is not None:
                inflight.all_ready()

    def _gradient_sync(self, sync: bool) -> None:
        if sync != self._syncing and self.model is not None:
            set_gradient_sync(self.model, sync)
            self._syncing = sync

    def _gradient_ready(self, index: int, grad: Tensor) -> None:
        if self.engine is not None:
            self.engine.gradient_ready(index, grad)

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: LightningModule | torch.nn.Module | None = None, **kwargs: Any
    ) -> Any:
        assert self.engine is not None and self.probes is not None
        model = model or self.lightning_module
        runner = _Runner(self, optimizer)
        with self._abandon_step_on_error():
            result = closure()  # training_step(ticket) -> first microbatch, zero_grad, backward
            self._logging.capture(self.engine)
            st = self.engine.state
            assert st is not None
            self.engine.run_planned(runner)
            self.engine.reduce_until_committed(runner)
            self._logging.apply(st.logged_totals, self.world_size)
            # on_before_optimizer_step and clipping must see the reduced gradient, as with stock
            # strategies; the precision plugin's `_after_closure` is the one place that runs both
            # (no public equivalent in Lightning 2.6).
            self.precision_plugin._after_closure(model, optimizer)  # type: ignore[arg-type]
            self.probes.fault_point("optimizer", step=st.step)
            self.probes.tick()
            out = optimizer.step(**kwargs)
            self._committed(self.engine.finish())
        return result if result is not None else out

    def _committed(self, record: dict[str, Any]) -> None:
        assert self.data is not None and self.comm is not None
        self.data.planner.advance(record["step"])
        self.last_record = record
        if self.ledger is not None:
            self.ledger.record(record, is_leader=self.global_rank == 0)
        self._logging.log_committed(
            record, live_replicas=len(self.comm.alive_replicas), world_epoch=self.comm.world_epoch, faults=self.faults_seen
        )

    @contextmanager
    def _abandon_step_on_error(self) -> Iterator[None]:
        """A step left by an exception (below min_replicas, a user error) is no longer computing."""
        try:
            yield
        except BaseException:
            if self.engine is not None:
                self.engine.abandon()
            raise

    @contextmanager
    def replica_guard(self, where: str) -> Iterator[None]:
        """A communication error inside the replica means a replica-mate died: leave via the gate.

        Wrap your own replica-local collectives in it (e.g. gathering full parameters after
        ``fit``), so a partner's death there never becomes a crash of this rank."""
        try:
            yield
        except Exception as exc:
            if self.config.shards > 1 and self.comm is not None and is_comm_error(exc):
                lifecycle.gate_exit(self.comm.rank, f"replica-local collective failed during {where}: {exc}")
            raise

    # ------------------------------------------------------------------ evaluation
    # Each run stage starts after the Trainer installed its SIGTERM handler (whose broadcast no
    # other rank joins): a SIGTERM must end this rank like a kill instead (lifecycle.die_on_sigterm).
    @override
    def on_train_start(self) -> None:
        lifecycle.die_on_sigterm()

    @override
    def on_validation_start(self) -> None:
        lifecycle.die_on_sigterm()
        self._eval_batches = 0

    @override
    def on_test_start(self) -> None:
        lifecycle.die_on_sigterm()
        self._eval_batches = 0

    @override
    def on_predict_start(self) -> None:
        lifecycle.die_on_sigterm()
        self._eval_batches = 0

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("validation", super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("test", super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluation_step("predict", super().predict_step, *args, **kwargs)

    def _evaluation_step(self, phase: str, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One evaluation batch of this rank's share (:class:`EvaluationLoader`), a fault point, guarded."""
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        if self.probes is not None and not trainer.sanity_checking:
            self.probes.fault_point(phase, step=trainer.global_step, microbatch=self._eval_batches)
            self.probes.tick()
        self._eval_batches += 1
        self._evaluating_batch = True
        try:
            with self.replica_guard(phase):
                return step_fn(*args, **kwargs)
        finally:
            self._evaluating_batch = False

    # ------------------------------------------------------------------ collectives for Lightning
    def _in_world(self) -> bool:
        """A member of the world: collectives reach the other replicas (not before setup, nor while joining)."""
        return self.comm is not None and self.engine is not None and self.job.joining is None

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        if not isinstance(tensor, Tensor) or not self._in_world():
            return tensor
        return metrics.reduce_logged(self.job, tensor, reduce_op, evaluating=self._evaluating_batch, world_size=lambda: self.world_size)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self._in_world():
            self.engine.run_collective(self.comm.barrier)  # type: ignore[union-attr]

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._in_world():
            return obj
        comm = self.comm
        return self.engine.run_collective(lambda: comm.bcast_object(obj, root=src))  # type: ignore[union-attr]

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if not self._in_world():
            return tensor.unsqueeze(0)
        return torch.stack(metrics.gather_cpu(self.job, tensor)).to(tensor.device)

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded models load into their shards, so the model must be set up first

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state as DTensor shards (references; ``save_checkpoint`` stages the copy)."""
        assert self.model is not None
        return checkpoint_io.model_state(self.model)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.model is not None
        checkpoint_io.load_model_state(self.model, checkpoint["state_dict"], strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.model is not None
        # LightningOptimizer wraps the torch optimizer in `_optimizer` (no public accessor).
        return checkpoint_io.optimizer_state(self.model, getattr(optimizer, "_optimizer", optimizer))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.model is not None
        checkpoint_io.load_optimizer_states(self.model, self.optimizers, checkpoint["optimizer_states"])

    def _protocol_state(self) -> dict[str, Any]:
        """The job's state of this step, with the sample order (see :meth:`RecoveryJob.state_dict`)."""
        assert self.policy is not None and self.data is not None and self.comm is not None
        step = self.lightning_module.trainer.global_step  # type: ignore[union-attr]
        return self.job.state_dict(step=step, planner=self.data.planner.state_dict())

    _writer: checkpoint_io.CheckpointWriter | None = None

    @property
    def checkpoint_writer(self) -> checkpoint_io.CheckpointWriter:
        """This rank's DCP writer (see :mod:`~lightning_recover.strategies.checkpoint_io`); ``last_blocking_s`` says
        how long the last save held the step loop."""
        if self._writer is None:
            assert self.comm is not None and self.probes is not None
            probes, ckpt = self.probes, self.config.checkpoint
            self._writer = checkpoint_io.CheckpointWriter(
                self.comm.shard, self.config.shards, async_save=ckpt.async_save, consolidate=ckpt.consolidate,
                pointer_dir=ckpt.dir, fault_point=lambda step: probes.fault_point("checkpoint", step=step),
            )
        return self._writer

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Only the leader replica writes; in the background unless ``recover.checkpoint.async_save=false``."""
        assert self.comm is not None
        if self.comm.alive_replicas[0] != self.replica:
            return
        if storage_options is not None:
            raise TypeError(f"ReCoVerHSDPStrategy.save_checkpoint takes no storage_options (got {storage_options!r}); pass None")
        state = checkpoint[checkpoint_io.STATE_KEY] = self._protocol_state()
        self.comm.check_fences("checkpoint")
        if self.ledger is not None:
            # Every ledger line up to this step durable before the checkpoint can be published:
            # a relaunch from it after an OS crash finds no step missing (see lightning_recover.ledger).
            self.ledger.sync()
        with self.replica_guard("checkpoint save"):
            self.checkpoint_writer.save(checkpoint, filepath, step=int(state["step"]))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k removal: the file and its DCP directory, once a pending save is published."""
        if self.global_rank == 0:
            with self.replica_guard("checkpoint removal"):
                self.checkpoint_writer.remove(filepath)

    def wait_for_checkpoint(self) -> None:
        """Block until this rank's background checkpoint write (if any) is published."""
        if self._writer is not None:
            with self.replica_guard("checkpoint write"):
                self._writer.wait()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's keys from the file, model (and, when fitting, optimizer) state from its DCP directory,
        resharded to this run's shard count; when fitting, the job resumes from its protocol state."""
        assert self.model is not None
        self.wait_for_checkpoint()
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        checkpoint = checkpoint_io.load(
            checkpoint_path, self.model, self.optimizers, fitting=trainer.state.fn == TrainerFn.FITTING,
            guard=lambda: self.replica_guard("checkpoint load"),
        )
        if trainer.state.fn == TrainerFn.FITTING:
            state = checkpoint[checkpoint_io.STATE_KEY]
            self.job.load_state_dict(state)
            assert self.job.layout is not None
            rank_zero_only(print)(
                f"[lightning-recover] resuming at step {state['step']} on {self.job.layout.replicas} replica(s) "
                f"(checkpoint had {len(state['replicas'])}); B={state['B']} from the checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return checkpoint

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            # A SIGTERM that came before the stage's start hook (lifecycle.die_on_sigterm): Lightning
            # ends it with SystemExit, status 0, but the sender meant this rank to die.
            lifecycle.terminated_by(signal.SIGTERM)
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self.recruiter is not None:
            self.recruiter.close()  # replacements still starting are not needed any more
        self.wait_for_checkpoint()  # before the process groups it writes with can go
        if self.feed is not None:
            self.feed.close()  # the train loader's workers end with the fit, as after stock Lightning's
        if self.ledger is not None:
            self.ledger.close()
        super().teardown()

    def shutdown(self, exit_code: int | None = None) -> None:
        """End the job: agree with the survivors, withdraw the heartbeat, free; with ``exit_code``, leave at once.

        A script does not need to call it: the same end runs by itself when the interpreter
        exits (registered at setup through :func:`lifecycle.start_rank`), and the script
        ends with Python's own status. Call it to stop with a status of your choice, e.g.
        ``shutdown(exit_code=3)`` after a ``PolicyError`` (fewer than ``min_replicas``): the
        rank then leaves without ``MPI_Finalize`` and the launcher reads a deliberate stop
        (see :func:`lifecycle.end_job`). Calling it again only exits.
        """
        self.job.shutdown(exit_code)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="HSDP with in-place ULFM recovery (lightning-recover)")


if ReCoVerHSDPStrategy.strategy_name not in StrategyRegistry:
    ReCoVerHSDPStrategy.register_strategies(StrategyRegistry)
