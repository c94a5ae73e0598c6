"""The admission timer of a replacement rank: how long it may wait to become a member.

A replacement or a seated standby (:mod:`lightning_recover.cli.joiner`, its entry point) that
is not admitted within its seat's timeout leaves by itself -- its attempt was dropped, the
survivors died or finished -- so the survivors never wait on it and nothing is left behind.
The survivors' side of the exchange (:mod:`lightning_recover.recovery.rejoin`) tells it
when it is a member (:func:`admitted`) or gives it the full timeout again when their own
repair dropped the attempt (:func:`restart_timer`).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["admitted", "disarm", "is_admitted", "leave_after", "left_the_world", "restart_timer"]

_BACKSTOP_S = 15


_timer: threading.Timer | None = None
_timer_args: tuple[float, str, Callable[[str], object] | None] | None = None


def leave_after(seconds: float, rank_hint: str, leave: Callable[[str], object] | None = None) -> threading.Timer:
    """Leave if not admitted within ``seconds``: a timer thread says why and exits; SIGALRM
    (its default action ends the process) backs it up, since a process stuck in MPI_Init --
    its survivors gone -- never gives the timer thread the interpreter. A second call
    replaces the first timer. ``leave(reason)`` replaces the plain exit: a rank of the launch
    (a seated orphan) must leave by a signal, as the gate does, since Open MPI answers a launch
    rank's exit without ``MPI_Finalize`` by aborting the job."""
    global _timer, _timer_args
    if _timer is not None:
        _timer.cancel()
    _timer_args = (seconds, rank_hint, leave)

    def expire() -> None:
        if not _admitted.is_set():
            why = f"not admitted after {seconds:g} s"
            if leave is not None:
                leave(why)
            print(f"[lightning-recover] replacement {rank_hint}: {why}; leaving", file=sys.stderr, flush=True)
            os._exit(0)

    timer = _timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(seconds)) + _BACKSTOP_S)
    return timer


def disarm() -> None:
    """Cancel the timer and its SIGALRM backstop (a standby that reached its indefinite wait)."""
    global _timer, _timer_args
    if _timer is not None:
        _timer.cancel()
    _timer, _timer_args = None, None
    signal.alarm(0)


def restart_timer() -> None:
    """A standby's replacement asks to be merged again (its attempt was dropped by the survivors'
    repair): it gets the full ``rejoin.timeout_s`` again."""
    if _timer_args is not None and not _admitted.is_set():
        leave_after(*_timer_args)


#: Set by the strategy once this process is a member of the world (then the timer is moot).
_admitted = threading.Event()


def admitted() -> None:
    """The strategy's signal that this replacement joined the world."""
    _admitted.set()
    signal.alarm(0)


def left_the_world() -> None:
    """This process is out of the world again (a seated orphan orphaned a second time): its next admission
    is timed and awaited as the first was."""
    _admitted.clear()


def is_admitted() -> bool:
    """Whether this process is a member of the world already (then nothing times it out)."""
    return _admitted.is_set()
