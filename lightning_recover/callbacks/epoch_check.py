"""The commit rule of in-step recovery: only a step whose every bucket was reduced under
the current membership (one world epoch) may reach the optimizer.

After each repair it counts the buckets the new world epoch made stale (they are rolled
back and reduced again: the count goes to the ledger as ``stale_buckets``); before the
commit it refuses a step that still holds a bucket from another world epoch.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_recover.callbacks.base import RecoveryCallback
from lightning_recover.comm.interface import RepairResult
from lightning_recover.errors import RecoverError
from lightning_recover.recovery.state import StepState


class StaleBucketError(RecoverError, RuntimeError):
    """A bucket reduced under an older world epoch was about to be committed."""


class EpochCheck(RecoveryCallback):
    """Counts the stale buckets redone after a repair and verifies bucket world epochs before commit."""

    @override
    def on_world_repaired(self, trainer: Any, pl_module: Any, repair: RepairResult, step: StepState | None) -> None:
        if step is not None and step.reduction.handle is not None and not step.agreed:
            step.failures.stale_buckets_redone += len(step.reduction.handle.stale(repair.world_epoch))

    @override
    def on_before_commit(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        assert step.reduction.handle is not None
        bad = [(i, b.world_epoch) for i, b in enumerate(step.reduction.handle.buckets) if b.world_epoch != step.world_epoch]
        if bad:
            raise StaleBucketError(
                f"buckets {bad[:8]} (index, world epoch) are not from the current world epoch {step.world_epoch}; "
                "refusing to commit a step reduced under two memberships"
            )
