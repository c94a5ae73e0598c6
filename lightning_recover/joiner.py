"""Entry point of a replacement rank: ``python -m lightning_recover.joiner SEAT SCRIPT [ARGS...]``.

The survivors spawn this (:mod:`lightning_recover.rejoin`); nobody runs it by hand. It
initializes MPI and merges with the survivors first -- before the script imports torch and
Lightning, which takes seconds -- so the survivors' Spawn returns about as fast as a bare
interpreter starts and they train on while this process gets ready. Then it runs the
user's script under its original argv; the strategy finds the seat with
:func:`lightning_recover.rejoin.seat` and joins at a step boundary.

A timer bounds the whole wait: a replacement that is not admitted within the seat's
timeout (its attempt was dropped, the survivors died or finished) leaves by itself; if it
is wedged inside MPI (MPI_Init with its parents gone), SIGALRM ends it shortly after.
"""

from __future__ import annotations

import math
import os
import runpy
import signal
import sys
import threading

from lightning_recover import lifecycle, rejoin


#: Seconds past the timeout after which the kernel ends a replacement the timer thread could not.
_BACKSTOP_S = 15


def _leave_after(seconds: float, rank_hint: str) -> threading.Timer:
    """Leave if not admitted within ``seconds``: a timer thread says why and exits; SIGALRM
    (its default action ends the process) backs it up, since a process stuck in MPI_Init --
    its survivors gone -- never gives the timer thread the interpreter."""

    def expire() -> None:
        if not _admitted.is_set():
            print(f"[lightning-recover] replacement {rank_hint}: not admitted after {seconds:g} s; leaving", file=sys.stderr, flush=True)
            os._exit(0)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(max(1, math.ceil(seconds)) + _BACKSTOP_S)
    return timer


#: Set by the strategy once this process is a member of the world (then the timer is moot).
_admitted = threading.Event()


def admitted() -> None:
    """The strategy's signal that this replacement joined the world."""
    _admitted.set()
    signal.alarm(0)


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: python -m lightning_recover.joiner SEAT SCRIPT [ARGS...] (spawned by lightning-recover)")
    seat = rejoin.Seat.from_json(argv[0])
    timeout = float(seat.context.get("timeout_s", 120.0))
    _leave_after(timeout, f"of attempt {seat.attempt}")
    lifecycle.prepare_mpi()
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise SystemExit("lightning_recover.joiner runs only as a spawned replacement (no parent communicator)")
    merged = parent.Merge(high=True)
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    children = MPI.COMM_WORLD.Dup()
    children.Set_errhandler(MPI.ERRORS_RETURN)
    rejoin._set_joining(rejoin.Joining(seat, children, merged))
    sys.argv = argv[1:]
    runpy.run_path(argv[1], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
