"""ReCoVerHSDPStrategy: the Lightning strategy that runs the whole recovery protocol.

Layout: the MPI world is W replicas x S shard ranks. torch's default process group is
*replica-local* (gloo on CPU, NCCL on GPU), so Lightning's own hidden collectives never
cross replicas and a dead replica cannot wedge them; FSDP2 shards the model inside the
replica and *sums* (no averaging). Cross-replica reduction runs over the ULFM
communicator, one sub-communicator per shard index.

One optimizer step (one Lightning "batch"):

1. ``training_step`` receives a :class:`StepTicket` instead of data. The strategy asks
   the policy for this step's plan and runs the replica's first planned microbatch
   inside Lightning's closure (so ``self.log`` and the closure bookkeeping work as usual).
2. ``optimizer_step`` runs the remaining planned microbatches, then reduces the
   accumulated gradients out-of-place (every bucket tagged with its world epoch) and runs
   the fault-tolerant agreement. On failure: repair (shrink, epoch + 1), the policy
   promotes a shadow or schedules a boundary step, survivors compute the extra
   microbatches, stale buckets are reduced again, agreement again.
3. Only then do ``on_before_optimizer_step``, gradient clipping and ``optimizer.step``
   run, on the reduced gradient divided by the constant ``B * S``.

Loss convention: ``training_step`` returns the mean loss over its (shard's slice of the)
microbatch. The committed gradient is the mean over the step's B microbatches, exactly as
a single process accumulating ``loss / B`` over the same B microbatches would get.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from torch.optim import Optimizer

from lightning_recover.callbacks import BoundaryScheduler, EpochCheck, FaultInjection, GradientSnapshot, ReplicaCheckpoint
from lightning_recover.callbacks.checkpoint import fsync_path, publish
from lightning_recover.communicator import DEFAULT_BUCKET_BYTES, FaultTolerantComm, PeerFailure
from lightning_recover.ledger import LedgerWriter, read_ledger
from lightning_recover.planner import MicrobatchPlanner
from lightning_recover.policy import POLICY_NAMES, ReplicaPlan, StepPlan, WorkloadPolicy, make_policy
from lightning_recover.topology import RankLayout
from lightning_recover.watchdog import HangWatchdog, default_hang_timeout

log = logging.getLogger(__name__)


class ConfigurationError(ValueError):
    """A setting the strategy cannot run with; the message names the value and the fix."""


@dataclass(frozen=True)
class StepTicket:
    """What the train loader yields: a placeholder for one optimizer step's microbatches."""

    index: int


class _TicketLoader:
    """Stands in for the train DataLoader: one ticket per optimizer step of a data epoch."""

    def __init__(self, steps_per_epoch: int) -> None:
        self.steps_per_epoch = steps_per_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[StepTicket]:
        return (StepTicket(i) for i in range(self.steps_per_epoch))


class ReplicaEnvironment(ClusterEnvironment):
    """Cluster environment of one rank in the MPI world, as Lightning sees it."""

    def __init__(self) -> None:
        self._rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")))
        self._world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
        self._local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return "OMPI_COMM_WORLD_RANK" in os.environ

    def world_size(self) -> int:
        return self._world

    def set_world_size(self, size: int) -> None:
        self._world = size

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        self._rank = rank

    def local_rank(self) -> int:
        return self._local

    def node_rank(self) -> int:
        return 0


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _to_local_tree(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return _local(obj).detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_local_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_local_tree(v) for v in obj)
    return obj


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(k in text for k in ("gloo", "connection closed", "connection reset", "broken pipe", "nccl"))


def install_progress_hooks(model: torch.nn.Module, tick: Callable[[], None]) -> list[Any]:
    """Tick at the end of every module's forward and when its output's gradient is computed.

    This makes the stuck-in-compute rule measure progress per layer rather than per
    microbatch: a big model whose backward legitimately takes minutes on a CPU still ticks
    every few milliseconds, while a rank wedged inside one kernel stops ticking. The hooks
    leave values and gradients untouched. Returns the handles (``.remove()`` them to undo).
    """

    def on_grad(_grad: Tensor) -> None:
        tick()  # returning None keeps the gradient as it is

    def on_forward(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        tick()
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(on_grad)
                break

    return [m.register_forward_hook(on_forward) for m in model.modules()]


class ReCoVerHSDPStrategy(ParallelStrategy):
    """HSDP with in-place recovery from replica failures; see the module docstring.

    Args:
        shards: ranks per replica (S); FSDP2 shards the model over them. 1 = plain replication.
        grad_accum: G_init, microbatches per contributing replica per step.
        target_replicas: T, contributing replicas (default: all); the rest start as spares.
        policy: "static" (ReCoVer: constant B = T * G_init) or "adaptive" (the ablation).
        min_replicas: stop with a clear error when fewer replicas are alive.
        bucket_mb: gradient bucket size for the cross-replica reduction.
        ledger_path: JSON-lines step ledger written by the current leader (None: no ledger).
        seed: seeds the sample order and the per-microbatch RNG.
        timeout_s: timeout of the replica-local process group.
        hang_timeout_s: a rank whose heartbeat stops this long is killed and its replica
            removed (:mod:`lightning_recover.watchdog`); default: the launcher's
            ``--hang-timeout``, else 10 s. ``0`` turns hang detection off.
        stuck_timeout_s: also kill a rank that is computing inside a step but makes no
            progress for this long; default: the hang timeout. Every module's forward and output gradient
            counts as progress (:func:`install_progress_hooks`), so only a single layer
            running this long looks stuck. Waiting in MPI and everything between steps
            (data loading, validation, checkpoints) never counts. ``0`` turns it off (and
            the hooks with it).
        checkpoint_dir: where the leader replica writes fallback checkpoints (None: none).
        checkpoint_every_n_steps: checkpoint period in committed steps.

    Checkpoints resume with ``trainer.fit(..., ckpt_path=resolve_ckpt_path("last", dir))``,
    also on a different number of replicas: B, G_init, T and the sample order come from
    the checkpoint, not from these arguments. The shard count must stay the same.
    """

    strategy_name = "recover_hsdp"

    def __init__(
        self,
        shards: int = 1,
        grad_accum: int = 1,
        target_replicas: int | None = None,
        policy: str = "static",
        min_replicas: int = 1,
        bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        ledger_path: str | os.PathLike[str] | None = None,
        seed: int = 0,
        timeout_s: float = 60.0,
        hang_timeout_s: float | None = None,
        stuck_timeout_s: float | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every_n_steps: int = 0,
    ) -> None:
        super().__init__(cluster_environment=ReplicaEnvironment())
        if not isinstance(shards, int) or shards < 1:
            raise ConfigurationError(f"shards must be a positive integer, got {shards!r}; set recover.shards")
        if not isinstance(grad_accum, int) or grad_accum < 1:
            raise ConfigurationError(f"grad_accum must be >= 1, got {grad_accum!r}; set recover.grad_accum to a positive integer")
        if policy not in POLICY_NAMES:
            raise ConfigurationError(f"unknown policy {policy!r}; choose one of {sorted(POLICY_NAMES)} (recover.policy)")
        if bucket_mb <= 0:
            raise ConfigurationError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.shards = shards
        self.grad_accum = grad_accum
        self.target_replicas = target_replicas
        self.policy_name = policy
        self.min_replicas = min_replicas
        self.bucket_bytes = max(4, int(bucket_mb * 2**20))
        self.ledger_path = os.fspath(ledger_path) if ledger_path is not None else None
        self.seed = seed
        self.timeout_s = timeout_s
        self.hang_timeout_s = default_hang_timeout() if hang_timeout_s is None else (hang_timeout_s or None)
        if stuck_timeout_s is not None and not stuck_timeout_s >= 0:
            raise ConfigurationError(f"stuck_timeout_s must be >= 0 seconds (0 = off), got {stuck_timeout_s}; set recover.stuck_timeout_s")
        self.stuck_timeout_s = self.hang_timeout_s if stuck_timeout_s is None else (stuck_timeout_s or None)
        self.watchdog: HangWatchdog | None = None
        if checkpoint_dir is not None and checkpoint_every_n_steps < 1:
            raise ConfigurationError(
                f"checkpoint_every_n_steps must be >= 1 with a checkpoint_dir, got {checkpoint_every_n_steps}; "
                "set recover.checkpoint.every_n_steps"
            )
        self.checkpoint_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self._resume: dict[str, Any] | None = None

        self.comm: FaultTolerantComm | None = None
        self.layout: RankLayout | None = None
        self.policy: WorkloadPolicy | None = None
        self.planner: MicrobatchPlanner | None = None
        self._dataset: Any = None
        self._collate: Callable[[list[Any]], Any] | None = None
        self._ledger: LedgerWriter | None = None
        self._ledger_leader = False
        self._history: list[dict[str, Any]] = []
        self._step: int = 0
        self._plan: StepPlan | None = None
        self._computed: list[int] = []
        self._losses: dict[int, float] = {}
        self._mb_counter = 0
        self._batch_idx = 0
        self._step_t0 = 0.0
        self._step_faults: list[int] = []
        self._recovery_s = 0.0
        self._detects: list[float] = []
        self._pauses: list[float] = []
        self.faults_seen = 0
        self.last_record: dict[str, Any] | None = None

    # ------------------------------------------------------------------ ranks
    @property
    def root_device(self) -> torch.device:
        if torch.cuda.is_available() and self.accelerator is not None and type(self.accelerator).__name__ == "CUDAAccelerator":
            return torch.device("cuda", self.cluster_environment.local_rank() % torch.cuda.device_count())  # type: ignore[union-attr]
        return torch.device("cpu")

    @property
    def global_rank(self) -> int:
        # The rank in the *current* world: when rank 0's replica dies, the lowest survivor becomes 0.
        return self.comm.world_rank if self.comm is not None else self.cluster_environment.global_rank()  # type: ignore[union-attr]

    @property
    def world_size(self) -> int:
        return self.comm.world.Get_size() if self.comm is not None else self.cluster_environment.world_size()  # type: ignore[union-attr]

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank()  # type: ignore[union-attr]

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def is_distributed(self) -> bool:
        # Data placement is ours (planner); Lightning must not inject a DistributedSampler.
        return False

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def handles_gradient_accumulation(self) -> bool:
        return True

    @property
    def replica(self) -> int:
        assert self.comm is not None
        return self.comm.replica

    @property
    def B(self) -> int:
        assert self.policy is not None
        return self.policy.B

    # ------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        from mpi4py import MPI

        self.layout = RankLayout(MPI.COMM_WORLD.Get_size(), self.shards)
        if self.target_replicas is not None and not 1 <= self.target_replicas <= self.layout.replicas:
            raise ConfigurationError(
                f"target_replicas={self.target_replicas} but the job has {self.layout.replicas} replicas "
                f"({self.layout.world_size} ranks / {self.shards} shards); set recover.target_replicas <= {self.layout.replicas}"
            )
        self.comm = FaultTolerantComm(self.layout, bucket_bytes=self.bucket_bytes)
        self.policy = make_policy(
            self.policy_name, self.layout.replicas, self.grad_accum, T=self.target_replicas, min_replicas=self.min_replicas
        )
        if self.hang_timeout_s:
            self.watchdog = HangWatchdog(self.comm.rank, self.hang_timeout_s, stuck_timeout=self.stuck_timeout_s).start()
        self._init_replica_group()
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
        super().setup_environment()

    def _init_replica_group(self) -> None:
        """torch's default group = this replica's S ranks, on a store hosted by its shard 0."""
        assert self.comm is not None and self.layout is not None
        addr = "127.0.0.1" if self._single_host() else socket.gethostbyname(socket.gethostname())
        timeout = timedelta(seconds=self.timeout_s)
        store = None
        if self.comm.shard == 0:
            # Port 0: the OS picks a free port at bind time, so no other process can take it
            # between choosing and binding; the port actually bound is then shared.
            store = dist.TCPStore(addr, 0, self.shards, is_master=True, timeout=timeout, wait_for_workers=False)
        table = self.comm.allgather_object((addr, store.port if store is not None else 0))
        master_addr, master_port = table[self.layout.rank_of(self.comm.replica, 0)]  # type: ignore[misc]
        if store is None:
            store = dist.TCPStore(master_addr, int(master_port), self.shards, is_master=False, timeout=timeout)
        backend = "nccl" if self.root_device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=store, rank=self.comm.shard, world_size=self.shards, timeout=timedelta(seconds=self.timeout_s)
        )

    def _single_host(self) -> bool:
        assert self.comm is not None
        hosts = self.comm.allgather_object(socket.gethostname())
        return len(set(hosts)) == 1  # type: ignore[arg-type]

    def setup(self, trainer: Trainer) -> None:
        self._validate_trainer(trainer)
        self._install_callbacks(trainer)
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.shards > 1:
            self._shard_model(self.model)
        if self.watchdog is not None and self.watchdog.stuck_timeout is not None:
            install_progress_hooks(self.model, self.watchdog.tick)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._sync_logger_versions(trainer)
        self._route_metric_sync(self.lightning_module)
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

    def _install_callbacks(self, trainer: Trainer) -> None:
        """Use the user's configured protocol callbacks, or install default ones."""
        for cls in (GradientSnapshot, EpochCheck, BoundaryScheduler):
            if not any(isinstance(c, cls) for c in trainer.callbacks):
                trainer.callbacks.append(cls())
        self._snapshot = self._callback(trainer, GradientSnapshot)
        self._epoch_check = self._callback(trainer, EpochCheck)
        self._boundary = self._callback(trainer, BoundaryScheduler)
        self._faults = [c for c in trainer.callbacks if isinstance(c, FaultInjection)]
        if self.checkpoint_dir is not None and not any(isinstance(c, ReplicaCheckpoint) for c in trainer.callbacks):
            trainer.callbacks.append(ReplicaCheckpoint(self.checkpoint_dir, self.checkpoint_every_n_steps))

    @staticmethod
    def _callback(trainer: Trainer, cls: type[Callback]) -> Any:
        return next(c for c in trainer.callbacks if isinstance(c, cls))

    def _shard_model(self, model: torch.nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard

        mesh = init_device_mesh(self.root_device.type, (self.shards,))
        if not any(isinstance(m, FSDPModule) for m in model.modules()):
            # One FSDP unit per repeated block (the members of ModuleLists), then the root.
            for container in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
                for block in container:
                    fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                # Sum inside the replica; the constant B*S divisor is applied after the cross-replica sum.
                m.set_force_sum_reduction_for_comms(True)
                m.set_gradient_divide_factor(1.0)

    def _sync_logger_versions(self, trainer: Trainer) -> None:
        """All ranks agree on the loggers' version so a new leader writes into the same run directory."""
        for lg in trainer.loggers:
            if hasattr(lg, "_version"):
                version = lg.version if self.global_rank == 0 else None
                lg._version = self.broadcast(version, 0)

    def _sync_initial_state(self) -> None:
        """Every replica starts from the lowest replica's weights, seeded or not (shard by shard)."""
        assert self.comm is not None and self.model is not None
        tensors = [_local(t.data) for t in [*self.model.parameters(), *self.model.buffers()]]
        comm = self.comm
        self._ft(lambda: comm.broadcast_tensors(tensors, root=0))

    def _route_metric_sync(self, module: torch.nn.Module | None) -> None:
        """torchmetrics syncs over torch's default group, which is replica-local here; send
        its gathers across the live replicas instead (every rank holds distinct samples;
        a spare's shadow updates would count twice, so log metrics from contributors)."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - torchmetrics is a dependency
            return
        if module is None:
            return
        for m in module.modules():
            if isinstance(m, Metric):
                m.dist_sync_fn = self._gather_for_metrics
                m.distributed_available_fn = lambda: self.comm is not None and self.world_size > 1

    def _gather_for_metrics(self, tensor: Tensor, group: Any | None = None) -> list[Tensor]:
        assert self.comm is not None
        comm = self.comm
        parts = self._ft(lambda: comm.allgather_object(tensor.detach().cpu()))
        return [p.to(tensor.device) for p in parts]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ data
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or isinstance(dataloader, _TicketLoader):
            return dataloader
        dataset = getattr(dataloader, "dataset", None)
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if dataset is None or iterable or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ConfigurationError(
                f"the train dataloader's dataset ({type(dataset).__name__}) is not map-style; lightning-recover fetches "
                "microbatches by id, so the dataset needs __len__ and __getitem__ (an IterableDataset cannot be replayed)"
            )
        batch_size = getattr(dataloader, "batch_size", None)
        if not batch_size:
            raise ConfigurationError("the train DataLoader needs a batch_size (the per-rank microbatch size)")
        assert self.policy is not None
        self._dataset = dataset
        self._collate = getattr(dataloader, "collate_fn", None) or torch.utils.data.default_collate
        self.planner = MicrobatchPlanner(len(dataset), self.policy.B, batch_size, shards=self.shards, seed=self.seed)
        if self._resume is not None:
            self.planner.load_state_dict(self._resume["planner"])
        steps = self.planner.samples_per_epoch // (self.policy.B * batch_size * self.shards)
        return _TicketLoader(max(1, steps))

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if isinstance(batch, StepTicket):
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    def _fetch(self, offset: int) -> Any:
        assert self.planner is not None and self.comm is not None and self._collate is not None
        gid = self.planner.global_id(self._step, offset)
        samples = [self._dataset[i] for i in self.planner.sample_indices(gid, self.comm.shard)]
        return self.batch_to_device(self._collate(samples))

    # ------------------------------------------------------------------ one step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if not (args and isinstance(args[0], StepTicket)):
            return super().training_step(*args, **kwargs)
        self._batch_idx = args[1] if len(args) > 1 else 0
        self._begin_step()
        with self._disarm_on_error():
            return self._forward(self._my_plan().ids[0])

    def _begin_step(self) -> None:
        assert self.policy is not None and self.comm is not None
        self._step = self.lightning_module.trainer.global_step  # type: ignore[union-attr]
        self._step_t0 = time.perf_counter()
        self._plan = self.policy.begin_step(self._step, self.comm.alive_replicas)
        self._computed, self._losses, self._mb_counter = [], {}, 0
        self._step_faults, self._recovery_s, self._pauses, self._detects = [], 0.0, [], []
        self._boundary.begin_step()
        self._epoch_check.begin_step()
        self._set_computing(True)

    def _my_plan(self) -> ReplicaPlan:
        assert self._plan is not None
        return self._plan.for_replica(self.replica)

    def _forward(self, offset: int) -> Any:
        """Forward of one microbatch (step-local id ``offset``) with its own RNG stream."""
        assert self.planner is not None and self.comm is not None
        self._inject("forward", microbatch=self._mb_counter)
        self._tick()
        gid = self.planner.global_id(self._step, offset)
        torch.manual_seed(self.planner.rng_seed(gid, self.comm.shard))
        batch = self._fetch(offset)
        with self.replica_guard("forward"):
            out = super().training_step(batch, self._batch_idx)
        loss = out["loss"] if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise TypeError(f"training_step must return a loss tensor (or a dict with 'loss'), got {type(out).__name__}")
        self._losses[offset] = float(loss.detach().float())
        self._computed.append(offset)
        return out

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        self._inject("backward", microbatch=self._mb_counter)
        self._tick()
        self._mb_counter += 1
        with self.replica_guard("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _run_microbatch(self, offset: int, optimizer: Optimizer) -> None:
        out = self._forward(offset)
        loss = out["loss"] if isinstance(out, Mapping) else out
        self.backward(loss, optimizer)

    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: LightningModule | torch.nn.Module | None = None, **kwargs: Any
    ) -> Any:
        model = model or self.lightning_module
        with self._disarm_on_error():
            result = closure()  # training_step(ticket) -> first microbatch, zero_grad, backward
            for offset in self._my_plan().ids[1:]:
                self._run_microbatch(offset, optimizer)
            divisor = self._reduce_until_committed(optimizer)
            self._after_reduce_hooks(model, optimizer)  # type: ignore[arg-type]
            self._inject("optimizer")
            self._tick()
            out = optimizer.step(**kwargs)
            self._set_computing(False)  # between steps nothing counts as stuck (module docstring of watchdog)
            self._finish_step(divisor)
        return result if result is not None else out

    def _after_reduce_hooks(self, model: LightningModule, optimizer: Optimizer) -> None:
        # on_before_optimizer_step and clipping see the reduced gradient, as with stock strategies.
        self.precision_plugin._after_closure(model, optimizer)

    # ------------------------------------------------------------------ reduce / recover
    def _local_grads(self) -> list[Tensor]:
        assert self.model is not None
        grads = []
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad
            grads.append(g.to_local() if hasattr(g, "to_local") else g)
        return grads

    def _reduce_until_committed(self, optimizer: Optimizer) -> int:
        """Reduce, agree, and on failure repair + recompute until one membership commits. Returns the divisor."""
        assert self.comm is not None and self.policy is not None and self._plan is not None
        comm = self.comm
        local = self._local_grads()
        out = self._snapshot.buffers(local)
        handle = comm.plan(local)
        loss_out = torch.zeros(2, dtype=torch.float64)
        t_fail: float | None = None
        while True:
            mine = self._my_plan()
            sent = self._snapshot.inputs(local, mine.contributes)
            loss_in = torch.tensor(
                [sum(self._losses[i] for i in mine.ids) if mine.contributes else 0.0, len(mine.ids) if mine.contributes else 0],
                dtype=torch.float64,
            )
            t_round = time.perf_counter()
            try:
                with self._waiting():
                    comm.allreduce(sent, out, handle=handle, on_bucket=self._on_bucket)
                    comm.allreduce([loss_in], [loss_out], across="world")
                ok = True
            except PeerFailure as exc:
                log.warning("step %d: %s", self._step, exc)
                ok = False
            with self._waiting():
                committed = comm.agree(ok)
            if committed:
                break
            # A round that ends in failure: the time blocked in it (reduce + agreement) bounds
            # how long a hung peer went unnoticed. The agreement counts too: a peer that hangs
            # after the others saw a death blocks them there, not in the reduce.
            self._detects.append(time.perf_counter() - t_round)
            if t_fail is None:
                t_fail = time.perf_counter()
            self._recover(handle, optimizer)
        self._epoch_check.verify(handle, comm.epoch)
        if t_fail is not None:
            pause = time.perf_counter() - t_fail
            self._pauses.append(pause)
            self._recovery_s += pause
        self._step_loss = float(loss_out[0]) / max(1.0, float(loss_out[1]))
        self._snapshot.commit(local, self._plan.divisor * self.shards)
        return self._plan.divisor

    def _on_bucket(self, bucket: int) -> None:
        # Between the MPI waits of two buckets this rank runs its own code: that counts.
        self._set_computing(True)
        self._inject("reduce", bucket=bucket)
        self._tick()
        self._set_computing(False)

    def _tick(self) -> None:
        if self.watchdog is not None:
            self.watchdog.tick()

    def _set_computing(self, computing: bool) -> None:
        if self.watchdog is not None:
            self.watchdog.computing = computing

    @contextmanager
    def _waiting(self) -> Iterator[None]:
        """Blocked in MPI on peers is not being stuck: the watchdog's progress rule pauses meanwhile."""
        if self.watchdog is None:
            yield
            return
        before, self.watchdog.computing = self.watchdog.computing, False
        try:
            yield
        finally:
            self.watchdog.computing = before
            self.watchdog.tick()

    @contextmanager
    def _disarm_on_error(self) -> Iterator[None]:
        """A step left by an exception (below min_replicas, a user error) is no longer computing."""
        try:
            yield
        except BaseException:
            self._set_computing(False)
            raise

    def _recover(self, handle: Any, optimizer: Optimizer) -> None:
        """Repair the world, let the policy re-plan, and compute this replica's extra microbatches."""
        assert self.comm is not None and self.policy is not None
        with self._waiting():
            res = self.comm.repair()
        self._epoch_check.note_repair(handle, res.epoch)
        self._on_membership_change(res.lost_replicas)
        self._plan = self.policy.fail(res.lost_replicas)
        sched = self._boundary.schedule(self._my_plan(), self._computed)
        if sched.reset:
            for g in self._local_grads():
                g.zero_()
            self._computed, self._losses = [], {}
        for offset in sched.run:
            self._run_microbatch(offset, optimizer)

    def _on_membership_change(self, lost_replicas: Sequence[int]) -> None:
        self._step_faults.extend(lost_replicas)
        self.faults_seen += len(lost_replicas)
        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank
        if self.comm is not None and self.global_rank == 0:
            print(
                f"[lightning-recover] world epoch {self.comm.epoch}: lost replica(s) {list(lost_replicas)}; "
                f"alive {list(self.comm.alive_replicas)}",
                file=sys.stderr,
                flush=True,
            )

    def _finish_step(self, divisor: int) -> None:
        assert self.policy is not None and self.planner is not None and self.comm is not None
        rec = self.policy.commit()
        self.planner.advance(self._step)
        record = rec.as_dict()
        record.update(
            loss=self._step_loss,
            world_epoch=self.comm.epoch,
            step_time_s=time.perf_counter() - self._step_t0,
            recovery_s=self._recovery_s,
            pauses_s=self._pauses,
            detect_s=sum(self._detects),
            detects_s=self._detects,
            stale_buckets=self._epoch_check.stale_redone,
            policy=self.policy_name,
            divisor=divisor,
        )
        self.last_record = record
        self._history = (self._history + [record])[-64:]
        self._write_ledger(record)
        lm = self.lightning_module
        if lm is not None:
            lm.log("step_loss", self._step_loss, prog_bar=True, on_step=True, rank_zero_only=True)
            lm.log("live_replicas", float(len(self.comm.alive_replicas)), prog_bar=True, on_step=True, rank_zero_only=True)
            lm.log("world_epoch", float(self.comm.epoch), prog_bar=True, on_step=True, rank_zero_only=True)
            lm.log("faults", float(self.faults_seen), prog_bar=True, on_step=True, rank_zero_only=True)

    # ------------------------------------------------------------------ ledger
    def _write_ledger(self, record: dict[str, Any] | None) -> None:
        """Leader only. ``None`` writes just the backlog: committed steps an old leader did not record."""
        if self.ledger_path is None or self.global_rank != 0:
            return
        if record is None:
            if not self._history:
                return
            if self._ledger is not None:
                return  # this rank has led all along: nothing is missing
            record = self._history[-1]
            done = {line["step"] for line in read_ledger(self.ledger_path)} if os.path.exists(self.ledger_path) else set()
            if record["step"] in done:
                return
        if self._ledger is None and self._resume is not None and not self._ledger_leader:
            # Resumed: steps after the checkpoint are redone, so their old lines go.
            keep = [line for line in read_ledger(self.ledger_path) if line["step"] < record["step"]] if os.path.exists(self.ledger_path) else []
            with LedgerWriter(self.ledger_path) as rewrite:
                for line in keep:
                    rewrite.write(line)
            self._ledger_leader = True
        if self._ledger is None:
            # A new leader appends, first writing any committed steps the old leader did not.
            fresh = not self._ledger_leader and record["step"] == 0
            self._ledger = LedgerWriter(self.ledger_path, append=not fresh)
            self._ledger_leader = True
            if not fresh:
                done = {line["step"] for line in read_ledger(self.ledger_path)} if os.path.exists(self.ledger_path) else set()
                for old in self._history[:-1]:
                    if old["step"] not in done:
                        self._ledger.write(old)
        self._ledger.write(record)

    # ------------------------------------------------------------------ faults
    def _inject(self, phase: str, *, step: int | None = None, microbatch: int | None = None, bucket: int | None = None) -> None:
        if self._faults and self.comm is not None:
            for cb in self._faults:
                cb.at(phase, step=self._step if step is None else step, rank=self.comm.rank, microbatch=microbatch, bucket=bucket)

    @contextmanager
    def replica_guard(self, where: str) -> Iterator[None]:
        """A communication error inside the replica means a replica-mate died: leave via the gate.

        Wrap your own replica-local collectives in it (e.g. gathering full parameters after
        ``fit``), so a partner's death there never becomes a crash of this rank."""
        try:
            yield
        except Exception as exc:
            if self.shards > 1 and self.comm is not None and _is_comm_error(exc):
                self.comm.gate_exit(f"replica-local collective failed during {where}: {exc}")
            raise

    # ------------------------------------------------------------------ collectives for Lightning
    def _ft(self, fn: Callable[[], Any]) -> Any:
        """Run a world collective; if a peer dies, repair and retry (the policy sees it next step)."""
        assert self.comm is not None
        while True:
            with self._waiting():
                try:
                    result, ok = fn(), True
                except PeerFailure:
                    result, ok = None, False
                if self.comm.agree(ok):
                    return result
                res = self.comm.repair()
            self._on_membership_change(res.lost_replicas)

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Tensor | Any:
        if not isinstance(tensor, Tensor) or self.comm is None:
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

        total = self._ft(_do)
        if op in ("mean", "avg"):
            total = total / self.world_size
        return total.to(tensor.device, tensor.dtype)

    def barrier(self, name: str | None = None) -> None:
        if self.comm is not None:
            self._ft(self.comm.barrier)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.comm is None:
            return obj
        comm = self.comm
        return self._ft(lambda: comm.bcast_object(obj, root=src))

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if self.comm is None:
            return tensor.unsqueeze(0)
        comm = self.comm
        parts = self._ft(lambda: comm.allgather_object(tensor.detach().cpu()))
        return torch.stack(parts).to(tensor.device)

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # sharded models load into their shards, so the model must be set up first

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.model is not None
        return {k: _local(v).detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.model is not None
        saved = checkpoint["state_dict"]
        own = self.model.state_dict()
        missing = sorted(set(own) - set(saved))
        if strict and missing:
            raise KeyError(f"checkpoint lacks {missing[:5]}; was it written for another model?")
        with torch.no_grad():
            for k, v in own.items():
                if k in saved:
                    _local(v).copy_(saved[k])

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        opt = getattr(optimizer, "_optimizer", optimizer)
        return _to_local_tree(opt.state_dict())

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for opt, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            opt.load_state_dict(state)
            for group in opt.param_groups:
                for p in group["params"]:
                    if not hasattr(p, "device_mesh"):
                        continue
                    from torch.distributed.tensor import DTensor

                    for key, value in opt.state.get(p, {}).items():
                        if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == p.to_local().shape:
                            opt.state[p][key] = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)

    def _recover_state(self) -> dict[str, Any]:
        assert self.policy is not None and self.planner is not None and self.comm is not None
        return {
            "B": self.policy.B, "grad_accum": self.policy.G_init, "target_replicas": self.policy.T, "shards": self.shards,
            "seed": self.seed, "policy_name": self.policy_name, "policy": self.policy.state_dict(),
            "planner": self.planner.state_dict(), "step": self.lightning_module.trainer.global_step,  # type: ignore[union-attr]
            "replicas": list(self.comm.alive_replicas), "world_epoch": self.comm.epoch,
            "rng": {"torch": torch.get_rng_state()},
        }

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Only the leader replica writes: one file per shard rank, renamed into place when all are done."""
        assert self.comm is not None
        if self.comm.alive_replicas[0] != self.replica:
            return
        final = os.path.abspath(os.fspath(filepath))
        directory, tmp = os.path.dirname(final), final + ".tmp"
        checkpoint["lightning_recover"] = self._recover_state()
        if self.comm.shard == 0:
            os.makedirs(tmp, exist_ok=True)
        self._replica_barrier("checkpoint start")
        part = os.path.join(tmp, f"shard{self.comm.shard}.pt")
        torch.save(checkpoint, part + ".part")
        fsync_path(part + ".part")
        self._inject("checkpoint", step=checkpoint["lightning_recover"]["step"])
        os.replace(part + ".part", part)
        self._replica_barrier("checkpoint written")
        if self.comm.shard == 0:
            publish(Path(directory), Path(tmp), Path(final), keep=2)

    def _replica_barrier(self, where: str) -> None:
        if self.shards > 1:
            with self.replica_guard(where):
                dist.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.comm is not None and self.layout is not None
        path = os.fspath(checkpoint_path)
        shard_file = os.path.join(path, f"shard{self.comm.shard}.pt")
        if not os.path.isfile(shard_file):
            raise FileNotFoundError(
                f"{shard_file!r} not found: {path!r} is not a lightning-recover checkpoint for recover.shards={self.shards}"
            )
        checkpoint = torch.load(shard_file, map_location="cpu", weights_only=False)
        state = checkpoint.get("lightning_recover")
        if state is None:
            raise ValueError(f"{path!r} was not written by ReCoVerHSDPStrategy (no 'lightning_recover' state)")
        if state["shards"] != self.shards:
            raise ConfigurationError(
                f"checkpoint {path!r} was written with shards={state['shards']} but this run has shards={self.shards}; "
                f"resume with recover.shards={state['shards']}"
            )
        self._adopt(state)
        return checkpoint

    def _adopt(self, state: dict[str, Any]) -> None:
        """Take B, G_init, T and the sample order from the checkpoint; fit the policy to today's replicas."""
        assert self.layout is not None
        self._resume = state
        self.seed = int(state["seed"])
        self.grad_accum, self.target_replicas = int(state["grad_accum"]), int(state["target_replicas"])
        W = self.layout.replicas
        if self.policy_name == "static":
            # Fewer replicas than T: the missing ones count as lost, B stays T * G_init.
            self.policy = make_policy("static", max(W, self.target_replicas), self.grad_accum, T=self.target_replicas, min_replicas=self.min_replicas)
        else:
            self.policy = make_policy(self.policy_name, W, self.grad_accum, min_replicas=self.min_replicas)
        if self.policy.B != int(state["B"]):
            raise ConfigurationError(f"cannot keep B={state['B']} with policy {self.policy_name!r} on {W} replicas")
        rank_zero_only(print)(
            f"[lightning-recover] resuming at step {state['step']} on {W} replica(s) (checkpoint had {len(state['replicas'])}); "
            f"B={state['B']} from the checkpoint",
            file=sys.stderr,
            flush=True,
        )

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        super().teardown()

    def shutdown(self, exit_code: int | None = None) -> None:
        """End of job for launched scripts: agree with survivors, then leave (see FaultTolerantComm.shutdown)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.comm is not None:
            with self._waiting():
                if not self.comm.agree(True):
                    # A replica died after the last commit (e.g. the leader before writing its
                    # ledger line): repair, and let a new leader record what is missing.
                    res = self.comm.repair()
                    self._on_membership_change(res.lost_replicas)
                    self._write_ledger(None)
                    self.comm.agree(True)
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.comm is not None:
            self.comm.shutdown(exit_code)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="HSDP with in-place ULFM recovery (lightning-recover)")


if ReCoVerHSDPStrategy.strategy_name not in StrategyRegistry:
    ReCoVerHSDPStrategy.register_strategies(StrategyRegistry)
