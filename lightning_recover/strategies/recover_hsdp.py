"""ReCoVerHSDPStrategy: the Lightning strategy that adapts Lightning's hooks to the recovery protocol.

Layout: the MPI world is W replicas x S shard ranks. torch's default process group is
*replica-local* (:mod:`~.replica_group`), so Lightning's own hidden collectives never
cross replicas; FSDP2 shards the model inside the replica and *sums* (:mod:`~.sharding`).
Cross-replica traffic runs over the ULFM communicator. This class holds Lightning's hooks
only; each delegates:

* the running job (communicator, policy, engine, watchdog, ledger, recruiter; start,
  resume, close): :class:`~lightning_recover.recovery.job.RecoveryJob` (``self.job``);
* the train loader (step tickets, microbatches loaded ahead): :mod:`~.train_loader`;
* ``training_step`` / ``backward`` / ``optimizer_step``: :mod:`~.steps` over the step
  engine -- the first planned microbatch runs inside Lightning's closure, the rest and the
  reduction until one membership commits follow; only then do ``on_before_optimizer_step``,
  clipping and ``optimizer.step`` run, on the reduced gradient divided by ``B * S``;
* ``self.log`` inside a step and the loggers: :mod:`~.step_logging`; ``reduce`` /
  ``all_gather`` and torchmetrics: :mod:`~.metrics`; evaluation: :mod:`~.evaluation_loader`;
  checkpoints: :mod:`~.checkpoints`; the Trainer's checks and callbacks: :mod:`~.trainer_setup`;
* hot re-join at every step boundary (``on_train_batch_start``) and a replacement's
  setup: :mod:`lightning_recover.recovery.rejoin`, with Lightning's checkpoint
  dumped and restored in memory.

Loss convention: ``training_step`` returns the mean loss over its (shard's slice of the)
microbatch. The committed gradient is the mean over the step's B microbatches, exactly as
a single process accumulating ``loss / B`` over the same B microbatches would get.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
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
from typing_extensions import Unpack, override

from lightning_recover import _lightning
from lightning_recover.comm.lobby import Orphaned
from lightning_recover.comm.process_group import ProcessGroupULFM
from lightning_recover.comm.replica_plane import data_parallel_comm, use_replica_plane
from lightning_recover.config import RecoverConfig, RecoverSettings
from lightning_recover.feed.data import StepTicket, TicketLoader
from lightning_recover.membership import orphan
from lightning_recover.membership.seat import seat as spawned_seat
from lightning_recover.recovery import rejoin
from lightning_recover.recovery.job import RecoveryJob
from lightning_recover.runtime import lifecycle
from lightning_recover.runtime.refusal import install_refusal_hook
from lightning_recover.runtime.slurm import refuse_direct_launch
from lightning_recover.strategies import checkpoint_io, metrics
from lightning_recover.strategies.checkpoint_hooks import CheckpointHooks
from lightning_recover.strategies.environment import ReplicaEnvironment
from lightning_recover.strategies.evaluation_loader import EvaluationLoader, EvaluationSteps, splittable
from lightning_recover.strategies.probes import install_progress_hooks
from lightning_recover.strategies.replica_group import replica_guard
from lightning_recover.strategies.sharding import (
    is_sharded, local, on_gradient_ready, replica_mesh, require_tensor_parallel, shard_model,
)
from lightning_recover.strategies.step_logging import StepLogging
from lightning_recover.strategies.steps import TrainingSteps
from lightning_recover.strategies.train_loader import ticket_loader
from lightning_recover.strategies.trainer_setup import (
    DEFAULT_CALLBACKS, LightningBridge, install_callbacks, quiet_console, quiet_fence_warnings, validate_trainer,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DEFAULT_CALLBACKS", "ReCoVerHSDPStrategy"]

#: Where a donor's state for a replacement carries the epoch's committed totals (:meth:`StepLogging.handover`).
EPOCH_TOTALS_KEY = "lightning_recover_epoch_totals"


class ReCoVerHSDPStrategy(ParallelStrategy):
    """HSDP with in-place recovery from replica failures; see the module docstring.

    Pass ``config=RecoverConfig(...)`` (or a mapping of its fields: a dict, a DictConfig) or its fields as keywords (``shards``,
    ``grad_accum``, ``target_replicas``, ``policy``, ``min_replicas``, ``bucket_mb``, ``data_plane``,
    ``replica_plane``, ``ledger_path``, ``seed``, ``timeout_s``, ``hang_timeout_s``, ``stuck_timeout_s``, ``salvage``, ...),
    the sections nested (``checkpoint={"dir": ..., "every_n_steps": ...}``, ``sdc={...}``, ``rejoin={"enabled": True,
    "standbys": 2}``) or in their short forms (``checkpoint_dir`` / ``checkpoint_every_n_steps`` / ``checkpoint_async_save`` /
    ``checkpoint_consolidate``, ``sdc_every_n_steps`` / ``sdc_action``, ``rejoin=True`` with ``rejoin_hosts`` /
    ``rejoin_standbys`` / ...). The keywords are typed (:class:`lightning_recover.config.RecoverSettings`), so an IDE or a
    type checker flags a misspelt one; every setting is documented and validated in
    :class:`lightning_recover.config.RecoverConfig`. A wrong key or value raises its ConfigurationError; uncaught in a
    launched rank it ends the job with one line and exit status 2 (:mod:`lightning_recover.runtime.refusal`).

    Checkpoints resume with ``trainer.fit(..., ckpt_path=resolve_ckpt_path("last", dir))``,
    also on a different number of replicas: B, G_init, T and the sample order come from
    the checkpoint, not from these settings, and on a different shard count (DCP reshards;
    keep ``batch_size * shards`` of the train DataLoader, the samples of one microbatch).
    """

    strategy_name = "recover_hsdp"

    def __init__(self, config: RecoverConfig | Mapping[str, Any] | None = None, **settings: Unpack[RecoverSettings]) -> None:
        # Tasks that srun started (no mpiexec) stop here, before the Trainer prints or writes anything
        # as "rank 0" on each of them (lifecycle.prepare_mpi checks again for other ways into MPI).
        refuse_direct_launch()
        # A bad setting in a launched rank: one line and exit status 2, not a traceback per rank.
        install_refusal_hook()
        super().__init__(cluster_environment=ReplicaEnvironment())
        # Before the Trainer's banner; a replacement spawned into a running job is nobody's rank zero (its
        # OMPI rank counts within its spawn) until it is admitted.
        quiet_console(self.cluster_environment.global_rank() if spawned_seat() is None else -1)  # type: ignore[union-attr]
        #: The running job: communicator, policy, engine, watchdog, ledger, recruiter (:mod:`~lightning_recover.recovery.job`).
        self.job = RecoveryJob(RecoverConfig.build(config, **settings))
        self._replica_collectives: tuple[Any, ...] = ()
        self._device_mesh: DeviceMesh | None = None
        self._logging = StepLogging(lambda: self.lightning_module, lambda: self.global_rank == 0)
        self._steps = TrainingSteps(self, super().training_step, self._logging)
        self._eval = EvaluationSteps(lambda: self.probes, self.replica_guard)
        self._checkpoints = CheckpointHooks(self.job, self._protocol_state, self.replica_guard)

    # ------------------------------------------------------------------ the job, as attributes
    config = property(lambda self: self.job.config, doc="The settings (B, G_init, T and the seed from the checkpoint once resumed).")
    comm = property(lambda self: self.job.comm, doc="The ULFM communicator (None before setup_environment).")
    engine = property(lambda self: self.job.engine, doc="The step engine (None before setup_environment).")
    policy = property(lambda self: self.job.policy, doc="The workload policy (None before setup_environment).")
    ledger = property(lambda self: self.job.ledger, doc="The step ledger (None without recover.ledger_path).")
    recruiter = property(lambda self: self.job.recruiter,
                         doc="The re-join recruiter (None without recover.rejoin.enabled, or recover.salvage with shards > 1).")
    watchdog = property(lambda self: self.job.watchdog, doc="The hang watchdog (None with it off).")
    probes = property(lambda self: self.job.probes, doc="The watchdog and fault-injection probes.")
    data = property(lambda self: self._steps.data, doc="The training microbatches (None before the train loader).")
    feed = property(lambda self: self._steps.feed, doc="What loads the planned microbatches ahead (None before the train loader).")
    last_record = property(lambda self: self._steps.last_record, doc="The ledger record of the last committed step (every rank).")
    hang_timeout_s = property(lambda self: self.job.hang_timeout_s, doc="Seconds without a heartbeat before a rank counts as hung.")
    stuck_timeout_s = property(lambda self: self.job.stuck_timeout_s, doc="Seconds computing without progress (None: off).")
    replica_plane = property(lambda self: self.job.replica_plane, doc='What carries FSDP2\'s collectives inside the replica: "mpi" or "torch" (settled).')
    replica_plane_calls = property(lambda self: sum(c.calls for c in self._replica_collectives),
                                   doc="FSDP2 all-gathers and reduce-scatters this rank ran on the MPI replica plane so far.")
    faults_seen = property(lambda self: self.engine.faults_seen if self.engine is not None else 0, doc="Replicas this job lost so far.")
    evaluating_batch = property(lambda self: self._eval.active, doc="Inside an evaluation step (batches differ in number across ranks).")

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
        """The mesh over this replica's shard ranks: 1-D ``"data_parallel"``, or with ``tensor_parallel > 1`` the 2-D
        ``("data_parallel", "tensor_parallel")`` one of ``ModelParallelStrategy``; see :func:`~.sharding.replica_mesh`.

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
        rank follow the membership. See :mod:`lightning_recover.comm.process_group` for the contract."""
        if self.job.replica_group is None:
            raise RuntimeError("replica_group is built in setup_environment(); it is available from configure_model() on")
        return self.job.replica_group

    @property
    def B(self) -> int:
        assert self.policy is not None
        return self.policy.B

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
            joining, host = spawned_seat(), LightningBridge(self, trainer, on_ranks=self._set_ranks, on_membership=self._on_membership)
            if joining is None:
                self.job.start(host)
                if self.config.salvaging:
                    orphan.arm(self.config.salvage_wait_s)
            else:
                self.job.start_replacement(joining, host)
                StepLogging.take_logger_versions(trainer, joining.seat.context.get("logger_versions", []))
        _lightning.no_distributed_sampler(trainer)
        quiet_fence_warnings(self.config)
        install_callbacks(trainer, self.config)
        super().setup_environment()
        if self._device_mesh is None:
            # After the accelerator selected this rank's device, which DeviceMesh would otherwise guess.
            self._device_mesh = replica_mesh(self.root_device.type, self.config.shards, self.config.tensor_parallel)
        _lightning.set_device_mesh(self.lightning_module, self._device_mesh)

    @override
    def setup(self, trainer: Trainer) -> None:
        validate_trainer(trainer, self.precision_plugin)
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        require_tensor_parallel(self.model, self.config.tensor_parallel)
        if self.config.shards > 1 or is_sharded(self.model):
            shard_model(self.model, self.device_mesh)
            if self.replica_plane == "mpi":
                fsdp_comm = data_parallel_comm(self.job.mates, self.config.tensor_parallel)
                waiting = self.probes.waiting if self.probes is not None else nullcontext
                self._replica_collectives = use_replica_plane(self.model, fsdp_comm, waiting)
        if self.watchdog is not None and self.watchdog.stuck_timeout is not None:
            install_progress_hooks(self.model, self.watchdog.tick)
        # The sharded parameters, kept: between forward and backward FSDP2 registers a unit's
        # unsharded parameters on the module instead, so model.parameters() would name those.
        self._steps.trainable = [p for p in self.model.parameters() if p.requires_grad]
        on_gradient_ready(self._steps.trainable, self._steps.gradient_ready)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        metrics.route_metric_sync(self.lightning_module, self.job, lambda: self.world_size)
        if self.job.joining is not None:
            rejoin.join_world(
                self.job, self.job.joining, mesh=self._device_mesh if self.config.shards > 1 else None, device=self.root_device,
                state_key=checkpoint_io.STATE_KEY, restore=lambda checkpoint: self._restore_handed(trainer, checkpoint),
            )
            return
        self._logging.sync_logger_versions(
            trainer, rank=lambda: self.global_rank, broadcast=self.broadcast,
            live_replicas=lambda: len(self.comm.alive_replicas) if self.comm is not None else 0,
        )
        assert self.comm is not None and self.engine is not None and self.model is not None
        rejoin.sync_initial_state(self.job, [local(t.data) for t in [*self.model.parameters(), *self.model.buffers()]])

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ hot re-join
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The step boundary of hot re-join: the recruiter's turn (see :mod:`lightning_recover.recovery.rejoin`)."""
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        rejoin.step_boundary(self.job, batch_idx, dump=lambda: self._dump_for_replacement(trainer), guard=self.replica_guard)

    def _dump_for_replacement(self, trainer: Trainer) -> dict[str, Any]:
        """Lightning's checkpoint of this moment and the epoch's committed totals (logged values, metric states)."""
        return {**self._checkpoints.dump(trainer), EPOCH_TOTALS_KEY: self._logging.handover()}

    def _restore_handed(self, trainer: Trainer, checkpoint: dict[str, Any]) -> None:
        """A replacement: the epoch's totals now, Lightning's checkpoint right after setup."""
        self._logging.take_over(checkpoint.pop(EPOCH_TOTALS_KEY, {}))
        _lightning.hand_over_checkpoint(trainer, checkpoint)

    def _on_membership(self) -> None:
        """The world changed (a repair or a join): Lightning's rank-zero gates and the log scaling follow."""
        self._set_ranks()
        self._logging.on_membership(self.world_size, self.global_rank == 0)
        self._checkpoints.on_membership(self.lightning_module.trainer)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ data
    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and not trainer.training and splittable(dataloader):
            assert self.comm is not None and self.engine is not None and self.probes is not None
            return EvaluationLoader(
                dataloader, self.comm, self.config.shards, self.engine.repaired, self.probes.waiting,  # type: ignore[arg-type]
                tensor_parallel=self.config.tensor_parallel,
            )
        if trainer is None or not trainer.training or isinstance(dataloader, TicketLoader):
            return dataloader
        self._steps.data, self._steps.feed, tickets = ticket_loader(dataloader, self.job, self.feed, trainer.max_steps)
        return tickets

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
        return self._steps.first_microbatch(args[1] if len(args) > 1 else 0)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        inflight = self._steps.before_backward(optimizer)
        try:
            with self.replica_guard("backward"):
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            if inflight is not None:
                inflight.all_ready()

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: LightningModule | torch.nn.Module | None = None, **kwargs: Any
    ) -> Any:
        return self._steps.optimizer_step(optimizer, closure, model or self.lightning_module, **kwargs)

    def replica_guard(self, where: str) -> AbstractContextManager[None]:
        """A communication error inside the replica means a replica-mate died: leave via the gate.

        Wrap your own replica-local collectives in it (e.g. gathering full parameters after
        ``fit``), so a partner's death there never becomes a crash of this rank."""
        return replica_guard(where, lambda: self.comm, self.config.shards)

    # ------------------------------------------------------------------ evaluation
    # Each run stage starts after the Trainer installed its SIGTERM handler (whose broadcast no
    # other rank joins): a SIGTERM must end this rank like a kill instead (lifecycle.die_on_sigterm).
    @override
    def on_train_start(self) -> None:
        lifecycle.die_on_sigterm()
        _lightning.skip_sigterm_broadcast(self.lightning_module.trainer)  # type: ignore[union-attr]

    @override
    def on_validation_start(self) -> None:
        lifecycle.die_on_sigterm()
        self._eval.start()

    @override
    def on_test_start(self) -> None:
        lifecycle.die_on_sigterm()
        self._eval.start()

    @override
    def on_predict_start(self) -> None:
        lifecycle.die_on_sigterm()
        self._eval.start()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval.run("validation", self.lightning_module.trainer, super().validation_step, *args, **kwargs)  # type: ignore[union-attr]

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval.run("test", self.lightning_module.trainer, super().test_step, *args, **kwargs)  # type: ignore[union-attr]

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval.run("predict", self.lightning_module.trainer, super().predict_step, *args, **kwargs)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ collectives for Lightning
    def _in_world(self) -> bool:
        """A member of the world: collectives reach the other replicas (not before setup, nor while joining)."""
        return self.comm is not None and self.engine is not None and self.job.joining is None

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        if not isinstance(tensor, Tensor) or not self._in_world():
            return tensor
        return metrics.reduce_logged(self.job, tensor, reduce_op, evaluating=self.evaluating_batch, world_size=lambda: self.world_size)

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
        return checkpoint_io.optimizer_state(self.model, _lightning.unwrapped_optimizer(optimizer))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.model is not None
        checkpoint_io.load_optimizer_states(self.model, self.optimizers, checkpoint["optimizer_states"])

    def _protocol_state(self) -> dict[str, Any]:
        """The job's state of this step, with the sample order (see :meth:`RecoveryJob.state_dict`)."""
        assert self.policy is not None and self.data is not None and self.comm is not None
        step = self.lightning_module.trainer.global_step  # type: ignore[union-attr]
        return self.job.state_dict(step=step, planner=self.data.planner.state_dict())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Only the leader replica writes; in the background unless ``recover.checkpoint.async_save=false``."""
        self._checkpoints.save(checkpoint, filepath, storage_options)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k removal: the file and its DCP directory, once a pending save is published."""
        if self.global_rank == 0:
            self._checkpoints.remove(filepath)

    def wait_for_checkpoint(self) -> None:
        """Block until this rank's background checkpoint write (if any) is published."""
        self._checkpoints.wait()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's keys from the file, model (and, when fitting, optimizer) state from its DCP directory,
        resharded to this run's shard count; when fitting, the job resumes from its protocol state."""
        assert self.model is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING  # type: ignore[union-attr]
        return self._checkpoints.load(checkpoint_path, self.model, self.optimizers, fitting=fitting)

    # ------------------------------------------------------------------ teardown
    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            # A SIGTERM that came before the stage's start hook (lifecycle.die_on_sigterm): Lightning
            # ends it with SystemExit, status 0, but the sender meant this rank to die.
            lifecycle.terminated_by(signal.SIGTERM)
        if isinstance(exception, Orphaned):
            self.job.orphaned()  # it waits for a seat in the crash hook (membership/orphan.py)
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
