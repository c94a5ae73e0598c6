"""ReCoVerHSDPStrategy: the Lightning strategy that adapts Lightning's hooks to the recovery protocol.

Layout: the MPI world is W replicas x S shard ranks. torch's default process group is
*replica-local* (:mod:`~lightning_recover.strategies.replica_group`), so Lightning's own
hidden collectives never cross replicas; FSDP2 shards the model inside the replica and
*sums* (:mod:`~lightning_recover.strategies.sharding`). Cross-replica traffic runs over the
ULFM communicator. The protocol itself is the step engine's
(:mod:`lightning_recover.recovery.engine`); this class only connects it to Lightning:

1. ``process_dataloader`` swaps the train loader for step tickets; microbatches are
   identified by global id (:mod:`lightning_recover.feed.data`) and loaded ahead by the user's
   loader settings, the plan driving its batch sampler (:mod:`lightning_recover.feed.loading`).
2. ``training_step`` receives a ticket: the engine plans the step and the replica's first
   planned microbatch runs inside Lightning's closure (so ``self.log`` and the closure
   bookkeeping work as usual).
3. ``optimizer_step`` runs the closure, then the engine computes the remaining
   microbatches and reduces until one membership commits; only then do
   ``on_before_optimizer_step``, gradient clipping and ``optimizer.step`` run, on the
   reduced gradient divided by the constant ``B * S``.
4. With ``rejoin=True`` every step boundary (``on_train_batch_start``) gives the
   :class:`~lightning_recover.membership.recruiter.Recruiter` its turn: replacements for lost replicas are
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

import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_recover import _lightning
from lightning_recover.audit.ledger import LeaderLedger
from lightning_recover.callbacks import (
    BoundaryScheduler,
    BufferSync,
    CorruptionCheck,
    EpochCheck,
    ReductionBuffers,
    fallback_checkpoint,
)
from lightning_recover.callbacks.checkpoint import is_fallback
from lightning_recover.callbacks.loggers import LeaderLogs
from lightning_recover.comm.communicator import FaultTolerantComm
from lightning_recover.comm.data_plane import check_data_plane
from lightning_recover.comm.interface import RepairResult
from lightning_recover.comm.process_group import ProcessGroupULFM, lockstep_refusal, new_replica_group
from lightning_recover.comm.replica_plane import resolve_replica_plane, use_replica_plane
from lightning_recover.comm.topology import RankLayout
from lightning_recover.config import ConfigurationError, RecoverConfig
from lightning_recover.feed.data import MicrobatchSource, StepTicket, TicketLoader
from lightning_recover.feed.loading import EnginePlan, MicrobatchFeed
from lightning_recover.membership import handshake, milestones
from lightning_recover.membership.recruiter import JoinAttempt, Recruiter
from lightning_recover.membership.seat import Joining, job_environ
from lightning_recover.membership.seat import seat as spawned_seat
from lightning_recover.membership.transfer import donor_and_recipients, recv_state, send_state
from lightning_recover.recovery.engine import StepEngine
from lightning_recover.recovery.hooks import dispatcher
from lightning_recover.recovery.state import Join
from lightning_recover.runtime import lifecycle
from lightning_recover.runtime.slurm import refuse_direct_launch
from lightning_recover.runtime.watchdog import HangWatchdog, default_hang_timeout
from lightning_recover.strategies import checkpoint_io
from lightning_recover.strategies.environment import ReplicaEnvironment
from lightning_recover.strategies.evaluation_loader import EvaluationLoader
from lightning_recover.strategies.probes import StrategyProbes, install_progress_hooks
from lightning_recover.strategies.replica_group import init_replica_group, is_comm_error
from lightning_recover.strategies.sharding import (
    is_sharded,
    local,
    on_gradient_ready,
    replica_mesh,
    set_gradient_sync,
    shard_model,
)
from lightning_recover.strategies.step_logs import StepLogs
from lightning_recover.workload.policy import WorkloadPolicy, make_policy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

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
        self.strategy._start_logging()
        out = self.strategy._forward(offset)
        self.strategy.backward(out["loss"] if isinstance(out, Mapping) else out, self.optimizer)
        self.strategy._capture_logged()

    def local_grads(self) -> list[Tensor]:
        grads = []
        for p in self.strategy._trainable:
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
        self.config = config if config is not None else RecoverConfig.from_arguments(**settings)
        self.bucket_bytes = self.config.bucket_bytes
        launcher_default = default_hang_timeout() if self.config.hang_timeout_s is None else None
        self.hang_timeout_s, self.stuck_timeout_s = self.config.watchdog_timeouts(launcher_default)
        self.comm: FaultTolerantComm | None = None
        self.layout: RankLayout | None = None
        self.policy: WorkloadPolicy | None = None
        self.engine: StepEngine | None = None
        self.data: MicrobatchSource | None = None
        self.feed: MicrobatchFeed | None = None
        self.watchdog: HangWatchdog | None = None
        self.probes: StrategyProbes | None = None
        self.ledger: LeaderLedger | None = None
        # This replica's ranks on MPI (rank = shard index), and whether FSDP2 runs its collectives on it.
        self._mates: Any = None
        self._replica_plane = "torch"
        self._replica_collectives: tuple[Any, ...] = ()
        self._resume: dict[str, Any] | None = None
        self._batch_idx = 0
        #: The ledger record of the last committed step (also on ranks that do not write the ledger).
        self.last_record: dict[str, Any] | None = None
        self._device_mesh: DeviceMesh | None = None
        self._step_logs = StepLogs()
        self._log_bases: dict[str, tuple[float, float]] = {}
        self._logging_offset = 0
        #: Inside validation_step / test_step / predict_step (their batches differ in number across ranks).
        self._evaluating_batch = False
        self._eval_batches = 0
        self.recruiter: Recruiter | None = None
        #: This process is a replacement that has not run its first step yet: the survivors are
        #: past the setup-time collectives it would otherwise ask them for (see _join_world).
        self._joining: Joining | None = None
        # The step's planned microbatches are running (see backward), the last of them, and
        # whether FSDP2 reduce-scatters inside the replica on the next backward.
        self._planned_phase = False
        self._final_offset = -1
        self._syncing = True
        self._trainable: list[torch.nn.Parameter] = []

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
        if self.comm is not None and self.comm.world is None:
            return self.comm.layout.world_size  # a replacement not admitted yet is nobody's rank zero
        return self.comm.world_rank if self.comm is not None else self.cluster_environment.global_rank()  # type: ignore[union-attr]

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

    _replica_group: ProcessGroupULFM | None = None

    @property
    def replica_group(self) -> ProcessGroupULFM:
        """This rank's shard index across the live replicas as a ``torch.distributed`` process group
        (backend ``"ulfm"``): ``dist.all_reduce(t, group=strategy.replica_group)`` and friends, where a peer's
        death is repaired and the call retried over the survivors. One object for the whole job; its size and
        rank follow the membership. See :mod:`lightning_recover.comm.process_group` for the contract."""
        if self._replica_group is None:
            raise RuntimeError("replica_group is built in setup_environment(); it is available from configure_model() on")
        return self._replica_group

    @property
    def replica_plane(self) -> str:
        """What carries FSDP2's collectives inside the replica: ``"mpi"`` or ``"torch"`` (``recover.replica_plane``, settled)."""
        return self._replica_plane

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

    # ------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        # fit, validate, test and predict each call this; the job's MPI world, process group
        # and engine are made once, by the first.
        if self.comm is None:
            joining = spawned_seat()
            if joining is None:
                self._start_rank()
            else:
                self._start_replacement(joining)
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        _lightning.no_distributed_sampler(trainer)
        self._install_callbacks(trainer)
        super().setup_environment()
        if self._device_mesh is None:
            # After the accelerator selected this rank's device, which DeviceMesh would otherwise guess.
            self._device_mesh = replica_mesh(self.root_device.type, self.config.shards)
        _lightning.set_device_mesh(self.lightning_module, self._device_mesh)

    def _start_rank(self) -> None:
        """This rank joins the job: MPI, crash handling, the communicator, the policy, the replica-local group, the engine."""
        lifecycle.prepare_mpi()
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() > 1:
            # First, so that every check below that raises ends the rank the way the launcher reports (lifecycle).
            lifecycle.install_crash_hook(MPI.COMM_WORLD.Get_rank())
        elif not lifecycle.launched():
            lifecycle.warn_single_replica()
        self._refuse_several_devices()
        self.config.check_world(MPI.COMM_WORLD.Get_size())
        self._check_planes()
        self.layout = RankLayout(MPI.COMM_WORLD.Get_size(), self.config.shards)
        self.comm = FaultTolerantComm(
            self.layout, bucket_bytes=self.bucket_bytes, data_plane=self.config.data_plane, plane_timeout_s=self.config.timeout_s
        )
        # The script's end runs `shutdown()` by itself at interpreter exit; no call needed.
        lifecycle.start_rank(self.comm.rank, self.layout.world_size, end_of_job=self.shutdown)
        self._start_protocol(self.comm.world.Split(self.comm.replica, self.comm.shard))

    def _check_planes(self) -> None:
        """Refuse a data or replica plane this process cannot run; settle ``replica_plane=auto``."""
        check_data_plane(self.config.data_plane, self.root_device.type)
        self._replica_plane = resolve_replica_plane(self.config.replica_plane, self.config.data_plane, self.root_device.type)

    def _start_protocol(self, mates: Any, heartbeats: Path | None = None) -> None:
        """What every rank builds once it has its communicator: the policy, the watchdog, the
        replica-local group, the engine, the ledger, the recruiter. ``mates``: this
        replica's ranks on MPI, ranked by shard (a replacement splits them from its spawn:
        it has no world yet); a replacement also passes the survivors' heartbeat directory."""
        assert self.comm is not None and self.layout is not None
        from mpi4py import MPI

        mates.Set_errhandler(MPI.ERRORS_RETURN)
        self._mates = mates
        c = self.config
        # A replacement's policy is replaced by the donor's state before its first step.
        self.policy = make_policy(c.policy, self.layout.replicas, c.grad_accum, T=c.target_replicas, min_replicas=c.min_replicas)
        if self.hang_timeout_s:
            self.watchdog = HangWatchdog(
                self.comm.rank, self.hang_timeout_s, stuck_timeout=self.stuck_timeout_s, directory=heartbeats
            ).start()
        backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        init_replica_group(self.comm, c.shards, c.timeout_s, backend, gather=mates.allgather)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        self.probes = StrategyProbes(self.comm.rank, self.watchdog, lambda: trainer.callbacks)
        dispatch = dispatcher(lambda: trainer.callbacks, lambda: (trainer, self.lightning_module))
        self.engine = StepEngine(
            self.comm, self.policy, shards=c.shards, dispatch=dispatch, probes=self.probes, on_repair=self._on_repair,
            overlap=c.overlap,
        )
        engine = self.engine
        self._replica_group = new_replica_group(
            self.comm, engine.run_collective, refuse=lambda: lockstep_refusal(engine.state, self._evaluating_batch),
            probes=self.probes, step=lambda: trainer.global_step,
        )
        if c.ledger_path is not None:
            self.ledger = LeaderLedger(c.ledger_path, guard=lambda: self.comm.check_fences("step ledger"))  # type: ignore[union-attr]
        # Only the newest world of the newest launch writes the ledger and the checkpoints.
        guarded = [Path(c.ledger_path).parent] if c.ledger_path is not None else []
        if c.checkpoint.dir is not None:
            guarded.append(Path(c.checkpoint.dir))
        self.comm.guard_writes(guarded)
        if c.rejoin:
            self.recruiter = self._make_recruiter()
            if self._joining is None:
                # Standbys start now, while this job still sets up, not after its first loss.
                self.recruiter.tend(training=False)

    def _make_recruiter(self) -> Recruiter:
        assert self.comm is not None and self.layout is not None
        c, layout = self.config, self.layout

        def context() -> dict[str, Any]:
            trainer = self.lightning_module.trainer  # type: ignore[union-attr]
            return {
                "world_size": layout.world_size, "timeout_s": c.rejoin_timeout_s,
                "heartbeats": str(self.watchdog.dir) if self.watchdog is not None else None,
                "logger_versions": [getattr(lg, "version", None) for lg in trainer.loggers],
                "environ": job_environ(),
            }

        return Recruiter(
            self.comm, hosts=c.rejoin_hosts, attempts=c.rejoin_attempts, backoff_s=c.rejoin_backoff_s,
            timeout_s=c.rejoin_timeout_s, context=context, standbys=c.rejoin_standbys, shards=c.shards,
        )

    def _start_replacement(self, joining: Joining) -> None:
        """This process replaces a lost rank: everything of ``_start_rank`` that needs no survivor.

        It becomes a member of the world in ``setup`` (:meth:`_join_world`), once its model
        and optimizer exist to receive the live state."""
        milestones.mark("strategy")
        lifecycle.install_crash_hook(joining.rank)
        self._refuse_several_devices()
        self._check_planes()
        self.layout = layout = RankLayout(int(joining.seat.context["world_size"]), self.config.shards)
        self.comm = FaultTolerantComm.joiner(
            layout, joining.rank, bucket_bytes=self.bucket_bytes, data_plane=self.config.data_plane, plane_timeout_s=self.config.timeout_s
        )
        self._joining = joining
        # The replica-local group among this replica's replacements (all spawned together).
        mates = joining.children.Split(layout.replica_of(joining.rank), layout.shard_of(joining.rank))
        # The survivors' heartbeat directory: this process belongs to another MPI job id.
        beats = joining.seat.context.get("heartbeats")
        self._start_protocol(mates, heartbeats=Path(beats) if beats else None)
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        # The survivors agreed on the loggers' versions at their start; take theirs, so this
        # rank's callbacks (ModelCheckpoint's directory) resolve the same paths.
        for lg, version in zip(trainer.loggers, joining.seat.context.get("logger_versions", [])):
            if hasattr(lg, "_version") and version is not None:
                lg._version = version

    def _refuse_several_devices(self) -> None:
        """One process drives one device here; Trainer(devices=N) would otherwise be silently ignored."""
        devices = len(self.parallel_devices or ())
        if devices > 1:
            script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script.py"
            raise ConfigurationError(
                f"Trainer(devices={devices}) with ReCoVerHSDPStrategy: each process drives one device; "
                f"set Trainer(devices=1) and start one process per device: lightning-recover launch -n N -- python {script}"
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
            if self._replica_plane == "mpi":
                self._replica_collectives = use_replica_plane(self.model, self._mates)
        if self.watchdog is not None and self.watchdog.stuck_timeout is not None:
            install_progress_hooks(self.model, self.watchdog.tick)
        # The sharded parameters, kept: between forward and backward FSDP2 registers a unit's
        # unsharded parameters on the module instead, so model.parameters() would name those.
        self._trainable = [p for p in self.model.parameters() if p.requires_grad]
        on_gradient_ready(self._trainable, self._gradient_ready)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._route_metric_sync(self.lightning_module)
        if self._joining is not None:
            self._join_world(trainer, self._joining)
            return
        self._sync_logger_versions(trainer)
        self._sync_initial_state()

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

    #: Every rank's copy of what the leader logs (:mod:`lightning_recover.callbacks.loggers`); None while no successor can exist.
    _leader_logs: LeaderLogs | None = None

    def _sync_logger_versions(self, trainer: Trainer) -> None:
        """All ranks agree on the loggers' version so a new leader writes into the same run directory,
        and keep what the leader logs so a new leader finishes and continues its logs (:class:`LeaderLogs`)."""
        for lg in trainer.loggers:
            # Lightning's loggers keep the resolved version in `_version` and offer no setter.
            if hasattr(lg, "_version"):
                version = lg.version if self.global_rank == 0 else None
                lg._version = self.broadcast(version, 0)
        if self.comm is None or len(self.comm.alive_replicas) < 2 or not trainer.loggers:
            return
        if self._leader_logs is None:
            self._leader_logs = LeaderLogs()
        if self._leader_logs not in trainer.callbacks:
            # Its on_step_committed recovery hook is dispatched to trainer.callbacks.
            trainer.callbacks.append(self._leader_logs)
        leader = self.global_rank == 0
        counts = self._leader_logs.adopt(trainer.loggers, is_leader=leader)
        if counts:  # the same loggers are new on every rank
            # A leader dying in this broadcast leaves the successor's None: its file was just started.
            self._leader_logs.set_bases(self.broadcast(counts if leader else None, 0) or [0] * len(counts))

    # ------------------------------------------------------------------ hot re-join
    def _join_world(self, trainer: Trainer, joining: Joining) -> None:
        """A replacement: wait for the survivors' GO, grow the world with them, receive the live state.

        The state is the donor replica's Lightning checkpoint; Lightning restores it right
        after ``setup`` as it restores a ``ckpt_path`` (model, optimizers, schedulers, loops,
        callbacks), and the policy and planner are taken over as on a resume."""
        from lightning_recover.membership import joiner

        assert self.comm is not None and self.engine is not None and self.layout is not None
        assert self.probes is not None
        self.probes.fault_point("join_startup", step=joining.seat.attempt)
        milestones.mark("ready")
        while True:
            if joining.link is not None:
                # A standby's replacement: merged only now, so that a loss among the survivors while
                # its script set up never cost it its seat.
                with self.probes.waiting():
                    if not handshake.connect(joining):
                        handshake.give_up(joining, "the leader that spawned this standby is gone or training ended")
            attempt = joining.seat.attempt
            with self.probes.waiting():
                decision = handshake.await_admission(joining, lambda: self.probes.fault_point("join_ready", step=attempt))  # type: ignore[union-attr]
            if decision == "go":
                if self.comm.grow(joining.merged):
                    break
                why = "a member died while the world grew"
            else:
                why = "the survivors dropped this re-join attempt or finished training"
            if decision == "abort" or joining.link is None:
                handshake.give_up(joining, why)
            # A standby's replacement whose attempt the survivors' own repair dropped asks again.
            joining.merged = None
            joiner.restart_timer()
        milestones.mark("go")
        joiner.admitted()
        lifecycle.start_rank(self.comm.rank, self.layout.world_size, end_of_job=self.shutdown)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
        replicas = sorted({self.layout.replica_of(r) for r in joining.seat.ranks})
        comm, layout = self.comm, self.layout
        started = time.perf_counter()

        def receive() -> dict[str, Any]:
            live = [r for r in replicas if r in comm.alive_replicas]
            donor, _ = donor_and_recipients(comm, live)
            source = comm.members.index(layout.rank_of(donor, comm.shard))
            self.probes.fault_point("join_transfer", step=attempt)  # type: ignore[union-attr]
            return recv_state(comm, source, self._device_mesh if self.config.shards > 1 else None, self.root_device)

        checkpoint = self.engine.run_collective(receive)
        milestones.mark("state")
        state = checkpoint[checkpoint_io.STATE_KEY]
        self._take_over(state)
        self.engine.admit([Join(r) for r in replicas if r in comm.alive_replicas])
        if self.recruiter is not None:
            self.recruiter.joined_at(joining.seat.attempt)
        # Lightning restores it right after setup (restore_checkpoint_after_setup).
        _lightning.hand_over_checkpoint(trainer, checkpoint)
        log.info("joined as rank %d after %.2f s of state transfer", comm.rank, time.perf_counter() - started)

    def _take_over(self, state: dict[str, Any]) -> None:
        """A replacement takes the donor's protocol state: policy, sample order, fault count, RNG."""
        assert self.policy is not None and self.engine is not None
        self.policy.load_state_dict(state["policy"])
        self.engine.faults_seen = int(state.get("faults_seen", 0))
        self._resume = state  # process_dataloader loads the planner from it
        torch.set_rng_state(state["rng"]["torch"])

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """The step boundary of hot re-join: the recruiter's turn (see :mod:`lightning_recover.membership.recruiter`)."""
        if self.recruiter is None or self.engine is None or self._joining is not None:
            return
        recruiter = self.recruiter
        recruiter.tend()  # the leader's standbys: never blocks
        # Never at an epoch's first step: Lightning would restore the replacement's loop into the previous epoch.
        attempt = self.engine.run_collective(lambda: recruiter.boundary(can_admit=batch_idx > 0))
        if attempt is not None:
            self._admit(attempt)

    def _admit(self, attempt: JoinAttempt) -> None:
        """Survivors: grow the world with the ready replacements and send them the live state."""
        assert self.recruiter is not None and self.engine is not None and self.comm is not None
        comm = self.comm
        started = time.perf_counter()
        if not self.recruiter.admit(attempt):
            return
        grown = time.perf_counter()
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]

        def live() -> list[int]:
            return [r for r in attempt.replicas if r in comm.alive_replicas]

        def transfer() -> None:
            donor, to = donor_and_recipients(comm, live())
            if self.replica == donor:
                self.probes.fault_point("join_transfer", step=attempt.number)  # type: ignore[union-attr]
                # Lightning's own checkpoint of this moment, plus the protocol's state.
                checkpoint = _lightning.dump_checkpoint(trainer)
                state = checkpoint[checkpoint_io.STATE_KEY] = self._recover_state()
                state["faults_seen"] = self.faults_seen
                with self.replica_guard("state transfer"):
                    send_state(comm, checkpoint, to[comm.shard])

        self.engine.run_collective(transfer)
        done = time.perf_counter()
        joins = self.engine.admit([Join(r, transfer_s=done - grown, pause_s=done - started) for r in live()])
        self._on_membership()
        lost_at = self.recruiter.lost_at
        since = "" if lost_at is None else f"; {time.time() - lost_at:.2f} s after the loss"
        if self.global_rank == 0:
            print(
                f"[lightning-recover] world epoch {comm.world_epoch}: replica(s) {[j.replica for j in joins]} re-joined "
                f"(state transfer {done - grown:.2f} s, survivors paused {done - started:.2f} s{since}); alive {list(comm.alive_replicas)}",
                file=sys.stderr, flush=True,
            )

    def _sync_initial_state(self) -> None:
        """Every replica starts from the lowest replica's weights, seeded or not (shard by shard)."""
        assert self.comm is not None and self.engine is not None and self.model is not None
        tensors = [local(t.data) for t in [*self.model.parameters(), *self.model.buffers()]]
        comm = self.comm
        self.engine.run_collective(lambda: comm.broadcast_tensors(tensors, root=0))

    def _route_metric_sync(self, module: torch.nn.Module | None) -> None:
        """torchmetrics syncs over torch's default group, which is replica-local here; send
        its gathers across the live replicas instead (every rank holds distinct samples;
        a spare's shadow updates would count twice, so log metrics from contributors)."""
        from torchmetrics import Metric

        if module is None:
            return
        for m in module.modules():
            if isinstance(m, Metric):
                m.dist_sync_fn = self._gather_for_metrics
                m.distributed_available_fn = lambda: self.comm is not None and self.world_size > 1

    def _gather_for_metrics(self, tensor: Tensor, group: Any | None = None) -> list[Tensor]:
        assert self.comm is not None and self.engine is not None
        comm = self.comm
        parts = self.engine.run_collective(lambda: comm.allgather_object(tensor.detach().cpu()))
        return [p.to(tensor.device) for p in parts]  # type: ignore[union-attr]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

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
        if self._resume is not None:
            data.planner.load_state_dict(self._resume["planner"])
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
        if self._joining is not None:
            # A replacement's first step: from here on it is a member like any other.
            assert self.probes is not None
            self.probes.fault_point("joined", step=self._joining.seat.attempt)
            milestones.mark("first_step")
            seat = self._joining.seat
            lost_at = seat.context.get("lost_at")
            print(f"[lightning-recover] replacement for rank {self.comm.rank if self.comm else '?'} (attempt {seat.attempt}) "  # type: ignore[union-attr]
                  f"starts its first step: {milestones.breakdown(seat.spawned_at, lost_at if isinstance(lost_at, float) else None)}",
                  file=sys.stderr, flush=True)
            self._joining = None
        step = self.engine.begin(self.lightning_module.trainer.global_step)  # type: ignore[union-attr]
        # The microbatches planned now run first; the last of them reduce-scatters inside the
        # replica and overlaps the cross-replica reduction (see backward).
        self._planned_phase, self._final_offset = True, step.mine.ids[-1]
        self._log_bases = self._step_logs.begin_step(self._train_results())
        with self._abandon_step_on_error():
            self._start_logging()
            return self._forward(step.mine.ids[0])

    def _train_results(self) -> Any:
        return _lightning.fit_results(self.lightning_module)

    def _start_logging(self) -> None:
        self._step_logs.start(self._train_results())

    def _capture_logged(self) -> None:
        """What the microbatch just computed logged with sync_dist, for the commit's reduction."""
        assert self.engine is not None
        self.engine.record_logged(self._logging_offset, self._step_logs.capture(self._train_results()))

    def _forward(self, offset: int) -> Any:
        """Forward of one microbatch (step-local id ``offset``) with its own RNG stream."""
        assert self.engine is not None and self.engine.state is not None and self.data is not None and self.probes is not None
        st = self.engine.state
        self._logging_offset = offset
        self.probes.fault_point("forward", step=st.step, microbatch=st.microbatches_run)
        self.probes.tick()
        assert self.feed is not None
        # Seeds torch for this microbatch (the same on every replica), however it was loaded.
        batch = self.batch_to_device(self.feed.get(st.step, offset))
        with self.replica_guard("forward"), self._logging_as_batch(batch, first=st.microbatches_run == 0):
            out = super().training_step(batch, self._batch_idx)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise TypeError(f"training_step must return a loss tensor (or a dict with 'loss'), got {type(out).__name__}")
        self.engine.record(offset, float(loss.detach().float()))
        return out

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

    @contextmanager
    def _logging_as_batch(self, batch: Any, first: bool) -> Iterator[None]:
        """``self.log`` in this microbatch's ``training_step`` counts it as Lightning counts one batch.

        With ``accumulate_grad_batches`` Lightning reads each batch's size from the batch it
        passed to ``training_step`` (here a :class:`StepTicket`), files values under the hook
        running (``optimizer_step`` for our later microbatches, whose epoch means would then
        replace the first's), and while in an epoch's first batch resets a hook's values
        whenever another hook logged since (``training_step`` and ``on_after_backward``
        alternate between our microbatches). All three live in the loop's private state
        (``trainer._results``, ``_current_fx_name``, the logger connector's
        ``_first_loop_iter``), which no public API sets; the epoch value so covers every
        microbatch, means weighted by their size.
        """
        module = self.lightning_module
        results = _lightning.fit_results(module)
        if module is None or results is None:
            yield
            return
        results.batch, results.batch_size = batch, None
        with _lightning.logging_as_training_step(module, first):
            yield

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        st = self.engine.state if self.engine is not None else None
        inflight = None
        if st is not None and self.probes is not None:
            assert self.engine is not None
            self.probes.fault_point("backward", step=st.step, microbatch=st.microbatches_run)
            self.probes.tick()
            st.microbatches_run += 1
            # Deferring the in-replica reduce-scatter is safe only inside the planned run: a
            # re-plan (or a recovery microbatch) may reset the accumulator, and FSDP2's pending
            # unsharded gradient has no public way to be dropped, so from then on every
            # backward syncs (which flushes what is pending).
            final = self._planned_phase and not st.replan_pending and self._logging_offset == self._final_offset
            deferring = self._planned_phase and not st.replan_pending and not self.config.sync_every_microbatch
            self._gradient_sync(final or not deferring)
            if final and self.model is not None:
                inflight = self.engine.start_overlap(_Runner(self, optimizer))  # type: ignore[arg-type]
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
            self._capture_logged()
            st = self.engine.state
            assert st is not None
            # A repair inside the first microbatch (a collective in training_step) re-planned the step: the
            # new plan's ids[1:] may hold the id just computed under the old one (its gradient would count
            # twice); the boundary step in reduce_until_committed runs exactly what is missing.
            self.engine.run(runner, () if st.replan_pending else st.mine.ids[1:])
            self._planned_phase = False
            self.engine.reduce_until_committed(runner)
            self._step_logs.apply(self._train_results(), st.logged_totals, self._log_bases, self.world_size)
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
        lm = self.lightning_module
        if lm is not None:
            lm.log("step_loss", record["loss"], prog_bar=True, on_step=True, rank_zero_only=True)
            lm.log("live_replicas", float(len(self.comm.alive_replicas)), prog_bar=True, on_step=True, rank_zero_only=True)
            lm.log("world_epoch", float(self.comm.world_epoch), prog_bar=True, on_step=True, rank_zero_only=True)
            lm.log("faults", float(self.faults_seen), prog_bar=True, on_step=True, rank_zero_only=True)

    def _on_membership(self) -> None:
        """The world changed (a repair or a join): Lightning's rank-zero gates and the log scaling follow."""
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
        self._step_logs.rescale(self.world_size)
        if self._leader_logs is not None:
            self._leader_logs.leadership(self.global_rank == 0)

    @contextmanager
    def _abandon_step_on_error(self) -> Iterator[None]:
        """A step left by an exception (below min_replicas, a user error) is no longer computing."""
        try:
            yield
        except BaseException:
            if self.engine is not None:
                self.engine.abandon()
            raise

    def _on_repair(self, res: RepairResult) -> None:
        """A repair moved leadership, perhaps to this rank: Lightning's rank-zero gates follow."""
        self._on_membership()
        if self.recruiter is not None:
            self.recruiter.note_loss()
            if self.recruiter.attempt is not None:
                self.recruiter.drop(f"the survivors' world was repaired (lost replica(s) {list(res.lost_replicas)})",
                                    notify=False, repaired=True)
        if self.comm is not None and self.global_rank == 0:
            print(
                f"[lightning-recover] world epoch {self.comm.world_epoch}: lost replica(s) {list(res.lost_replicas)}; "
                f"alive {list(self.comm.alive_replicas)}",
                file=sys.stderr,
                flush=True,
            )

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

    # ------------------------------------------------------------------ collectives for Lightning
    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        if not isinstance(tensor, Tensor) or self.comm is None or self.engine is None or self._joining is not None:
            return tensor
        st = self.engine.state
        if st is not None and not st.agreed:
            # Inside a step ranks run different numbers of microbatches: a collective per
            # self.log call would pair different calls. The commit reduces them (step_logs).
            return tensor
        if self._evaluating_batch:
            # Ranks evaluate different numbers of batches (no padding); epoch values are synced.
            return tensor
        op = str(reduce_op).lower().split(".")[-1] if reduce_op is not None else "mean"
        if op not in ("mean", "avg", "sum"):
            raise ValueError(f"reduce_op={reduce_op!r} is not supported across replicas; use 'mean' or 'sum'")
        src = tensor.detach().to("cpu", torch.float64).contiguous()
        out = torch.empty_like(src)
        comm = self.comm

        def _do() -> Tensor:
            comm.allreduce([src], [out], across="world")
            return out

        total = self.engine.run_collective(_do)
        if op in ("mean", "avg"):
            total = total / self.world_size
            if not torch.is_floating_point(tensor):
                # Ranks evaluate unequal sample counts (no padding): a mean count is fractional,
                # and Lightning divides the summed values by it.
                return total.to(tensor.device, torch.get_default_dtype())
        return total.to(tensor.device, tensor.dtype)

    @override
    def barrier(self, name: str | None = None) -> None:
        if self.comm is not None and self.engine is not None and self._joining is None:
            self.engine.run_collective(self.comm.barrier)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.comm is None or self.engine is None or self._joining is not None:
            return obj
        comm = self.comm
        return self.engine.run_collective(lambda: comm.bcast_object(obj, root=src))

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if self.comm is None or self.engine is None or self._joining is not None:
            return tensor.unsqueeze(0)
        comm = self.comm
        parts = self.engine.run_collective(lambda: comm.allgather_object(tensor.detach().cpu()))
        return torch.stack(parts).to(tensor.device)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded models load into their shards, so the model must be set up first

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's state as DTensor shards (references; ``save_checkpoint`` stages the copy)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        assert self.model is not None
        set_model_state_dict(self.model, dict(checkpoint["state_dict"]), options=StateDictOptions(strict=strict))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        assert self.model is not None
        # LightningOptimizer wraps the torch optimizer in `_optimizer` (no public accessor).
        return get_optimizer_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        assert self.model is not None
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            set_optimizer_state_dict(self.model, opt, state)

    def _recover_state(self) -> dict[str, Any]:
        assert self.policy is not None and self.data is not None and self.comm is not None
        return {
            "B": self.policy.B, "grad_accum": self.policy.G_init, "target_replicas": self.policy.T, "shards": self.config.shards,
            "seed": self.config.seed, "policy_name": self.config.policy, "policy": self.policy.state_dict(),
            "planner": self.data.planner.state_dict(), "step": self.lightning_module.trainer.global_step,  # type: ignore[union-attr]
            "replicas": list(self.comm.alive_replicas), "world_epoch": self.comm.world_epoch,
            "rng": {"torch": torch.get_rng_state()},
        }

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
        state = checkpoint[checkpoint_io.STATE_KEY] = self._recover_state()
        self.comm.check_fences("checkpoint")
        if self.ledger is not None:
            # Every ledger line up to this step durable before the checkpoint can be published:
            # a relaunch from it after an OS crash finds no step missing (see lightning_recover.audit.ledger).
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
        resharded to this run's shard count."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        assert self.model is not None
        self.wait_for_checkpoint()
        checkpoint, dcp_dir = checkpoint_io.read_checkpoint(checkpoint_path)
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        fitting = trainer.state.fn == TrainerFn.FITTING and bool(self.optimizers)
        if fitting and checkpoint[checkpoint_io.STATE_KEY].get("optimizers", 0) < len(self.optimizers):
            fitting = False  # a weights-only checkpoint: Lightning itself refuses to resume training from it
        model_state = get_model_state_dict(self.model)
        optimizer_states = [get_optimizer_state_dict(self.model, opt) for opt in self.optimizers] if fitting else []
        with self.replica_guard("checkpoint load"):
            checkpoint_io.load_into(dcp_dir, model_state, optimizer_states)
        checkpoint["state_dict"] = model_state
        if fitting:
            checkpoint["optimizer_states"] = optimizer_states
        if trainer.state.fn == TrainerFn.FITTING:
            self._adopt(checkpoint[checkpoint_io.STATE_KEY])
        return checkpoint

    def _adopt(self, state: dict[str, Any]) -> None:
        """Take B, G_init, T and the sample order from the checkpoint; fit the policy to today's replicas."""
        assert self.layout is not None and self.engine is not None
        self._resume = state
        self.config = dataclasses.replace(
            self.config, seed=int(state["seed"]), grad_accum=int(state["grad_accum"]), target_replicas=int(state["target_replicas"])
        )
        c, W = self.config, self.layout.replicas
        assert c.target_replicas is not None
        if c.policy == "static":
            # Fewer replicas than T: the missing ones count as lost, B stays T * G_init.
            self.policy = make_policy("static", max(W, c.target_replicas), c.grad_accum, T=c.target_replicas, min_replicas=c.min_replicas)
        else:
            self.policy = make_policy(c.policy, W, c.grad_accum, min_replicas=c.min_replicas)
        if self.policy.B != int(state["B"]):
            raise ConfigurationError(f"cannot keep B={state['B']} with policy {c.policy!r} on {W} replicas")
        self.engine.policy = self.policy
        if self.ledger is not None:
            self.ledger.resumed = True
        rank_zero_only(print)(
            f"[lightning-recover] resuming at step {state['step']} on {W} replica(s) (checkpoint had {len(state['replicas'])}); "
            f"B={state['B']} from the checkpoint",
            file=sys.stderr,
            flush=True,
        )

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
        if self.comm is None or not lifecycle.job_ended(self.comm):
            self._agree_on_the_end()
        if self.comm is not None:
            lifecycle.end_job(self.comm, exit_code)

    def _agree_on_the_end(self) -> None:
        """The survivors' last agreement (repairing a death after the last commit), then the watchdog stops."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.comm is not None and self.engine is not None and self.probes is not None:
            with self.probes.waiting():
                if not self.comm.agree(True):
                    # A replica died after the last commit (e.g. the leader before writing its
                    # ledger line): repair, and let a new leader record what is missing.
                    self.engine.repaired(self.comm.repair())
                    if self.ledger is not None:
                        self.ledger.backfill(is_leader=self.global_rank == 0)
                    self.comm.agree(True)
        if self.watchdog is not None:
            self.watchdog.stop()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="HSDP with in-place ULFM recovery (lightning-recover)")


if ReCoVerHSDPStrategy.strategy_name not in StrategyRegistry:
    ReCoVerHSDPStrategy.register_strategies(StrategyRegistry)
