"""Process lifecycle of one rank of a fault-tolerant job: how it starts, how it leaves.

The communicator (:mod:`lightning_recover.communicator`) detects failures and repairs the
world; this module owns everything that touches the *process*: MPI start-up settings, the
excepthook, signals raised on ourselves or on a peer, the launcher's status markers and
the final exit. Importing it (or any module of the package) changes no process-wide
state; each function below does one documented thing when it is called. Pure standard
library: mpi4py is imported only by :func:`prepare_mpi`.

Lifecycle of a rank (the strategy's ``setup_environment`` and ``shutdown`` drive it)::

    prepare_mpi()                        before mpi4py.MPI is first imported: no MPI_Finalize at exit
    comm = FaultTolerantComm(layout)     MPI is initialized; the communicator checks ULFM
    start_rank(comm.rank, world_size)    crash hook (multi-rank jobs), "started" marker, "ok" at exit
    ... training: PeerFailure -> agree -> repair, inside the communicator ...
    end_job(comm, exit_code)             agree with the survivors, free, marker, os._exit

Error model -- every way a rank leaves, and what the rest of the job sees:

* **Normal end.** :func:`end_job` with ``exit_code=0`` (or a plain interpreter exit after
  :func:`start_rank`) leaves an ``ok.R`` marker. A deliberate non-zero exit (fewer live
  replicas than ``min_replicas``) leaves ``exited.R``; both tell the launcher that the job
  ended on purpose.
* **Replica-consistency gate.** A rank whose own replica lost a member calls
  :func:`gate_exit` and is killed by :data:`GATE_SIGNAL` (status :data:`GATE_EXIT_CODE`), so
  the other replicas only ever see whole replicas disappear.
* **Uncaught exception.** With :func:`install_crash_hook` the traceback is printed and the
  rank is killed by :data:`CRASH_SIGNAL`; the other replicas recover from it like from any
  replica failure, and if every rank hits the same bug the job ends.
* **Hung peer.** The watchdog (same host, from heartbeats) and the communicator's repair
  (for ranks MPI declared dead) end it with :func:`kill_process`, which checks the pid
  still names the same process before sending SIGKILL.

Why signals and never ``sys.exit(nonzero)``: Open MPI 5.0.11 with ULFM never finishes
aborting a job when a rank exits with a plain non-zero status -- the other ranks are
neither killed nor told and spin forever -- while a rank killed by a signal is an ordinary
ULFM process failure that the survivors repair. No marker is written by a rank killed by
a signal; the launcher reads "started but no ok/exited anywhere" as "nobody survived".
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Literal, NoReturn

from lightning_recover.launcher import ENV_STATUS_DIR

if TYPE_CHECKING:
    from lightning_recover.communicator import FaultTolerantComm

#: Signal a rank raises on itself when its replica lost a member (see :func:`gate_exit`).
GATE_SIGNAL = signal.SIGUSR1
#: The shell exit status of such a rank (128 + signal number).
GATE_EXIT_CODE = 128 + int(GATE_SIGNAL)
#: The words every gate exit prints on stderr (tests and users grep for them).
GATE_MESSAGE = "replica-consistency gate"
#: How a rank with an uncaught exception leaves (see :func:`install_crash_hook`).
CRASH_SIGNAL = signal.SIGKILL

#: A status marker: ``started`` (the communicator is up), ``ok`` (ended normally),
#: ``exited`` (stopped on purpose with a non-zero status).
Status = Literal["started", "ok", "exited"]

# Open MPI's runtime drops output a rank wrote just before it was killed: give it a moment.
_OUTPUT_DRAIN_S = 0.3

_crash_hook_installed = False
_started_rank: int | None = None


# ---------------------------------------------------------------------- start
def prepare_mpi() -> bool:
    """Tell mpi4py not to call ``MPI_Finalize`` at interpreter exit; call before MPI is imported.

    With ULFM, ``MPI_Finalize`` can block forever: after a peer failure (it waits for the
    dead rank) and always while Open MPI's failure-detector thread runs. Each rank leaves
    with its own exit status instead (:func:`end_job`), which the fault-tolerant runtime
    accepts. mpi4py reads the setting when ``mpi4py.MPI`` is first imported, so it only takes
    effect before that; the launcher also sets ``MPI4PY_RC_FINALIZE=false`` in the ranks'
    environment, which covers a script that imported mpi4py.MPI earlier.

    Returns True when the setting took effect (mpi4py.MPI was not imported yet).
    """
    import mpi4py

    if "mpi4py.MPI" in sys.modules:
        return False
    mpi4py.rc.finalize = False
    return True


def start_rank(rank: int, world_size: int) -> None:
    """Set up this process as rank ``rank`` of a ``world_size``-rank job, once the communicator is up.

    Installs the crash hook when there are peers to protect (a single process keeps
    Python's normal exit status), writes the ``started`` marker and registers the ``ok``
    marker for a normal interpreter exit. Calling it again for the same rank does nothing.
    """
    global _started_rank
    if _started_rank is not None:
        if _started_rank != rank:
            raise RuntimeError(f"this process already started as rank {_started_rank}; it cannot also be rank {rank}")
        return
    if world_size > 1:
        install_crash_hook()
    mark_status("started", rank)
    atexit.register(mark_status, "ok", rank)
    _started_rank = rank


def install_crash_hook() -> None:
    """Make an uncaught exception end this rank by :data:`CRASH_SIGNAL` instead of a non-zero exit.

    The previous hook prints the traceback first. See the module docstring for why a
    signal: a crash on one node becomes a replica failure the others recover from.
    """
    global _crash_hook_installed
    if _crash_hook_installed:
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        previous(exc_type, exc, tb)  # type: ignore[arg-type]
        print(f"[lightning-recover] uncaught {exc_type.__name__}: this rank leaves by {CRASH_SIGNAL.name}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        time.sleep(_OUTPUT_DRAIN_S)
        os.kill(os.getpid(), CRASH_SIGNAL)

    sys.excepthook = hook
    _crash_hook_installed = True


# ---------------------------------------------------------------------- markers
def mark_status(what: Status, rank: int) -> None:
    """Leave the marker ``<what>.<rank>`` in the launcher's status directory, if it gave one.

    The launcher (:func:`lightning_recover.launcher.launch`) sets ``LIGHTNING_RECOVER_STATUS_DIR``
    and, after the job, reads the markers to tell a job in which no rank survived from one
    that ended normally (with ULFM, mpiexec reports 0 either way). Outside the launcher,
    or if the directory is gone, this does nothing: a marker is a hint, never a failure.
    """
    if what not in ("started", "ok", "exited"):
        raise ValueError(f"status marker must be 'started', 'ok' or 'exited', got {what!r}")
    directory = os.environ.get(ENV_STATUS_DIR)
    if directory and os.path.isdir(directory):
        try:
            open(os.path.join(directory, f"{what}.{rank}"), "w").close()
        except OSError:
            pass


# ---------------------------------------------------------------------- leaving
def gate_exit(rank: int, reason: str) -> NoReturn:
    """Leave through the replica-consistency gate: one stderr line, then :data:`GATE_SIGNAL`.

    The line reads ``[lightning-recover] rank R: replica-consistency gate: REASON; leaving
    with SIGUSR1 (status 138)``. Any handler installed for the signal is reset first, so
    the process really dies by it.
    """
    print(
        f"[lightning-recover] rank {rank}: {GATE_MESSAGE}: {reason}; leaving with {GATE_SIGNAL.name} (status {GATE_EXIT_CODE})",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    time.sleep(_OUTPUT_DRAIN_S)
    signal.signal(GATE_SIGNAL, signal.SIG_DFL)
    os.kill(os.getpid(), GATE_SIGNAL)
    time.sleep(5)  # the signal is delivered before this returns; never run on as a zombie member
    os._exit(GATE_EXIT_CODE)


def end_job(comm: FaultTolerantComm, exit_code: int | None = None) -> None:
    """End of job: agree with the survivors (nobody leaves while a peer still needs it), free.

    With ``exit_code`` the process then writes its marker (``ok`` for 0, ``exited`` for a
    deliberate non-zero stop such as fewer than ``min_replicas``) and exits at once,
    without ``MPI_Finalize``: after a peer failure Open MPI's finalize can block on the
    dead rank, which would hang the job at the very end of a successful run. Without it
    the caller returns normally and the ``ok`` marker comes from :func:`start_rank`'s
    exit handler.
    """
    comm.agree(True)
    comm.free()
    if exit_code is not None:
        mark_status("ok" if exit_code == 0 else "exited", comm.rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


# ---------------------------------------------------------------------- peers
def _proc_stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time)`` of ``pid`` from /proc, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces and parentheses: split after the last ")".
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], fields[19]
    except (OSError, IndexError):
        return None


def process_start_time(pid: int) -> str | None:
    """Start time of ``pid`` (clock ticks since boot, from /proc), or None when there is none.

    Together with the pid it names one process for good: a recycled pid has a later start.
    """
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def kill_process(pid: int, start_time: str | None, reason: str, *, by: str, target: str = "process") -> bool:
    """SIGKILL ``pid`` if it is still the live process that started at ``start_time``.

    The one way this package ends a peer (the watchdog's hung ranks, the communicator's
    fencing of ranks MPI declared dead). It refuses, returning False, when the pid is gone,
    now belongs to another process (its start time differs, or ``start_time`` is unknown),
    or is already dead and waiting to be reaped; so a pid recycled by the OS is never hit.
    When it kills, it prints ``[lightning-recover] BY: killing TARGET (pid PID): REASON`` on
    stderr and returns True.
    """
    if pid == os.getpid():
        raise ValueError(f"kill_process was asked to kill its own process (pid {pid}); leave through gate_exit or the crash hook")
    stat = _proc_stat(pid)
    if stat is None or start_time is None or stat[1] != start_time:
        return False
    if stat[0] in ("Z", "X"):
        return False  # already dead: nothing left to fence
    print(f"[lightning-recover] {by}: killing {target} (pid {pid}): {reason}", file=sys.stderr, flush=True)
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    return True
