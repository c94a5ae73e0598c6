"""The commit rule of in-step recovery: only a step whose every bucket was reduced under
the current membership (one world epoch) may reach the optimizer."""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from lightning_recover.communicator import ReduceHandle


class StaleBucketError(RuntimeError):
    """A bucket reduced under an older world epoch was about to be committed."""


class EpochCheck(Callback):
    """Verifies bucket epochs before commit and counts the stale buckets that were redone."""

    def __init__(self) -> None:
        self.stale_redone = 0

    def begin_step(self) -> None:
        self.stale_redone = 0

    def note_repair(self, handle: ReduceHandle, epoch: int) -> list[int]:
        """Buckets made stale by the repair that moved the world to ``epoch``; they will be redone."""
        stale = handle.stale(epoch)
        self.stale_redone += len(stale)
        return stale

    def verify(self, handle: ReduceHandle, epoch: int) -> None:
        bad = [(i, b.epoch) for i, b in enumerate(handle.buckets) if b.epoch != epoch]
        if bad:
            raise StaleBucketError(
                f"buckets {bad[:8]} (index, epoch) are not from the current world epoch {epoch}; "
                "refusing to commit a step reduced under two memberships"
            )
