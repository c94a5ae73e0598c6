"""The launcher's watch over a job's start: a rank lost before its communicator came up ends the job with one line.

Open MPI fixes the world when MPI starts, and ULFM repairs only communicators that exist, so
a rank that dies before ``MPI_Init`` (a broken node, a failed import, out of memory at start)
leaves every other rank waiting in ``MPI_Init`` for good, and one that dies after it but
before the strategy's communicator leaves nothing to repair (those ranks leave by
themselves, :func:`lightning_recover.runtime.lifecycle.lost_at_start`). A rank that dies
later, in ``setup``, ``configure_model``, a checkpoint load or the first broadcast, is
repaired like any other loss: the job goes on without its replica.

:class:`StartWatch` is polled by :func:`lightning_recover.cli.runner.run_supervised` until
every rank brought its communicator up (its ``started`` marker). It ends the job when

* a rank's process on this host (found among mpiexec's session by ``OMPI_COMM_WORLD_RANK``
  in its environment) is gone before its ``started`` marker while the job runs the strategy
  (some rank left its ``init`` marker: a rank of another script may simply have finished);
* every rank runs here and one was never seen by the time another reached the strategy's
  start, or ``unseen_s`` after another was seen (it died within milliseconds, between two polls);
  (either of these only when no rank raised an exception that explains it within ``grace_s``)
* the survivors left ``lost at start`` markers (they saw the loss after ``MPI_Init``); or
* ranks elsewhere, which the launcher cannot see, have not all brought their communicator up
  within ``timeout_s`` (:data:`~lightning_recover.runtime.markers.ENV_START_TIMEOUT`, default
  :data:`DEFAULT_START_TIMEOUT_S`) of the first rank's ``init`` marker -- only when the status
  directory is one every host shares (a marker from another host is there), as the launcher's
  ``--status-dir`` must be across hosts; else their markers never arrive and nothing is bounded.

Either way the line names the lost ranks with their hosts (from their ``init`` markers) and the fix.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

from lightning_recover.cli.job_status import JobMarkers, start_lost_line
from lightning_recover.runtime.markers import ENV_START_TIMEOUT

#: How long, from the first rank's ``init`` marker, every rank may take to bring its communicator up.
DEFAULT_START_TIMEOUT_S = 600.0


def start_timeout(env: dict[str, str] | None = None) -> float:
    """The start-up bound in seconds from :data:`ENV_START_TIMEOUT` (default :data:`DEFAULT_START_TIMEOUT_S`)."""
    raw = (os.environ if env is None else env).get(ENV_START_TIMEOUT)
    if raw is None or raw == "":
        return DEFAULT_START_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{ENV_START_TIMEOUT}={raw!r} must be a positive number of seconds (how long ranks may take to start)")
    return value


def rank_of(pid: int) -> int | None:
    """The world rank of process ``pid`` from its environment (``OMPI_COMM_WORLD_RANK``), None if it has none."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"OMPI_COMM_WORLD_RANK="):
            value = item.partition(b"=")[2]
            return int(value) if value.isdigit() else None
    return None


class StartWatch:
    """Polled until the job started; returns the one line when it lost a rank at start (module docstring)."""

    def __init__(
        self, status_dir: str, nprocs: int, *, all_local: bool = True, timeout_s: float | None = None, grace_s: float = 2.0,
        unseen_s: float = 10.0, clock: Callable[[], float] = time.time, rank_of: Callable[[int], int | None] = rank_of,
    ) -> None:
        self._rank_of = rank_of
        self.status_dir, self.nprocs, self.grace_s, self.clock = status_dir, nprocs, grace_s, clock
        #: Every rank runs on this host (else only the bound can tell a rank elsewhere that never started).
        self.all_local = all_local
        self.timeout_s = start_timeout() if timeout_s is None else timeout_s
        #: rank -> the local processes seen carrying it (a rank's own process, and any child it started).
        self.local: dict[int, set[int]] = {}
        self._gone_since: float | None = None
        self._first_seen: float | None = None
        #: With every rank here: how long after the first rank was seen another may still be unseen.
        self.unseen_s = unseen_s
        self.over = False

    def poll(self, session: Callable[[], list[int]]) -> str | None:
        """``session()``: the live processes of mpiexec's session on this host (not its runtime's own)."""
        if self.over:
            return None
        markers = JobMarkers.read(self.status_dir)
        if set(range(self.nprocs)) <= markers.started | markers.ended | set(markers.raised):
            self.over = True  # every rank is past its start: losses are repaired from here on
            return None
        live = session()
        for pid in live:
            if not any(pid in pids for pids in self.local.values()):
                rank = self._rank_of(pid)
                if rank is not None:
                    self.local.setdefault(rank, set()).add(pid)
        alive = set(live)
        # A script without the strategy leaves no markers: a rank of it that ended may simply have finished.
        gone = {r for r, pids in self.local.items() if not pids & alive and r not in markers.started} if markers.init else set()
        now = self.clock()
        if self.local and self._first_seen is None:
            self._first_seen = now
        if self.all_local and (markers.init or (self._first_seen is not None and now - self._first_seen > self.unseen_s)):
            # Every rank runs here and mpiexec starts them together: one never seen by the time
            # another got through its imports to the strategy's start, or long after another
            # was seen, ended at once (in milliseconds, between two polls).
            gone |= set(range(self.nprocs)) - set(self.local) - set(markers.init) - markers.started
        gone = sorted(gone)
        if markers.raised:
            return None  # the program says what happened itself (a traceback, a refusal)
        here = socket.gethostname()
        self.local_hosts(markers)  # a rank lost before its init marker ran here all the same
        if markers.lost_at_start:
            # The survivors saw the loss after MPI_Init and are leaving by themselves; say it once, from here.
            self.over = True
            return start_lost_line(markers, self.nprocs, why=", which died after MPI started but before the communicator came up")
        if gone:
            self._gone_since = self._gone_since or now
            if now - self._gone_since >= self.grace_s:
                self.over = True
                for r in gone:  # never seen, but every rank runs here
                    markers.init.setdefault(r, f"{here} ?")
                return start_lost_line(markers, self.nprocs, gone, why=", whose process ended before its communicator came up")
        # Ranks elsewhere are bounded only when their markers reach this directory (a --status-dir every
        # host shares): with a directory of this host alone, a healthy job would look as if it never started.
        shared = self.all_local or any(text.split()[:1] != [here] for text in markers.init.values())
        inits = self._init_times()
        if not shared and inits and now - min(inits) > self.timeout_s and set(self.local) <= markers.started:
            # Markers from elsewhere never came, so the bound cannot apply, and every rank here is up:
            # nothing is left to watch (no more scans of this host's processes for the rest of the job).
            self.over = True
            return None
        if shared and inits and now - min(inits) > self.timeout_s:
            self.over = True
            # The ranks that never reached the strategy's start are the lost ones; the others wait in
            # MPI_Init for them. When every rank got that far, the ones without a communicator.
            unstarted = set(range(self.nprocs)) - markers.started
            missing = sorted(unstarted - set(markers.init)) or sorted(unstarted)
            return start_lost_line(
                markers, self.nprocs, missing,
                why=f", with no communicator {self.timeout_s:g} s after the first rank's start ({ENV_START_TIMEOUT}=SECONDS sets that bound)",
            )
        return None

    def local_hosts(self, markers: JobMarkers) -> JobMarkers:
        """``markers`` with this host named for every rank seen here that left no ``init`` marker (one lost
        before the strategy started it), so that the job's last line names its host too."""
        here = socket.gethostname()
        for r in self.local:
            markers.init.setdefault(r, f"{here} ?")
        return markers

    def _init_times(self) -> list[float]:
        times = []
        for name in os.listdir(self.status_dir):
            if name.startswith("init."):
                try:
                    times.append(os.stat(os.path.join(self.status_dir, name)).st_mtime)
                except OSError:
                    pass
        return times
