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

**The job's world.** A replacement's ``MPI.COMM_WORLD`` and the launcher's variables
(``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``) describe its *spawn*: the k processes
of its attempt. The script must see the job it joins -- a fault schedule naming rank 3 of
a 4-rank job is valid there, and ``rank0.json`` must not be written by a replacement of
rank 2 -- so before the script runs this sets ``OMPI_COMM_WORLD_SIZE`` to the job's size
and ``OMPI_COMM_WORLD_RANK`` to the logical rank taken over (:func:`job_environment`),
along with the survivors' own job settings (``LR_*``, ``LIGHTNING_RECOVER_*``, e.g. the
example's run directory stamp). Here, once, because every reader (the strategy's cluster
environment, the example's configuration and fault-schedule checks, a script's own rank
checks) reads these variables and none runs before the script; MPI read its own settings
at initialization, above, so nothing in MPI changes. ``MPI.COMM_WORLD`` itself cannot be
changed, and neither are the per-host ``OMPI_COMM_WORLD_LOCAL_*`` (they describe this
spawn's placement): ask the strategy (``strategy.world_size``) or ``OMPI_COMM_WORLD_SIZE``
for the job's size, never ``MPI.COMM_WORLD.Get_size()``.

**Leaving before admission.** A replacement whose script ends before it was admitted --
``sys.exit(3)`` from a failed check, an uncaught exception, or simply returning -- leaves
by ``SIGKILL`` after one stderr line, never by a plain exit status: Open MPI 5.0.11 does not
reliably tell the survivors about a spawned process that exited with a non-zero status (of
two in one attempt, only one ever reached them; see also :mod:`lightning_recover.lifecycle`),
while a killed one is an ordinary process failure,
and the survivors drop the attempt at their next step boundary instead of after
``rejoin_timeout_s``. (The survivors never wait on an unreported death either; this only
makes the drop prompt.) After admission the script's exit is the script's.
"""

from __future__ import annotations

import math
import os
import runpy
import signal
import sys
import threading
import time
from typing import NoReturn
import traceback

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


def job_environment(seat: rejoin.Seat, child_rank: int) -> dict[str, str]:
    """What the script of the ``child_rank``-th process of ``seat``'s spawn must find in its environment:
    the survivors' job settings (:func:`lightning_recover.rejoin.job_environ`) and the
    launcher variables of the job's world, this process's being the logical rank it takes over."""
    world = seat.context.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise SystemExit(f"lightning_recover.joiner: the seat has no job world size (context world_size={world!r}); "
                         "the survivors run another version of lightning-recover: install one version on every node")
    environ = {str(k): str(v) for k, v in dict(seat.context.get("environ", {})).items()}
    environ.update({"OMPI_COMM_WORLD_SIZE": str(world), "OMPI_COMM_WORLD_RANK": str(seat.ranks[child_rank])})
    return environ


def _left_before_admission(rank: int, how: str) -> NoReturn:
    """Leave as a process failure the survivors are told about (see the module docstring)."""
    print(f"[lightning-recover] replacement for rank {rank}: {how} before it was admitted; leaving by SIGKILL",
          file=sys.__stderr__, flush=True)
    sys.stdout.flush()
    time.sleep(lifecycle.OUTPUT_DRAIN_S)  # Open MPI drops the output of a process killed right after writing it
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL ends the process")  # for the type checker


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
    rejoin.say_hello(merged)
    children = MPI.COMM_WORLD.Dup()
    children.Set_errhandler(MPI.ERRORS_RETURN)
    joining = rejoin.Joining(seat, children, merged)
    rejoin._set_joining(joining)
    try:
        os.environ.update(job_environment(seat, children.Get_rank()))
    except SystemExit as exc:
        print(exc, file=sys.__stderr__, flush=True)
        _left_before_admission(joining.rank, "its seat could not be read")
    sys.argv = argv[1:]
    try:
        runpy.run_path(argv[1], run_name="__main__")
    except SystemExit as exc:
        if _admitted.is_set():
            raise
        code = exc.code if exc.code is not None else 0
        if isinstance(code, str):  # sys.exit("message"): Python would print it and exit with status 1
            print(code, file=sys.__stderr__, flush=True)
            code = 1
        _left_before_admission(joining.rank, f"the script exited (status {code})")
    except BaseException:
        if _admitted.is_set():
            raise
        traceback.print_exc(file=sys.__stderr__)
        _left_before_admission(joining.rank, "the script raised")
    if not _admitted.is_set():
        _left_before_admission(joining.rank, "the script ended")


if __name__ == "__main__":
    main(sys.argv[1:])
