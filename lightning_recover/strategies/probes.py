"""What watches a step from outside: the hang watchdog's progress rule and fault injection.

The step engine reports through :class:`~lightning_recover.recovery.engine.Probes`; this is
the strategy's implementation. The watchdog (:mod:`lightning_recover.runtime.watchdog`) must tell
a rank *stuck in compute* from one that is slow or merely waiting on peers: the rank is
"computing" only inside a step, not while blocked in a collective, and it ticks per layer
(:func:`install_progress_hooks`). Fault injection fires the scheduled kills of
:class:`~lightning_recover.callbacks.FaultInjection` callbacks at the named points.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_recover.callbacks.fault_injection import FaultInjection
from lightning_recover.recovery.engine import Probes
from lightning_recover.runtime.watchdog import HangWatchdog


#: Forward time between two outputs whose gradient ticks too. A tensor hook costs more than the
#: tick (on every output, 2 % of a profiled rank's main thread); a layer's backward takes about as long
#: as its forward, so backward still ticks every few milliseconds, far inside the stuck rule's
#: seconds.
GRAD_TICK_SPACING_S = 1e-3


def install_progress_hooks(
    model: torch.nn.Module, tick: Callable[[], None], grad_spacing_s: float = GRAD_TICK_SPACING_S
) -> list[Any]:
    """Tick at the end of every module's forward, and when the gradient of an output is computed
    (outputs at least ``grad_spacing_s`` of forward time apart).

    This makes the stuck-in-compute rule measure progress per layer rather than per
    microbatch: a big model whose backward legitimately takes minutes on a CPU still ticks
    every few milliseconds, while a rank wedged inside one kernel stops ticking. The hooks
    leave values and gradients untouched; inside a ``torch.compile``'d region they do nothing
    (so a compiled block ticks once per call, and its compilation, which ticks never, must take
    less than ``stuck_timeout_s``). Returns the handles (``.remove()`` them to undo).
    """
    last = [-math.inf]

    def on_grad(_grad: Tensor) -> None:
        tick()  # returning None keeps the gradient as it is

    def on_forward(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            # A module inside a torch.compile'd block: tracing the clock would split the user's graph
            # (a graph break per module). The compiled block's own call, outside the graph, still ticks.
            return
        tick()
        now = time.monotonic()
        if now - last[0] < grad_spacing_s:
            return
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(on_grad)
                last[0] = now
                break

    return [m.register_forward_hook(on_forward) for m in model.modules()]


class StrategyProbes(Probes):
    """Watchdog and fault-injection glue for one rank (original world rank ``rank``)."""

    def __init__(self, rank: int, watchdog: HangWatchdog | None, callbacks: Callable[[], Iterable[object]]) -> None:
        self.rank = rank
        self.watchdog = watchdog
        self._callbacks = callbacks

    @override
    @contextmanager
    def waiting(self) -> Iterator[None]:
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

    @override
    def tick(self) -> None:
        if self.watchdog is not None:
            self.watchdog.tick()

    @override
    def set_computing(self, computing: bool) -> None:
        if self.watchdog is not None:
            self.watchdog.computing = computing

    @override
    def fault_point(self, phase: str, *, step: int, microbatch: int | None = None, bucket: int | None = None) -> None:
        for cb in self._callbacks():
            if isinstance(cb, FaultInjection):
                cb.at(phase, step=step, rank=self.rank, microbatch=microbatch, bucket=bucket)
