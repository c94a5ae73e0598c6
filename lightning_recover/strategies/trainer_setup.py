"""What the strategy sets up on Lightning's side before the protocol's first step.

* :func:`validate_trainer`: Trainer settings the recovery protocol cannot honour (and a
  callback with recovery hooks that is no ``RecoveryCallback``) are refused before the first step (``ConfigurationError``, fate ``user`` in
  :mod:`lightning_recover.errors`), each message naming the setting and the fix.
* :func:`install_callbacks`: the protocol's own callbacks (:data:`DEFAULT_CALLBACKS`, the
  silent-corruption check, the fallback checkpoint) join ``trainer.callbacks`` unless the
  user configured their own, before Lightning calls any callback's ``setup``.
* :class:`LightningBridge`: what the :class:`~lightning_recover.recovery.job.RecoveryJob` gets of
  Lightning (the trainer's callbacks, step and loggers; the strategy's device, gates and
  end) as one object, so the job itself imports no Lightning.
* :func:`quiet_console`, :func:`quiet_fence_warnings`: Lightning's console says what the
  user needs once, not once per rank, and nothing the strategy itself causes (its advice to
  start with ``srun``, which the strategy refuses; "Checkpoint directory ... exists and is not
  empty" when only the strategy's write fence is there).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_recover.audit.fence import FENCE_NAME
from lightning_recover.callbacks import (
    BoundaryScheduler,
    BufferSync,
    CorruptionCheck,
    EpochCheck,
    ReductionBuffers,
    fallback_checkpoint,
)
from lightning_recover.callbacks.checkpoint import is_fallback
from lightning_recover.comm.interface import PeerFailure
from lightning_recover.config import ConfigurationError, RecoverConfig
from lightning_recover.recovery.hooks import HookCalls, misnamed_hooks
from lightning_recover.strategies.probes import StrategyProbes
from lightning_recover.strategies.replica_group import init_replica_group

if TYPE_CHECKING:
    from lightning_recover.comm.communicator import FaultTolerantComm
    from lightning_recover.recovery.engine import Probes
    from lightning_recover.runtime.watchdog import HangWatchdog



class SetupHost(Protocol):
    """What building the job's host uses of the strategy (:class:`~lightning_recover.strategies.ReCoVerHSDPStrategy`
    is one): a protocol rather than the class, so that the strategy may import this module."""

    @property
    def lightning_module(self) -> Any: ...
    @property
    def parallel_devices(self) -> Any: ...
    @property
    def root_device(self) -> Any: ...
    @property
    def evaluating_batch(self) -> bool: ...
    def shutdown(self, exit_code: int | None = None) -> None: ...

__all__ = ["DEFAULT_CALLBACKS", "LightningBridge", "install_callbacks", "quiet_console", "quiet_fence_warnings", "validate_trainer"]

#: The protocol's own callbacks, installed when the user did not pass configured ones.
DEFAULT_CALLBACKS = (ReductionBuffers, EpochCheck, BoundaryScheduler, BufferSync)


def validate_trainer(trainer: Trainer, precision_plugin: Any) -> None:
    """Refuse gradient accumulation by the Trainer, a GradScaler, manual optimization, and recovery hooks
    on a callback that is no :class:`~lightning_recover.callbacks.RecoveryCallback`."""
    if trainer.accumulate_grad_batches != 1:
        raise ConfigurationError(
            f"accumulate_grad_batches={trainer.accumulate_grad_batches}: ReCoVerHSDPStrategy accumulates itself; "
            "remove accumulate_grad_batches from the Trainer and set grad_accum on the strategy (recover.grad_accum)"
        )
    scaler = getattr(precision_plugin, "scaler", None)
    if scaler is not None:
        raise ConfigurationError(
            f"precision={trainer.precision!r} uses a GradScaler, whose skipped steps would desynchronise replicas; "
            "use precision='bf16-mixed' or '32-true'"
        )
    if not trainer.lightning_module.automatic_optimization:
        raise ConfigurationError("ReCoVerHSDPStrategy needs automatic optimization (self.automatic_optimization = True)")
    for cb in trainer.callbacks:
        # Recovery hooks are typed calls on RecoveryHooks instances, never found by name: a callback that
        # only defines such a method would silently never hear of a loss or a commit.
        misnamed = misnamed_hooks(cb)
        if misnamed:
            raise ConfigurationError(
                f"callback {type(cb).__name__} defines the recovery hook(s) {', '.join(misnamed)} but is no RecoveryCallback, "
                "so they would never be called; subclass lightning_recover.callbacks.RecoveryCallback"
            )


def install_callbacks(trainer: Trainer, config: RecoverConfig) -> None:
    """The protocol's callbacks (unless the user configured their own) and the fallback checkpoint."""
    for cls in DEFAULT_CALLBACKS:
        if not any(isinstance(c, cls) for c in trainer.callbacks):
            trainer.callbacks.append(cls())
    sdc = config.sdc
    if sdc.enabled and not any(isinstance(c, CorruptionCheck) for c in trainer.callbacks):
        trainer.callbacks.append(CorruptionCheck(sdc.every_n_steps, sdc.action))
    ckpt = config.checkpoint
    if ckpt.enabled and not any(is_fallback(c, ckpt.dir) for c in trainer.callbacks):  # type: ignore[arg-type]
        trainer.callbacks.append(fallback_checkpoint(ckpt.dir, ckpt.every_n_steps))  # type: ignore[arg-type]


class LightningBridge:
    """What the job gets of Lightning (:class:`~lightning_recover.recovery.job.JobBridge`): ``trainer``'s callbacks,
    step and loggers, and the strategy's device, rank gates and end; the job itself imports no Lightning.

    ``on_ranks`` and ``on_membership`` are the strategy's reactions to a changed world (its
    rank-zero gates, its logging), which are not part of its public surface."""

    def __init__(
        self, strategy: SetupHost, trainer: Trainer, *, on_ranks: Callable[[], None], on_membership: Callable[[], None]
    ) -> None:
        self._strategy, self._trainer = strategy, trainer
        self._on_ranks, self._on_membership = on_ranks, on_membership
        self.hooks = HookCalls(lambda: trainer.callbacks, lambda: (trainer, strategy.lightning_module))

    def device_type(self) -> str:
        return str(self._strategy.root_device.type)

    def devices(self) -> int:
        return len(self._strategy.parallel_devices or ())

    def make_probes(self, rank: int, watchdog: HangWatchdog | None) -> Probes:
        return StrategyProbes(rank, watchdog, lambda: self._trainer.callbacks)

    def step(self) -> int:
        return self._trainer.global_step

    def logger_versions(self) -> list[Any]:
        return [getattr(lg, "version", None) for lg in self._trainer.loggers]

    def evaluating(self) -> bool:
        return self._strategy.evaluating_batch

    def on_ranks(self) -> None:
        self._on_ranks()

    def on_membership(self) -> None:
        self._on_membership()

    def init_replica_group(
        self, comm: FaultTolerantComm, shards: int, timeout_s: float, backend: str, *, gather: Callable[[Any], list[Any]]
    ) -> None:
        init_replica_group(comm, shards, timeout_s, backend, gather=gather)

    def end_of_job(self) -> None:
        self._strategy.shutdown()


#: Lightning's advice when an ``srun`` binary is on the PATH but did not start this process
#: (``SLURMEnvironment._validate_srun_used``): the strategy refuses a direct srun start
#: (:mod:`lightning_recover.runtime.slurm`), so the advice would lead the user astray.
SRUN_ADVICE = r"The `srun` command is available on your system but is not used"


#: What Lightning's ``utilities/_pytree.py`` makes torch warn in every process (nothing the user can change).
LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


def quiet_console(rank: int) -> None:
    """Before the Trainer exists: Lightning's rank-zero messages (its "GPU available" banner, tips) print on
    this launch rank's rank zero only, and its srun advice is left out.

    Lightning guesses the rank at import from torchrun's and Slurm's variables, none of which
    mpiexec sets, so every rank believed it was rank zero until the strategy's setup.
    """
    rank_zero_only.rank = fabric_rank_zero_only.rank = rank
    warnings.filterwarnings("ignore", message=SRUN_ADVICE)
    if rank != 0:
        # Lightning 2.6's own use of a torch pytree API torch 2.13 deprecates: rank zero says it once.
        warnings.filterwarnings("ignore", message=LEAFSPEC_DEPRECATION)
    engine_log = logging.getLogger("lightning_recover.recovery.engine")
    if not any(isinstance(f, _PeerFailureOnRankZero) for f in engine_log.filters):
        engine_log.addFilter(_PeerFailureOnRankZero())


class _PeerFailureOnRankZero(logging.Filter):
    """The step engine's warning that a peer failure interrupted a step, from rank zero only.

    Every survivor meets the same failure and would say so (some before they know which rank
    died); the world's rank zero then says what was lost and what the repair cost
    (:meth:`lightning_recover.recovery.job.RecoveryJob.on_repair`). Other warnings pass on every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return rank_zero_only.rank == 0 or not any(isinstance(a, PeerFailure) for a in args)


def quiet_fence_warnings(config: RecoverConfig) -> None:
    """ModelCheckpoint's "Checkpoint directory D exists and is not empty" is left out for each directory
    the job fences that holds nothing but the write fence (:mod:`lightning_recover.audit.fence`).

    The fenced directories are the ledger's and ``recover.checkpoint.dir``
    (:meth:`lightning_recover.recovery.job.RecoveryJob.start`). The fence is written when the
    job starts, before ModelCheckpoint's setup looks at its directory; a directory with
    anything else in it (an earlier run's checkpoints) still warns."""
    directories = [os.path.dirname(os.path.abspath(config.ledger_path))] if config.ledger_path is not None else []
    if config.checkpoint.dir is not None:
        directories.append(config.checkpoint.dir)
    for directory in directories:
        try:
            entries = os.listdir(directory)
        except OSError:
            continue
        if entries != [FENCE_NAME]:
            continue
        for form in {os.fspath(directory), os.path.realpath(directory), os.path.abspath(directory)}:
            warnings.filterwarnings("ignore", message=f"Checkpoint directory {re.escape(form)} exists and is not empty")
