"""Recovery hooks: the points of the protocol where callbacks act, as typed method calls.

The step engine reaches the callbacks through :class:`HookCalls`, one typed method per
hook. Each call runs the hook on every object in ``trainer.callbacks`` that is a
:class:`RecoveryHooks` (a :class:`~lightning_recover.callbacks.RecoveryCallback` is one), in
list order, with ``(trainer, pl_module, ...)`` first as Lightning does. Nothing is looked
up by name: a callback takes part by subclassing :class:`RecoveryHooks` and overriding its
methods (a callback that only defines a method of the same name is refused at the
strategy's setup, see :func:`misnamed_hooks`). The protocol's own decisions live in
callbacks that implement them (rollback buffers, the world-epoch commit rule, boundary
scheduling); a user's callback can implement any of them too, e.g. to alert on a lost
replica. Every hook runs on every rank of every live replica.

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
                          gradients are not final yet, only their tensors are.
                          ``collectives`` (:class:`StepCollectives`) runs a collective of
                          its own (a cross-check of the replicas' gradients)
on_bucket_reduced         after bucket ``index`` completed in world epoch ``world_epoch``
on_world_repaired         after a repair removed replicas (``repair.lost_replicas``) and moved
                          the world to ``repair.world_epoch``; ``step`` is None outside a step.
                          Each lost replica is reported exactly once.
on_boundary_step          after the policy re-planned a step hit by a failure; sets
                          ``step.requests.schedule`` (which extra microbatches this replica runs)
on_before_commit          the step's reduction is agreed; last chance to refuse (raise)
                          before the sums reach the gradients and the optimizer
on_step_committed         the optimizer stepped; ``record`` is the step's ledger line;
                          ``collectives`` runs a collective of its own (buffer sync, the
                          corruption check's comparison and repair)
on_replicas_joined        between steps: replicas ``joins`` (:class:`~.state.Join`) entered
                          the world and the policy; ``next_step`` is the first step they
                          take part in (its record lists them in ``joined`` / ``joins``)
========================  =================================================================

A hook that communicates gets its collectives as an argument (:class:`StepCollectives`:
the engine's communicator and its fault-tolerant way to run a collective) rather than
reaching into the strategy for them, so the engine decides which collectives a hook may
run, and a hook is testable with a stand-in.

Pure Python: no Lightning import, so the engine is testable without a Trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from lightning_recover.comm.interface import RepairResult, ReplicaComm
    from lightning_recover.recovery.state import Join, StepState

__all__ = ["HookCalls", "RecoveryHooks", "StepCollectives", "misnamed_hooks"]

T = TypeVar("T")


class StepCollectives:
    """The collectives a hook may run, handed to it by the engine.

    ``comm`` is the engine's communicator (a
    :class:`~lightning_recover.comm.communicator.FaultTolerantComm` in a job, a
    :class:`~lightning_recover.testing.fake.FakeComm` in tests); :meth:`run` runs a
    collective over it as :meth:`~lightning_recover.recovery.engine.StepEngine.run_collective`
    does: if a peer dies, the world is repaired and ``fn`` runs again, until one membership
    agrees it completed.
    """

    def __init__(self, comm: ReplicaComm, run_collective: Callable[[Callable[[], Any]], Any]) -> None:
        self.comm = comm
        self._run = run_collective

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` (a collective over :attr:`comm`), retried after a repair until one membership agrees."""
        result: T = self._run(fn)
        return result


class RecoveryHooks:
    """No-op implementations of every recovery hook; subclass (with a Lightning Callback) and override.

    Only instances of this class receive the hooks (:class:`HookCalls`)."""

    def on_before_overlap(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        """Before the last backward of ``step``, when its first reduction round would overlap it."""

    def on_before_reduce(self, trainer: Any, pl_module: Any, step: StepState, collectives: StepCollectives) -> None:
        """Before each reduction round of ``step``."""

    def on_bucket_reduced(self, trainer: Any, pl_module: Any, step: StepState, index: int, world_epoch: int) -> None:
        """Bucket ``index`` of ``step`` was reduced in ``world_epoch``."""

    def on_world_repaired(self, trainer: Any, pl_module: Any, repair: RepairResult, step: StepState | None) -> None:
        """Replicas were lost and the world moved to ``repair.world_epoch``."""

    def on_boundary_step(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        """The policy re-planned ``step`` after a failure; set ``step.requests.schedule``."""

    def on_before_commit(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        """``step`` is agreed; raise to refuse the commit."""

    def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any], collectives: StepCollectives) -> None:
        """The optimizer stepped; ``record`` is the step's ledger line."""

    def on_replicas_joined(self, trainer: Any, pl_module: Any, joins: tuple[Join, ...], next_step: int) -> None:
        """Between steps, ``joins`` were admitted; they take part from ``next_step`` on."""


#: The hooks' method names, read off the class (for :func:`misnamed_hooks` only: nothing is called by name).
_HOOK_METHODS = frozenset(name for name in vars(RecoveryHooks) if name.startswith("on_"))


def misnamed_hooks(obj: object) -> list[str]:
    """The recovery hooks ``obj`` defines without being a :class:`RecoveryHooks`: they would never be called.

    The strategy refuses such a callback at setup (before, hooks were found by name, so a
    plain Lightning callback with an ``on_step_committed`` method received it)."""
    if isinstance(obj, RecoveryHooks):
        return []
    return sorted(_HOOK_METHODS & set(dir(type(obj))))


class HookCalls:
    """How the engine calls the recovery hooks: one typed method per hook, each calling it on every
    :class:`RecoveryHooks` among the callbacks, in list order.

    ``callbacks`` and ``context`` (the ``(trainer, pl_module)`` pair) are read at every
    call, so callbacks added later are reached too. The default reaches no callback.
    """

    def __init__(
        self,
        callbacks: Callable[[], Iterable[object]] = tuple,
        context: Callable[[], tuple[Any, Any]] = lambda: (None, None),
    ) -> None:
        self._callbacks = callbacks
        self._context = context

    def _receivers(self) -> tuple[Any, Any, list[RecoveryHooks]]:
        """``(trainer, pl_module)`` and the callbacks that receive hooks, as they are now."""
        trainer, module = self._context()
        return trainer, module, [cb for cb in list(self._callbacks()) if isinstance(cb, RecoveryHooks)]

    def before_overlap(self, step: StepState) -> None:
        trainer, module, receivers = self._receivers()
        for cb in receivers:
            cb.on_before_overlap(trainer, module, step)

    def before_reduce(self, step: StepState, collectives: StepCollectives) -> None:
        trainer, module, receivers = self._receivers()
        for cb in receivers:
            cb.on_before_reduce(trainer, module, step, collectives)

    def bucket_reduced(self, step: StepState, index: int, world_epoch: int) -> None:
        trainer, module, receivers = self._receivers()
        for cb in receivers:
            cb.on_bucket_reduced(trainer, module, step, index, world_epoch)

    def world_repaired(self, repair: RepairResult, step: StepState | None) -> None:
        trainer, module, receivers = self._receivers()
        for cb in receivers:
            cb.on_world_repaired(trainer, module, repair, step)

    def boundary_step(self, step: StepState) -> None:
        trainer, module, receivers = self._receivers()
        for cb in receivers:
            cb.on_boundary_step(trainer, module, step)

    def before_commit(self, step: StepState) -> None:
        trainer, module, receivers = self._receivers()
        for cb in receivers:
            cb.on_before_commit(trainer, module, step)

    def step_committed(self, record: dict[str, Any], collectives: StepCollectives) -> None:
        trainer, module, receivers = self._receivers()
        for cb in receivers:
            cb.on_step_committed(trainer, module, record, collectives)

    def replicas_joined(self, joins: tuple[Join, ...], next_step: int) -> None:
        trainer, module, receivers = self._receivers()
        for cb in receivers:
            cb.on_replicas_joined(trainer, module, joins, next_step)
