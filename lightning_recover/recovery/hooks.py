"""Recovery hooks: the points of the protocol where callbacks act, dispatched like Lightning's own.

The step engine calls these on every object in ``trainer.callbacks`` that defines them,
in list order, with ``(trainer, pl_module, ...)`` first as Lightning does. The protocol's
own decisions live in callbacks that implement them (rollback buffers, the world-epoch
commit rule, boundary scheduling); a user's callback can implement any of them too, e.g.
to alert on a lost replica. Every hook runs on every rank of every live replica.

========================  =================================================================
hook                      when, and what it may do
========================  =================================================================
on_before_overlap         before the last planned backward of a step, when the engine
                          overlaps the first reduction round with it; set
                          ``step.reduction.overlap = False`` to reduce only after backward (a check
                          that needs this replica's whole local gradient first)
on_before_reduce          before each reduction round of a step (one per membership); sets
                          ``step.reduction.send`` / ``step.reduction.out`` (what is sent, where sums land). For
                          an overlapped first round it runs before the last backward: the
                          gradients are not final yet, only their tensors are
on_bucket_reduced         after bucket ``index`` completed in world epoch ``world_epoch``
on_world_repaired         after a repair removed replicas (``repair.lost_replicas``) and moved
                          the world to ``repair.world_epoch``; ``step`` is None outside a step.
                          Each lost replica is reported exactly once.
on_boundary_step          after the policy re-planned a step hit by a failure; sets
                          ``step.requests.schedule`` (which extra microbatches this replica runs)
on_before_commit          the step's reduction is agreed; last chance to refuse (raise)
                          before the sums reach the gradients and the optimizer
on_step_committed         the optimizer stepped; ``record`` is the step's ledger line
on_replicas_joined        between steps: replicas ``joins`` (:class:`~.state.Join`) entered
                          the world and the policy; ``next_step`` is the first step they
                          take part in (its record lists them in ``joined`` / ``joins``)
========================  =================================================================

Pure Python: no Lightning import, so the engine is testable without a Trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_recover.comm.interface import RepairResult
    from lightning_recover.recovery.state import Join, StepState

RECOVERY_HOOKS = (
    "on_before_overlap",
    "on_before_reduce",
    "on_bucket_reduced",
    "on_world_repaired",
    "on_boundary_step",
    "on_before_commit",
    "on_step_committed",
    "on_replicas_joined",
)

#: ``dispatch(hook_name, *args)``: how the engine reaches the callbacks.
Dispatch = Callable[..., None]


class RecoveryHooks:
    """No-op implementations of every recovery hook; subclass (with a Lightning Callback) and override."""

    def on_before_overlap(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        """Before the last backward of ``step``, when its first reduction round would overlap it."""

    def on_before_reduce(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        """Before each reduction round of ``step``."""

    def on_bucket_reduced(self, trainer: Any, pl_module: Any, step: StepState, index: int, world_epoch: int) -> None:
        """Bucket ``index`` of ``step`` was reduced in ``world_epoch``."""

    def on_world_repaired(self, trainer: Any, pl_module: Any, repair: RepairResult, step: StepState | None) -> None:
        """Replicas were lost and the world moved to ``repair.world_epoch``."""

    def on_boundary_step(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        """The policy re-planned ``step`` after a failure; set ``step.requests.schedule``."""

    def on_before_commit(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        """``step`` is agreed; raise to refuse the commit."""

    def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any]) -> None:
        """The optimizer stepped; ``record`` is the step's ledger line."""

    def on_replicas_joined(self, trainer: Any, pl_module: Any, joins: tuple[Join, ...], next_step: int) -> None:
        """Between steps, ``joins`` were admitted; they take part from ``next_step`` on."""


def dispatcher(
    callbacks: Callable[[], Iterable[object]], context: Callable[[], tuple[Any, Any]] = lambda: (None, None)
) -> Dispatch:
    """A :data:`Dispatch` calling ``hook(trainer, pl_module, *args)`` on each callback defining it.

    ``callbacks`` and ``context`` (the ``(trainer, pl_module)`` pair) are read at every
    call, so callbacks added later are reached too.
    """

    def dispatch(name: str, *args: Any) -> None:
        if name not in RECOVERY_HOOKS:
            raise ValueError(f"unknown recovery hook {name!r}; known: {', '.join(RECOVERY_HOOKS)}")
        trainer, module = context()
        for cb in list(callbacks()):
            fn = getattr(cb, name, None)
            if callable(fn):
                fn(trainer, module, *args)

    return dispatch
