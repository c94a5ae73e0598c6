"""Run ``mpiexec`` in its own session and make sure it ends: the launcher's guard against a job that never exits.

With ULFM on, Open MPI 5.0.11's runtime never finishes aborting a job after a rank exits
with a non-zero status or calls ``MPI_Abort`` -- it kills the ranks, then waits forever.
When every rank of a job ran on this host (the supervisor saw all N of them) and none is
left while ``mpiexec`` lingers past a grace period, :func:`run_supervised` ends the job's
process group and returns :data:`ABORTED_STATUS`, so a crashed job fails instead of
hanging. (On several hosts the rule is off: ranks elsewhere may still be training.)

It also ends ``mpiexec`` when the job's last world has finished but ``mpiexec`` still waits
on ranks it cannot reach (a frozen or cut-off host), when the caller's stall watchdog fires
(:data:`STALLED_STATUS`), and at a timeout; Ctrl-C and SIGTERM go to the whole job. No rank
ever outlives the call, nor do the heartbeat directories and Open MPI shared-memory segments
its killed ranks leave on this host. What the job's status *means* is read from the ranks' markers afterwards
(:mod:`lightning_recover.cli.job_status`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from lightning_recover.runtime.watchdog import remove_launch_directories


#: Exit status when the supervisor had to end a job whose ranks were all gone.
ABORTED_STATUS = 70
#: Exit status when the supervisor's stall watchdog ended a job that made no progress.
STALLED_STATUS = 124
#: Exit status when the start watch ended a job that lost a rank before its communicator came up
#: (:data:`lightning_recover.cli.job_status.START_LOST_STATUS`; not imported: the runner reads no markers).
START_LOST_STATUS = 69
#: What Open MPI 5 prints when its runtime failed to start at all (a PMIx listener race, also
#: seen in other projects' CI): no rank ran, so a harness may launch such a job once more.
RUNTIME_START_FAILURE = "The PMIx server's listener thread failed to start"
_RUNTIME = {"mpiexec", "mpirun", "prterun", "prte", "prted", "orterun"}


def session_ranks(sid: int) -> list[int]:
    """Live processes of session ``sid`` other than Open MPI's runtime: the job's local ranks."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z" and name not in _RUNTIME:
            pids.append(int(entry))
    return pids


def run_supervised(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    nprocs: int | None = None,
    grace_s: float = 5.0,
    timeout_s: float | None = None,
    stdout: object = None,
    stderr: object = None,
    watch: Callable[[], str | None] | None = None,
    on_signal: Callable[[int], None] | None = None,
    finished: Callable[[], bool] | None = None,
    refused: Callable[[], bool] | None = None,
    start_watch: Callable[[Callable[[], list[int]]], str | None] | None = None,
) -> int:
    """Run ``mpiexec`` in its own session and return its status (see the module docstring).

    With ``nprocs`` the stuck-abort rule is armed once that many local ranks were seen.
    ``timeout_s`` ends the job and raises ``subprocess.TimeoutExpired``. ``watch`` is
    called every poll; when it returns a reason, the job is ended and the status is
    :data:`STALLED_STATUS` (the supervisor's stall watchdog). Ctrl-C and SIGTERM are
    forwarded to the whole job, and reported to ``on_signal``. When ``finished`` (the job's
    last world ended and all its members left,
    :attr:`lightning_recover.cli.job_status.JobMarkers.finished`) holds for
    ``grace_s`` while mpiexec still waits -- on the ranks of a frozen or cut-off host, which
    it cannot reach and never gives up on -- the job is ended and the status is 0 (the
    caller judges the job by the markers, :func:`lightning_recover.cli.job_status.final_words`).
    When ``refused`` holds (a rank stopped on a bad setting with status 2, and mpiexec ended the
    ranks still starting), the ranks left behind are ended without a line about them.
    ``start_watch`` gets a way to list the live processes of mpiexec's session on this host every
    poll while the job starts (:class:`lightning_recover.cli.startup.StartWatch`); when it returns a line
    (a rank lost before its communicator came up), the line is printed, the job ended and the
    status is :data:`START_LOST_STATUS`.
    """
    job = _SupervisedJob(argv, env, stdout, stderr, grace_s)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, job.forwarder(on_signal)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while job.proc.poll() is None:
            time.sleep(0.25)
            status = job.poll(nprocs=nprocs, finished=finished, start_watch=start_watch, watch=watch)
            if status is not None:
                return status
            if deadline is not None and time.monotonic() > deadline:
                job.end()
                raise subprocess.TimeoutExpired(list(argv), timeout_s or 0)
        return job.proc.returncode
    finally:
        job.clean_up(refused)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _SupervisedJob:
    """:func:`run_supervised`'s ``mpiexec`` and what its polls remember between them."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None, stdout: object, stderr: object,
                 grace_s: float) -> None:
        self.started = time.time()
        self.proc = subprocess.Popen(
            list(argv), env=dict(env) if env is not None else None, stdout=stdout, stderr=stderr, start_new_session=True
        )
        self.grace_s = grace_s
        #: The most local ranks seen at once; since when none is left, and since when the last world is over.
        self.seen = 0
        self.empty_since: float | None = None
        self.done_since: float | None = None
        #: The start watch ended the job (the ranks it ends are not news: its line was the one).
        self.start_lost = False

    def ranks(self) -> list[int]:
        return session_ranks(self.proc.pid)

    def kill_group(self) -> list[int]:
        # mpiexec's own group, and its ranks BY PID: PRRTE puts every rank in a process group of
        # its own (it keeps mpiexec's session), so killpg(mpiexec) alone leaves them running,
        # re-parented to pid 1, when mpiexec goes first.
        ranks = self.ranks()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return ranks

    def end(self) -> None:
        self.kill_group()
        self.proc.wait()

    def forwarder(self, on_signal: Callable[[int], None] | None) -> Callable[[int, object], None]:
        """A signal handler that sends Ctrl-C and SIGTERM to the whole job, and tells ``on_signal``."""

        def forward(signum: int, _frame: object) -> None:
            if on_signal is not None:
                on_signal(signum)
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                pass

        return forward

    def poll(
        self, *, nprocs: int | None, finished: Callable[[], bool] | None,
        start_watch: Callable[[Callable[[], list[int]]], str | None] | None, watch: Callable[[], str | None] | None,
    ) -> int | None:
        """One look at the running job: the status to return after ending it (each rule of the module
        docstring, in order), or None to go on."""
        now = time.monotonic()
        if finished is not None:
            self.done_since = (self.done_since or now) if finished() else None
            if self.done_since is not None and now - self.done_since > self.grace_s and self.proc.poll() is None:
                return self._ended("every rank of the job's last world has left, but mpiexec keeps waiting on ranks it "
                                   "cannot reach (a frozen or cut-off host); ending it", 0)
        if nprocs:
            live = len(self.ranks())
            self.seen = max(self.seen, live)
            self.empty_since = (self.empty_since or now) if self.seen >= nprocs and live == 0 else None
            if self.empty_since is not None and now - self.empty_since > self.grace_s and self.proc.poll() is None:
                return self._ended(f"all {nprocs} ranks are gone but mpiexec keeps waiting (a stuck abort); "
                                   f"ending it with status {ABORTED_STATUS}", ABORTED_STATUS)
        if start_watch is not None:
            line = start_watch(self.ranks)
            if line is not None and self.proc.poll() is None:
                self.start_lost = True
                return self._ended(line, START_LOST_STATUS)
        reason = watch() if watch is not None else None
        if reason is not None and self.proc.poll() is None:
            return self._ended(f"{reason}; ending the job", STALLED_STATUS)
        return None

    def _ended(self, line: str, status: int) -> int:
        print(f"[lightning-recover] {line}", file=sys.stderr, flush=True)
        self.end()
        return status

    def clean_up(self, refused: Callable[[], bool] | None) -> None:
        """After the job, however it ended: no rank outlives it (a SIGSTOPped one neither), nor its
        heartbeat directories and shared-memory segments on this host."""
        exited = self.proc.poll() is not None
        left = self.kill_group()
        if left and exited and not self.start_lost and not (refused is not None and refused()):
            print(f"[lightning-recover] {len(left)} rank(s) outlived mpiexec; ended them (SIGKILL): pids {left}",
                  file=sys.stderr, flush=True)
        deadline = time.monotonic() + 5.0
        while left and time.monotonic() < deadline:  # gone before the caller starts anything else
            left = [p for p in left if p in self.ranks()]
            time.sleep(0.05)
        if self.proc.poll() is not None:
            remove_launch_directories(self.proc.pid)
            remove_orphaned_segments(self.started)


def remove_orphaned_segments(since: float, base: Path = Path("/dev/shm")) -> list[Path]:
    """Remove Open MPI's shared-memory segments of this host and user (``sm_segment.<host>.<uid>.*``)
    created since ``since`` that no process maps any more; returns them.

    A process that ends normally unlinks its segment; 339 segments of killed processes had
    piled up in this machine's /dev/shm over a day of fault runs (16 MiB each, sparse). A
    segment still mapped belongs to a live process, possibly of another job on this host, and
    stays; so does one made before the launch."""
    segments = [p for p in base.glob(f"sm_segment.{socket.gethostname()}.{os.getuid()}.*") if _mtime(p) >= since - 1.0]
    if not segments:
        return []
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text(errors="replace")
        except OSError:
            continue  # ended meanwhile, or not ours to read (its segments are not ours either)
        mapped.update(line.split(None, 5)[5] for line in text.splitlines() if "sm_segment." in line and len(line.split(None, 5)) == 6)
    removed = []
    for path in segments:
        if str(path) not in mapped:
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass  # removed meanwhile
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
