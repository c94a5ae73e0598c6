"""Boundary-step scheduling: which microbatches a survivor runs after a failure.

After a repair the policy hands every survivor the full set of step-local ids it must
hold in its gradient accumulator at commit. This callback turns that into work: the ids
not yet computed (the extra microbatches of a boundary step), or -- for a spare that was
reassigned from shadowing to replaying -- a reset of its accumulator first. A promoted
spare already holds its ids: it runs nothing.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_recover.callbacks.base import RecoveryCallback
from lightning_recover.recovery.state import Schedule, StepState


class BoundaryScheduler(RecoveryCallback):
    """Sets ``step.requests.schedule`` after every repair inside a step."""

    @override
    def on_boundary_step(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        want, have = set(step.mine.ids), set(step.work.computed)
        if not have <= want:
            # Only a spare turned replayer gets here: its shadow work duplicates a live
            # contributor's, so dropping it loses nothing.
            step.requests.schedule = Schedule(True, tuple(sorted(want)))
        else:
            step.requests.schedule = Schedule(False, tuple(sorted(want - have)))
