"""How a rank waits for an MPI collective of the step: spinning, or leaving the core.

Open MPI waits by polling: a rank blocked in a collective keeps its core busy until the
last peer arrives. With a core per rank that is the fastest wait. On a host running more
of the job's ranks than it has cores (4 ranks on this project's 2-core machine) the
spinning rank takes the core from the very peer it waits for, and every synchronization
of the step (the in-replica all-gathers, the cross-replica reduction, the step's loss
reduction) then costs a scheduler time slice. Open MPI's own answer,
``mpi_yield_when_idle`` (on by default when oversubscribed), calls ``sched_yield``, which
gives nothing to a peer queued on another core.

So on an oversubscribed host the collectives on the step's path are issued non-blocking
and waited for by :func:`wait`: a short burst of tests (a peer already there completes in
microseconds), then sleeps doubling from 20 us to a cap. Over shared memory a message is in
its receiver's queue when the send returns, so the cap (0.5 ms) is about the most a wait
adds once the last peer arrived. Over TCP -- a member of another MPI job (a spawned
replacement, whose traffic Open MPI never carries over shared memory) or another host --
every hop of a collective waits until its receiver's next test reads the socket, and a
collective of several hops pays a pause per hop: with 2 of 4 ranks spawned an 8-float
all-reduce took 3.2 ms at a 0.5 ms cap, 1.0 ms at 0.1 ms, against 0.1 ms in one job
(``benchmarks/mixed_world.py``). So the world's cap is 0.1 ms once any two members are
not of one host and one job (:func:`reach`); a repair keeps the cap of the world it shrinks.
Failure semantics are those of the blocking call: under
``MPI_ERRORS_RETURN`` a test raises ``MPI.Exception`` when a peer died or the
communicator was revoked. With a core per rank (or another launcher) the callers use the
blocking call.

Every member of a communicator must wait the same way: MPI never matches a blocking
collective with a non-blocking one, so a rank spinning in ``MPI_Allreduce`` next to one in
``MPI_Iallreduce`` deadlocks. The choice is therefore the world's, not the rank's: when a
world forms (job start, every re-join) the communicator gathers each member's
:func:`local_choice` and :func:`reach` and every member adopts :func:`agree` of them (polite
if any member's host is oversubscribed; the TCP cap if the members' reaches differ);
:func:`polite` and :func:`max_pause` return that, read at every call.

``LIGHTNING_RECOVER_MPI_WAIT=spin`` (or ``sleep``) overrides the local choice, for benchmarks.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable
from typing import Any

__all__ = ["agree", "local_choice", "max_pause", "oversubscribed", "polite", "reach", "wait"]

#: Tests before the first sleep, and the sleep's bounds (it doubles after each test): the cap
#: of a world on shared memory, and of one with a member reached over TCP.
SPIN_TESTS = 50
MIN_PAUSE_S = 2e-5
MAX_PAUSE_S = 5e-4
MAX_PAUSE_TCP_S = 1e-4


def oversubscribed() -> bool:
    """Whether this host runs more of the job's ranks than it has cores.

    Open MPI tells each rank how many ranks share its host (``OMPI_COMM_WORLD_LOCAL_SIZE``);
    the host's cores are ``os.cpu_count()`` (not this process's affinity: a rank bound to
    one core of a large host is not oversubscribed). Not launched by Open MPI: False.
    """
    local = os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    return local.isdigit() and int(local) > (os.cpu_count() or 1)


#: The world's choice and cap (:func:`agree`); None and the shared-memory cap until this process joined a world.
_agreed: bool | None = None
_max_pause: float = MAX_PAUSE_S


def local_choice() -> bool:
    """This rank's own preference: wait politely on an oversubscribed host, unless overridden."""
    choice = os.environ.get("LIGHTNING_RECOVER_MPI_WAIT", "auto").strip().lower()
    if choice not in ("auto", "spin", "sleep"):
        raise ValueError(
            f"LIGHTNING_RECOVER_MPI_WAIT must be auto, spin or sleep, got {choice!r}; unset it for auto"
        )
    return choice == "sleep" or (choice == "auto" and oversubscribed())


def reach() -> str:
    """Whom this process shares memory with: its host and its MPI job (PMIx namespace; a spawn has its own)."""
    return f"{socket.gethostname()}/{os.environ.get('PMIX_NAMESPACE', '')}"


def agree(choices: Iterable[bool], reaches: Iterable[str] = ()) -> bool:
    """Adopt the world's wait from every member's :func:`local_choice` and :func:`reach` (each
    member calls it with the same lists): polite if any member would be, and the TCP cap on the
    sleeps if the members are not all of one host and one job."""
    global _agreed, _max_pause
    _agreed = any(choices)
    _max_pause = MAX_PAUSE_S if len(set(reaches)) <= 1 else MAX_PAUSE_TCP_S
    return _agreed


def max_pause() -> float:
    """The longest sleep of :func:`wait` in this world (see the module docstring)."""
    return _max_pause


def polite() -> bool:
    """Whether the step's collectives wait with :func:`wait`: the world's choice, else (no world yet) this rank's."""
    return _agreed if _agreed is not None else local_choice()


def wait(request: Any) -> None:
    """Complete an MPI request: test, then test and sleep, until done (raises what ``Test`` raises)."""
    tests, pause = 0, 0.0
    while not request.Test():
        tests += 1
        if tests > SPIN_TESTS:
            time.sleep(pause)
            pause = min(_max_pause, max(MIN_PAUSE_S, 2 * pause))
