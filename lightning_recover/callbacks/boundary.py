"""Boundary-step scheduling: which microbatches a survivor runs after a failure.

After a repair the policy hands every survivor the full set of step-local ids it must
hold in its gradient accumulator at commit. This callback turns that into work: the ids
not yet computed (the extra microbatches of a boundary step), or -- for a spare that was
reassigned from shadowing to replaying -- a reset of its accumulator first.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from lightning.pytorch.callbacks import Callback

from lightning_recover.policy import ReplicaPlan


@dataclass(frozen=True)
class Schedule:
    reset: bool  # discard the accumulator (it holds ids this replica no longer owns)
    run: tuple[int, ...]  # step-local ids to compute now, in order


class BoundaryScheduler(Callback):
    """Decides the extra microbatches of a boundary step; counts them for the ledger."""

    def __init__(self) -> None:
        self.extra_this_step = 0

    def begin_step(self) -> None:
        self.extra_this_step = 0

    def schedule(self, plan: ReplicaPlan, computed: Collection[int]) -> Schedule:
        want, have = set(plan.ids), set(computed)
        if not have <= want:
            # Only a spare turned replayer gets here: its shadow work duplicates a live
            # contributor's, so dropping it loses nothing.
            self.extra_this_step += len(want)
            return Schedule(True, tuple(sorted(want)))
        todo = tuple(sorted(want - have))
        self.extra_this_step += len(todo)
        return Schedule(False, todo)
