"""Process lifecycle of one rank of a fault-tolerant job: how it starts, how it leaves.

The communicator (:mod:`lightning_recover.comm.communicator`) detects failures and repairs the
world; this module owns everything that touches the *process*: MPI start-up settings, the
excepthook, signals raised on ourselves or on a peer, the launcher's status markers and
the final exit. Importing it (or any module of the package) changes no process-wide
state; each function below does one documented thing when it is called. Pure standard
library: mpi4py is imported only by :func:`prepare_mpi`.

Lifecycle of a rank (the strategy's ``setup_environment`` drives it; the end runs by itself)::

    prepare_mpi()                        before mpi4py.MPI is first imported: no MPI_Finalize at exit
    install_crash_hook(rank)             as soon as MPI says the job has peers (before any check can raise)
    comm = FaultTolerantComm(layout)     MPI is initialized; the communicator checks ULFM
    start_rank(rank, world, end_of_job)  crash hook, "started" marker, the end of job at interpreter exit
    ... training: PeerFailure -> agree -> repair, inside the communicator ...
    (script ends) -> end_of_job()        agree with the survivors, free, "ok" marker, quick exit
    end_job(comm, exit_code)             the same end on demand, then os._exit(exit_code)

Error model -- every way a rank leaves, and what the rest of the job sees:

* **Normal end.** The script simply ends: :func:`start_rank`'s exit handler runs the
  strategy's end of job (agree with the survivors, withdraw the heartbeat, free the
  communicators) and leaves an ``ok.R`` marker; Python keeps its own exit status. Nothing
  to call; :func:`end_job` with ``exit_code=0`` does the same at once. A deliberate non-zero
  stop (fewer live replicas than ``min_replicas``: ``end_job(comm, 3)``) leaves ``exited.R``;
  both tell the launcher that the job ended on purpose.
* **Replica-consistency gate.** A rank whose own replica lost a member calls
  :func:`gate_exit` and is killed by :data:`GATE_SIGNAL` (status :data:`GATE_EXIT_CODE`), so
  the other replicas only ever see whole replicas disappear.
* **Uncaught exception.** With :func:`install_crash_hook` the traceback is printed on the
  process's real stderr (once per distinct traceback among the ranks of this host), a
  ``raised.R`` marker names the exception, and the rank is killed by :data:`CRASH_SIGNAL`;
  the other replicas recover from it like from any replica failure, and if every rank hits
  the same bug the launcher says "the program raised" rather than "the replicas died".
* **Hung peer.** The watchdog (same host, from heartbeats) and the communicator's repair
  (for ranks MPI declared dead) end it with :func:`kill_process`, which checks the pid
  still names the same process before sending SIGKILL.

Why signals and never ``sys.exit(nonzero)``: Open MPI 5.0.11 with ULFM never finishes
aborting a job when a rank exits with a plain non-zero status -- the other ranks are
neither killed nor told and spin forever -- while a rank killed by a signal is an ordinary
ULFM process failure that the survivors repair. No marker is written by a rank killed by
a signal except ``raised.R``; the launcher reads "started but no ok/exited anywhere" as
"nobody survived", and the ``raised`` markers tell it whether the program raised.

Why the crash hook bypasses an in-memory ``sys.stderr``: torch's ``init_process_group`` wraps
``sys.excepthook`` in a hook that swaps ``sys.stderr`` for a ``StringIO`` while the inner
hook runs and writes the buffer out only after it returns; an inner hook that kills the
process loses the traceback. Writing to the process's own stderr (``sys.__stderr__``)
instead works wherever the hook ends up in the chain (torch re-wraps at every
``init_process_group``).

Why the exit handler freezes the garbage collector: interpreter shutdown of a process that
imported torch and Lightning spends seconds (more on a loaded host, once per rank) in the
final garbage collections over a heap that is about to be unmapped anyway. After the end
of job, ``gc.freeze()`` leaves those objects out of the final collections; the other exit
handlers still run and Python still reports its own exit status.
"""

from __future__ import annotations

import atexit
import errno
import gc
import hashlib
import io
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Literal, NoReturn, Protocol, TextIO

from lightning_recover.runtime.markers import ENV_STATUS_DIR, QUORUM_MARKER, START_LOST_MARKER


class JobComm(Protocol):
    """What the end of a job needs of the communicator (:class:`~lightning_recover.comm.communicator.FaultTolerantComm`).

    A protocol rather than the class: the communicator exits through this module, so this
    module (the layer below it) must not import it, not even for its type.
    """

    @property
    def rank(self) -> int: ...

    @property
    def members(self) -> tuple[int, ...]: ...

    @property
    def is_leader(self) -> bool: ...

    def agree(self, flag: bool = True) -> bool: ...

    def free(self) -> None: ...


#: Signal a rank raises on itself when its replica lost a member (see :func:`gate_exit`).
GATE_SIGNAL = signal.SIGUSR1
#: The shell exit status of such a rank (128 + signal number).
GATE_EXIT_CODE = 128 + int(GATE_SIGNAL)
#: The words every gate exit prints on stderr (tests and users grep for them).
GATE_MESSAGE = "replica-consistency gate"
#: Signal a rank raises on itself when its side of a failure has no quorum (see :func:`quorum_exit`).
QUORUM_SIGNAL = signal.SIGUSR2
#: The shell exit status of such a rank (128 + signal number); the launcher reports the job
#: as :data:`lightning_recover.cli.job_status.NO_QUORUM_STATUS` when no rank finished.
QUORUM_EXIT_CODE = 128 + int(QUORUM_SIGNAL)
#: The words every quorum exit prints on stderr, and the start of its ``exited`` marker.
QUORUM_MESSAGE = QUORUM_MARKER
#: How a rank with an uncaught exception leaves (see :func:`install_crash_hook`).
CRASH_SIGNAL = signal.SIGKILL

#: A status marker: ``started`` (the communicator is up), ``ok`` (ended normally),
#: ``exited`` (stopped on purpose with a non-zero status), ``raised`` (an uncaught exception
#: ended the rank; the file holds the exception's type name, then its last traceback line).
#: ``done`` (left by the last world's leader at the end of the job: that world's members).
#: ``init`` (holding ``HOST PID``: the strategy starts this rank, MPI is not up yet).
Status = Literal["init", "started", "ok", "exited", "raised", "done"]
STATUSES: tuple[Status, ...] = ("init", "started", "ok", "exited", "raised", "done")
#: Prefix of the files ranks claim in the status directory so one traceback is printed once.
PRINTED_PREFIX = "printed."
#: Environment variables that tell a rank it was started by mpiexec / a PMIx launcher.
_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK")

# Open MPI's runtime drops output a rank wrote just before it was killed: give it a moment.
OUTPUT_DRAIN_S = 0.3

_crash_hook_installed = False
_crash_rank: int | None = None
_started_rank: int | None = None
_end_of_job: Callable[[], None] | None = None
# The signal that is ending this rank although Python exits "normally" (see :func:`terminated_by`).
_terminated: int | None = None
# Communicators whose end of job ran (a process may run several jobs, e.g. one per test).
_ended: weakref.WeakSet[JobComm] = weakref.WeakSet()
_warned_single = False
# What the crash hook calls first with an uncaught exception (see :func:`before_crash`).
_before_crash: list[Callable[[BaseException, int | None], None]] = []


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

    First it stops a process that Slurm started directly (``srun -n N``, no ``mpiexec``) with
    exit status 2 and one line naming the fix (:func:`lightning_recover.runtime.slurm.refuse_direct_launch`):
    here, before ``MPI_Init``, which such a start can crash in.
    """
    from lightning_recover.runtime.slurm import refuse_direct_launch

    refuse_direct_launch()
    import mpi4py

    if "mpi4py.MPI" in sys.modules:
        return False
    mpi4py.rc.finalize = False
    return True


def mark_init() -> None:
    """Leave the ``init`` marker (this host and pid) before ``MPI_Init``: a rank that never brings its
    communicator up is then named with its host by the launcher (:mod:`lightning_recover.cli.startup`).
    The rank comes from the launcher's environment; outside one this does nothing."""
    rank = next((os.environ[v] for v in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK") if os.environ.get(v, "").isdigit()), None)
    if rank is not None:
        import socket

        mark_status("init", int(rank), f"{socket.gethostname()} {os.getpid()}")


def lost_at_start(rank: int, lost: Sequence[int], where: str) -> NoReturn:
    """Leave because a peer was lost while the job started, before the communicator came up.

    The world is fixed when MPI starts, and no communicator exists yet to repair, so this
    launch cannot go on: every survivor that sees the failure leaves here, with an
    ``exited`` marker holding ``lost at start: ...`` from which the launcher prints the one
    line naming the lost ranks, their hosts and the fix (ranks started without the launcher
    print it themselves). It leaves by SIGTERM, never a plain non-zero exit, which Open MPI's
    runtime would answer by aborting the job and waiting forever (:mod:`lightning_recover.cli.runner`).
    """
    detail = f"{START_LOST_MARKER}: rank(s) {sorted(lost)} died {where}"
    if not os.environ.get(ENV_STATUS_DIR):
        print(
            f"[lightning-recover] rank {rank}: {detail}; this launch cannot start without them: relaunch "
            "(lightning-recover launch --supervise does it)",
            file=sys.stderr, flush=True,
        )
    mark_status("exited", rank, detail)
    _leave_by(signal.SIGTERM)


def start_rank(rank: int, world_size: int, end_of_job: Callable[[], None] | None = None) -> None:
    """Set up this process as rank ``rank`` of a ``world_size``-rank job, once the communicator is up.

    Installs the crash hook when there are peers to protect (a single process keeps
    Python's normal exit status), writes the ``started`` marker and registers the exit
    handler: at a normal interpreter exit it calls ``end_of_job`` (the strategy's
    agreement with the survivors, which must do nothing once :func:`end_job` ran), leaves
    the ``ok`` marker (``raised`` when a single-process run ended by an exception) and
    freezes the garbage collector so the interpreter's teardown takes a fraction of a
    second instead of seconds. Calling it again for the same rank only replaces
    ``end_of_job`` when one is given (the newest strategy's end runs).
    """
    global _started_rank, _end_of_job
    if _started_rank is not None:
        if _started_rank != rank:
            raise RuntimeError(f"this process already started as rank {_started_rank}; it cannot also be rank {rank}")
        if end_of_job is not None:
            _end_of_job = end_of_job
        return
    if world_size > 1:
        install_crash_hook(rank)
    mark_status("started", rank)
    _end_of_job = end_of_job
    atexit.register(_exit_handler, rank)
    _started_rank = rank


def reseat(rank: int) -> None:
    """This process, a rank of the launch orphaned by salvage, is seated again as logical rank ``rank``:
    its crash hook and exit handler speak for that rank from now on (the new strategy's
    :func:`start_rank` then finds it started)."""
    global _started_rank, _crash_rank
    _started_rank = _crash_rank = rank
    mark_status("started", rank)


def exit_now(status: int) -> NoReturn:
    """End this process now with ``status`` as a normal exit would: the exit handler's end of job and
    marker, then leave. For a script run from the crash hook (a seated orphan), where returning
    would make Python exit with the status of the exception the hook handled."""
    if _started_rank is not None:
        _exit_handler(_started_rank)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(status)


def die_on_sigterm() -> None:
    """Let SIGTERM end this rank at once, as the kernel's default does.

    Lightning installs a SIGTERM handler for each ``fit``/``validate``/``test``/``predict``
    that broadcasts over the default process group -- a collective no other rank joins, so
    one SIGTERMed rank hung the whole job -- then ends the run with a status-0 exit. Here a
    SIGTERM (mpiexec aborting the job, a scheduler draining a node) ends the rank like a
    kill: its peers repair without it, and the launcher sees a rank that did not finish.
    """
    _default_disposition(signal.SIGTERM)


def terminated_by(signum: int) -> None:
    """This rank is ending because it was sent ``signum`` although Python will exit normally.

    Lightning turns a SIGTERM during ``fit`` into ``SIGTERMException``, a ``SystemExit``
    whose status is 0. Sent by mpiexec aborting the job, or by a scheduler, it means "die":
    the exit handler then leaves at once with status ``128 + signum``, without the end-of-job
    agreement and without an ``ok`` marker -- what a rank killed by the signal leaves --
    so no launcher or supervisor reads a killed job as finished.
    """
    global _terminated
    _terminated = signum


def _exit_handler(rank: int) -> None:
    """The interpreter is exiting normally (a multi-rank crash never gets here): end the job, mark, leave fast."""
    if _terminated is not None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(128 + _terminated)
    if _end_of_job is not None:
        try:
            _end_of_job()
        except BaseException as exc:  # the end itself failed: report it like any crash, never as "ok"
            if _launcher_gone(exc):
                os.kill(os.getpid(), CRASH_SIGNAL)
            sys.excepthook(type(exc), exc, exc.__traceback__)  # a multi-rank crash hook does not return
            mark_status("raised", rank, _describe(type(exc), exc))
            sys.stderr.flush()
            os._exit(1)
    # Python sets sys.last_value when an uncaught exception ended the main module (one process, no crash hook).
    last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if last is not None:
        mark_status("raised", rank, _describe(type(last), last))
    else:
        mark_status("ok", rank)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    gc.disable()
    gc.freeze()  # see the module docstring: the final collections are what made the exit slow


def job_ended(comm: JobComm) -> bool:
    """Whether :func:`end_job` already agreed with the survivors on ``comm`` and freed it."""
    return comm in _ended


def launched() -> bool:
    """Whether this process was started by mpiexec (or another PMIx/PMI launcher), not by plain ``python``."""
    return any(v in os.environ for v in _LAUNCH_VARS) or ENV_STATUS_DIR in os.environ


def warn_single_replica() -> None:
    """Say once, on one stderr line, that a plain ``python script.py`` trains as a single replica."""
    global _warned_single
    if _warned_single:
        return
    _warned_single = True
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "script.py"
    print(
        f"[lightning-recover] warning: not started by a launcher, so this process trains as a single replica "
        f"with no fault tolerance; to run N replicas: lightning-recover launch -n N -- python {script}",
        file=sys.stderr,
        flush=True,
    )


def _describe(exc_type: type[BaseException], exc: BaseException) -> str:
    """``TypeName`` then the traceback's last line (``TypeName: message``), for the ``raised`` marker."""
    summary = traceback.format_exception_only(exc_type, exc)[-1].strip()
    return f"{exc_type.__name__}\n{summary}\n"


def real_stderr() -> TextIO:
    """Where a dying rank must write: ``sys.stderr``, unless an outer excepthook swapped in an
    in-memory buffer (torch's does) that would die with the process; then the process's own."""
    current = sys.stderr
    if current is not None and not isinstance(current, io.StringIO) and not current.closed:
        return current
    stream = sys.__stderr__
    return stream if stream is not None and not stream.closed else current


def _first_to_print(text: str) -> bool:
    """Claim the printing of ``text`` among the ranks that share the launcher's status directory.

    The first rank to create ``printed.<digest>`` prints it; outside the launcher (or on
    another host) every rank prints its own.
    """
    directory = os.environ.get(ENV_STATUS_DIR)
    if not directory or not os.path.isdir(directory):
        return True
    digest = hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()[:16]
    try:
        os.close(os.open(os.path.join(directory, PRINTED_PREFIX + digest), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def before_crash(handler: Callable[[BaseException, int | None], None]) -> None:
    """Let ``handler(exception, rank)`` see an uncaught exception before the crash hook prints its traceback.

    A handler that ends the rank itself (:func:`lightning_recover.runtime.refusal.refuse`) replaces
    the traceback; one that returns leaves the crash hook to go on as usual."""
    if handler not in _before_crash:
        _before_crash.append(handler)


def install_crash_hook(rank: int | None = None) -> None:
    """Make an uncaught exception end this rank by :data:`CRASH_SIGNAL` instead of a non-zero exit.

    The previous hook prints the traceback first, into a buffer written in one piece to
    the process's real stderr (see the module docstring); a rank whose traceback another
    rank on this host already printed says so in one line instead. With ``rank`` the hook
    leaves the ``raised`` marker for the launcher. Calling it again only records ``rank``.
    See the module docstring for why a signal: a crash on one node becomes a replica
    failure the others recover from.
    """
    global _crash_hook_installed, _crash_rank
    if rank is not None:
        _crash_rank = rank
    if _crash_hook_installed:
        return
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
        if _launcher_gone(exc):
            os.kill(os.getpid(), CRASH_SIGNAL)
        for handler in _before_crash:
            handler(exc, _crash_rank)  # e.g. a refused setting's one line (runtime/refusal.py), which does not return
        text = "".join(traceback.format_exception(exc_type, exc, tb))  # type: ignore[arg-type]
        first = _first_to_print(text)
        out = io.StringIO()
        if first:
            # Into our own buffer, written below in one piece: an outer hook's buffer (torch's)
            # would die with this process, and one write keeps other ranks' lines out of it.
            swapped, sys.stderr = sys.stderr, out
            try:
                previous(exc_type, exc, tb)  # type: ignore[arg-type]
            except Exception:
                out.write(text)
            finally:
                sys.stderr = swapped
        who = "" if _crash_rank is None else f" (rank {_crash_rank}{'' if first else '; same traceback as another rank printed'})"
        out.write(f"[lightning-recover] uncaught {exc_type.__name__}: this rank leaves by {CRASH_SIGNAL.name}{who}\n")
        real = real_stderr()
        real.write(out.getvalue())
        real.flush()
        if _crash_rank is not None:
            mark_status("raised", _crash_rank, _describe(exc_type, exc))
        sys.stdout.flush()
        time.sleep(OUTPUT_DRAIN_S)
        os.kill(os.getpid(), CRASH_SIGNAL)

    sys.excepthook = hook
    _crash_hook_installed = True


def _launcher_gone(exc: BaseException) -> bool:
    """``exc`` is a write to this rank's output, whose reader (mpiexec, or its daemon here) is gone.

    When mpiexec aborts the job (a host lost with its daemon), a rank may still print on its
    way down; the write fails with EPIPE. That is the job ending, not the program failing: the
    rank then leaves as the abort meant it to, killed, with no ``raised`` marker that would tell
    a supervisor the program is broken and a relaunch could not help."""
    if not (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
        return False
    import select

    poll = select.poll()
    for fd in (1, 2):
        poll.register(fd, 0)  # POLLERR and POLLHUP are always reported: a pipe whose reader closed
    try:
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except OSError:
        return False


# ---------------------------------------------------------------------- markers
def mark_status(what: Status, rank: int, detail: str = "") -> None:
    """Leave the marker ``<what>.<rank>`` (holding ``detail``) in the launcher's status directory, if it gave one.

    The launcher (:func:`lightning_recover.cli.launcher.launch`) sets ``LIGHTNING_RECOVER_STATUS_DIR``
    and, after the job, reads the markers to tell a job in which no rank survived from one
    that ended normally (with ULFM, mpiexec reports 0 either way), and one whose program
    raised from one whose replicas died. Outside the launcher, or if the directory is gone,
    this does nothing: a marker is a hint, never a failure.
    """
    if what not in STATUSES:
        raise ValueError(f"status marker must be one of {', '.join(STATUSES)}, got {what!r}")
    directory = os.environ.get(ENV_STATUS_DIR)
    if directory and os.path.isdir(directory):
        try:
            with open(os.path.join(directory, f"{what}.{rank}"), "w") as f:
                f.write(detail)
        except OSError:
            pass


# ---------------------------------------------------------------------- leaving
def _default_disposition(sig: signal.Signals) -> None:
    """Give ``sig`` its default action (death), from any thread.

    ``signal.signal`` works on the main thread only, but the gate is also reached on the
    overlapped reduction's helper thread (seen on fake hosts: ``ValueError: signal only
    works in main thread`` turned a gate exit into a crash). There the C library's
    ``signal`` resets the process-wide disposition that Python's handler sits on."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(sig, signal.SIG_DFL)
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    if libc.signal(int(sig), 0) == ctypes.c_void_p(-1).value:  # SIG_DFL is 0, SIG_ERR is -1
        raise OSError(ctypes.get_errno(), f"could not reset {sig.name} to its default action from thread {threading.current_thread().name}")


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
    _leave_by(GATE_SIGNAL)


def quorum_exit(rank: int, reason: str) -> NoReturn:
    """Leave because this side of a failure may not continue (:mod:`lightning_recover.comm.quorum`).

    Every survivor of the side runs this at the same point of the same repair, so the side
    stops whole; nothing is written after it. The ``exited`` marker holds ``no quorum: REASON``
    so a supervising launcher can tell this stop (relaunch from the newest checkpoint on the
    hosts that remain) from a finished or broken job. Like the gate, it leaves by a signal
    (:data:`QUORUM_SIGNAL`), never a plain non-zero exit, which Open MPI's runtime answers by
    aborting the whole job -- the side that may go on included. Callable from any thread
    (the repair's time bound fires on a timer thread).
    """
    print(
        f"[lightning-recover] rank {rank}: {QUORUM_MESSAGE}: {reason}; this side stops so that only one "
        f"world trains, leaving with {QUORUM_SIGNAL.name} (status {QUORUM_EXIT_CODE}); relaunch from the newest "
        "checkpoint (lightning-recover launch --supervise does it)",
        file=sys.stderr,
        flush=True,
    )
    mark_status("exited", rank, f"{QUORUM_MESSAGE}: {reason}")
    _leave_by(QUORUM_SIGNAL)


def _leave_by(sig: signal.Signals) -> NoReturn:
    """Die by ``sig`` (its default action, whatever handler was installed), after the output drained."""
    sys.stdout.flush()
    time.sleep(OUTPUT_DRAIN_S)
    _default_disposition(sig)
    os.kill(os.getpid(), sig)
    time.sleep(5)  # the signal is delivered before this returns; never run on as a zombie member
    os._exit(128 + int(sig))


def end_job(comm: JobComm, exit_code: int | None = None) -> None:
    """End of job: agree with the survivors (nobody leaves while a peer still needs it), free.

    Runs by itself at a normal interpreter exit (see :func:`start_rank`); call it to end
    earlier or with a status. With ``exit_code`` the process then writes its marker
    (``ok`` for 0, ``exited`` for a deliberate non-zero stop such as fewer than
    ``min_replicas``) and exits at once, without ``MPI_Finalize``: after a peer failure
    Open MPI's finalize can block on the dead rank, which would hang the job at the very
    end of a successful run. Without it the caller returns normally and the ``ok`` marker
    comes from :func:`start_rank`'s exit handler. The agreement and the free happen once
    per communicator; a second call only exits.
    """
    if comm not in _ended:
        comm.agree(True)
        if comm.is_leader:
            # The launcher ends an mpiexec that outlives this world's end waiting on ranks of a
            # frozen or cut-off host, once every member named here has left its ok marker.
            mark_status("done", comm.rank, ",".join(map(str, comm.members)))
        comm.free()
        _ended.add(comm)
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
