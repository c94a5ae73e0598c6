"""A replacement's process runs the user's script as its seat: the job's environment, then the script.

Shared by every kind of replacement: a cold spawn and a warm standby
(:mod:`lightning_recover.cli.joiner`) and an orphan seated again (salvage,
:mod:`lightning_recover.membership.orphan`). Until it is admitted, a replacement whose script
ends, exits or raises leaves by ``SIGKILL`` (see :func:`left_before_admission`).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
import traceback
from typing import NoReturn

from lightning_recover.membership.admission_timer import is_admitted
from lightning_recover.membership.seat import Joining, Seat, _set_joining
from lightning_recover.runtime import lifecycle

__all__ = ["job_environment", "left_before_admission", "run_seat"]


def job_environment(seat: Seat, child_rank: int) -> dict[str, str]:
    """What the script of the ``child_rank``-th process of ``seat``'s spawn must find in its environment:
    the survivors' job settings (:func:`lightning_recover.membership.seat.job_environ`) and the
    launcher variables of the job's world, this process's being the logical rank it takes over."""
    world = seat.context.get("world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise SystemExit(f"lightning_recover.cli.joiner: the seat has no job world size (context world_size={world!r}); "
                         "the survivors run another version of lightning-recover: install one version on every node")
    environ = {str(k): str(v) for k, v in dict(seat.context.get("environ", {})).items()}
    environ.update({"OMPI_COMM_WORLD_SIZE": str(world), "OMPI_COMM_WORLD_RANK": str(seat.ranks[child_rank])})
    return environ


def left_before_admission(rank: int, how: str) -> NoReturn:
    """Leave as a process failure the survivors are told about ("Leaving before admission" in
    :mod:`lightning_recover.cli.joiner`: Open MPI reports a killed process, not every non-zero exit)."""
    print(f"[lightning-recover] replacement for rank {rank}: {how} before it was admitted; leaving by SIGKILL",
          file=sys.__stderr__, flush=True)
    sys.stdout.flush()
    time.sleep(lifecycle.OUTPUT_DRAIN_S)  # Open MPI drops the output of a process killed right after writing it
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL ends the process")  # for the type checker


def run_seat(seat: Seat, merged: object, script_argv: list[str], link: object = None, children: object = None) -> None:
    """Run the user's script as the replacement of ``seat`` (merged now, or by connect() for a standby).

    ``children``: this replacement's own processes in the order of ``seat.ranks`` (default: its
    spawn's MPI_COMM_WORLD; an orphan passes the communicator of its re-formation's orphans)."""
    from mpi4py import MPI

    if children is None:
        children = MPI.COMM_WORLD.Dup()
        children.Set_errhandler(MPI.ERRORS_RETURN)
    joining = Joining(seat, children, merged, link)  # type: ignore[arg-type]
    _set_joining(joining)
    try:
        os.environ.update(job_environment(seat, children.Get_rank()))
    except SystemExit as exc:
        print(exc, file=sys.__stderr__, flush=True)
        left_before_admission(joining.rank, "its seat could not be read")
    sys.argv = script_argv
    try:
        runpy.run_path(script_argv[0], run_name="__main__")
    except SystemExit as exc:
        if is_admitted():
            raise
        code = exc.code if exc.code is not None else 0
        if isinstance(code, str):  # sys.exit("message"): Python would print it and exit with status 1
            print(code, file=sys.__stderr__, flush=True)
            code = 1
        left_before_admission(joining.rank, f"the script exited (status {code})")
    except BaseException:
        if is_admitted():
            raise
        traceback.print_exc(file=sys.__stderr__)
        left_before_admission(joining.rank, "the script raised")
    if not is_admitted():
        left_before_admission(joining.rank, "the script ended")
