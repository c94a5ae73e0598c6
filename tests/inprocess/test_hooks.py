"""The recovery hooks as typed calls: who receives them, in which order, with which arguments.

:class:`~lightning_recover.recovery.hooks.HookCalls` is how the step engine reaches the
callbacks; the engine tests (test_engine*.py) run it inside whole steps, these check the
contract itself: only :class:`RecoveryHooks` instances are called, in list order, with the
list read at every call, and a hook that communicates gets the engine's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_recover.callbacks import RecoveryCallback
from lightning_recover.recovery.engine import StepEngine
from lightning_recover.recovery.hooks import HookCalls, RecoveryHooks, StepCollectives, misnamed_hooks
from lightning_recover.recovery.state import StepState
from lightning_recover.testing.fake import FakeComm, FakeWorld
from lightning_recover.workload.factory import make_policy


class Seen(RecoveryHooks):
    def __init__(self, name: str, calls: list[tuple[Any, ...]]) -> None:
        self.name, self.calls = name, calls

    def on_before_reduce(self, trainer: Any, pl_module: Any, step: StepState, collectives: StepCollectives) -> None:
        self.calls.append((self.name, "before_reduce", trainer, pl_module, step, collectives))

    def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any], collectives: StepCollectives) -> None:
        self.calls.append((self.name, "step_committed", trainer, pl_module, record, collectives))


class DuckTyped:
    """Defines a hook's method without being a RecoveryHooks: never called, and named by misnamed_hooks."""

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any], collectives: StepCollectives) -> None:
        self.calls.append(("duck",))


def test_only_recovery_hooks_are_called_in_list_order_with_the_context() -> None:
    calls: list[tuple[Any, ...]] = []
    callbacks: list[object] = [Seen("a", calls), DuckTyped(calls), object(), Seen("b", calls)]
    hooks = HookCalls(lambda: callbacks, lambda: ("trainer", "module"))
    coll = StepCollectives(None, lambda fn: fn())  # type: ignore[arg-type]
    record = {"step": 3}
    hooks.step_committed(record, coll)
    assert calls == [("a", "step_committed", "trainer", "module", record, coll), ("b", "step_committed", "trainer", "module", record, coll)]


def test_the_callback_list_is_read_at_every_call() -> None:
    calls: list[tuple[Any, ...]] = []
    callbacks: list[object] = []
    hooks = HookCalls(lambda: callbacks)
    coll = StepCollectives(None, lambda fn: fn())  # type: ignore[arg-type]
    hooks.step_committed({}, coll)
    callbacks.append(Seen("late", calls))  # as the strategy adds LeaderLogs after the job started
    hooks.step_committed({}, coll)
    assert [c[:2] for c in calls] == [("late", "step_committed")]
    assert calls[0][2:4] == (None, None), "without a context, (trainer, pl_module) is (None, None) as in the engine tests"


def test_the_default_reaches_no_callback() -> None:
    HookCalls().before_commit(None)  # type: ignore[arg-type]


def test_misnamed_hooks_names_the_methods_a_plain_object_would_never_receive() -> None:
    assert misnamed_hooks(DuckTyped([])) == ["on_step_committed"]
    assert misnamed_hooks(Seen("a", [])) == []
    assert misnamed_hooks(RecoveryCallback()) == []
    assert misnamed_hooks(object()) == []


def test_step_collectives_run_through_the_engines_run_collective() -> None:
    ran: list[str] = []

    def run_collective(fn: Callable[[], Any]) -> Any:
        ran.append("engine")
        return fn()

    coll = StepCollectives("comm", run_collective)  # type: ignore[arg-type]
    assert coll.comm == "comm"
    assert coll.run(lambda: 7) == 7 and ran == ["engine"]


def test_the_engine_hands_its_own_comm_and_run_collective_to_the_hooks() -> None:
    seen: dict[int, list[tuple[Any, ...]]] = {}

    class Gather(RecoveryCallback):
        """A hook that communicates: gathers every rank's step through the collectives it is given."""

        def __init__(self, calls: list[tuple[Any, ...]]) -> None:
            self.calls = calls

        def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any], collectives: StepCollectives) -> None:
            comm: Any = collectives.comm
            total = torch.tensor([float(record["step"] + 1)], dtype=torch.float64)
            out = torch.empty_like(total)
            collectives.run(lambda: comm.allreduce([total], [out], across="world"))
            self.calls.append((collectives, float(out[0])))

    from lightning_recover.callbacks import BoundaryScheduler, EpochCheck, ReductionBuffers

    class Runner:
        def __init__(self, engine: StepEngine) -> None:
            self.engine, self.grads = engine, [torch.zeros(4, dtype=torch.float64)]

        def run_microbatch(self, offset: int) -> None:
            self.grads[0].add_(1.0)
            self.engine.record(offset, 1.0)

        def local_grads(self) -> list[torch.Tensor]:
            return self.grads

    def train(comm: FakeComm) -> None:
        calls = seen.setdefault(comm.rank, [])
        callbacks: list[object] = [ReductionBuffers(), EpochCheck(), BoundaryScheduler(), Gather(calls)]
        engine = StepEngine(comm, make_policy("static", 2, 1), hooks=HookCalls(lambda: callbacks))
        runner = Runner(engine)
        state = engine.begin(0)
        engine.run(runner, state.mine.ids)
        engine.reduce_until_committed(runner)
        engine.finish()
        assert calls[0][0] is engine.collectives and engine.collectives.comm is comm

    FakeWorld(2, 1, 4, timeout=30.0).run(train)
    assert {r: [c[1] for c in calls] for r, calls in seen.items()} == {0: [2.0], 1: [2.0]}
