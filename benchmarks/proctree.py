"""Launch a benchmark's job and end its WHOLE process tree before the next one starts.

Role: the one place where the benchmarks start and end the processes they measure
(``common.launch`` for overhead/goodput/rejoin/sdc_overhead, ``peers.py`` for mpiexec, torchrun and
torchft's lighthouse). Killing the launcher's process group is not enough here:

* Open MPI 5's ``mpiexec`` (PRRTE) puts every rank into its own process group
  (``setpgid``), so ``killpg(mpiexec)`` misses all ranks; they keep mpiexec's *session*.
  When mpiexec dies first, its ranks are re-parented to pid 1 and keep running (the
  orphaned, SIGTERM-ignoring ranks of issue 23's point 5).
* ``torchrun`` starts each worker with ``start_new_session=True``: the workers leave
  torchrun's session too, so only the parent links find them.

So a :class:`ProcessTree` follows both: it records (pid, start time) of every descendant
it sees while the job runs (polled by the caller), and :meth:`ProcessTree.end` SIGKILLs,
by pid, every live process of the launch's session, of any session a recorded process
leads, and every recorded process, then waits until they are gone. The start time guards
against a recycled pid. Whatever still lived after the launch's own root had exited (or
had to be ended) is reported: the benchmark says so whenever it had to clean up.

:func:`become_subreaper` (Linux ``PR_SET_CHILD_SUBREAPER``) makes orphans of the driver's
launches re-parent to the driver instead of pid 1, so they stay visible as descendants.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

#: prctl option number of PR_SET_CHILD_SUBREAPER (linux/prctl.h).
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where unsupported.

    Why: an orphaned rank re-parented to pid 1 is no longer reachable by a parent walk
    from the driver; re-parented to the driver it is, and the driver reaps it.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[str, str, int, int, int] | None:
    """(name, state, ppid, session id, start time in clock ticks) of ``pid``, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    # fields[0] state, [1] ppid, [2] pgrp, [3] session, [19] starttime (field 22 of proc(5))
    return name, fields[0], int(fields[1]), int(fields[3]), int(fields[19])


def all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def cmdline(pid: int) -> str:
    """``pid``'s command line, arguments joined by spaces ("" once it is gone or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int, start: int | None) -> bool:
    """True while ``pid`` is the same process (same start time) and not a zombie."""
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X") and (start is None or st[4] == start)


def _reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is (now) our child, so no zombie stays behind."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: its own parent (or pid 1) reaps it


class ProcessTree:
    """One launched command in its own session, and every process it ever started.

    ``poll()`` records new descendants (call it often while the job runs; ``wait`` does);
    ``end()`` kills whatever is left of the tree, by pid, and returns what it had to end.
    Use it as a context manager so the tree is ended on exceptions and timeouts too.
    """

    def __init__(
        self,
        argv: Sequence[str],
        label: str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdout: IO[Any] | int | None = None,
        stderr: IO[Any] | int | None = None,
    ) -> None:
        self.label = label
        self.proc = subprocess.Popen(
            list(argv), env=dict(env) if env is not None else None, cwd=cwd, stdout=stdout, stderr=stderr,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        st = _stat(self.pid)
        #: pid -> start time of every process seen in the tree (the root included).
        self.seen: dict[int, int] = {self.pid: st[4]} if st else {}
        self.ended: list[str] = []

    def __enter__(self) -> "ProcessTree":
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()

    def poll(self) -> int | None:
        """Record the tree's current descendants; the root's exit status, or None while it runs."""
        procs = {pid: st for pid in all_pids() if (st := _stat(pid)) is not None}
        children: dict[int, list[int]] = {}
        for pid, st in procs.items():
            children.setdefault(st[2], []).append(pid)
        stack = [p for p in self.seen if p in procs]
        while stack:
            p = stack.pop()
            for c in children.get(p, []):
                if c not in self.seen or self.seen[c] != procs[c][4]:
                    self.seen[c] = procs[c][4]
                    stack.append(c)
        return self.proc.poll()

    def wait(self, timeout: float | None = None, interval: float = 0.1) -> int | None:
        """Wait for the root to exit (None after ``timeout``), recording descendants meanwhile."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (rc := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(interval)
        return rc

    def leftovers(self) -> dict[int, str]:
        """Live processes of the tree other than a root that already exited: pid -> name."""
        procs = {pid: st for pid in all_pids() if (st := _stat(pid)) is not None}
        sessions = {self.pid} | {p for p, start in self.seen.items() if p in procs and procs[p][4] == start and procs[p][3] == p}
        out: dict[int, str] = {}
        for pid, (name, state, _ppid, sid, start) in procs.items():
            if state in ("Z", "X") or pid == os.getpid():
                continue
            if sid in sessions or self.seen.get(pid) == start:
                out[pid] = name
        return out

    def end(self, grace_s: float = 10.0) -> list[str]:
        """SIGKILL every live process of the tree (by pid), wait until gone; report any it had to end.

        Returns ``"pid name"`` of each process besides the root that was still alive (a
        timeout, an exception or a server that never exits by itself ends the root on
        purpose; a rank outliving its launcher is a leftover) and prints one line naming them.
        """
        self.poll()
        root_running = self.proc.poll() is None
        victims = self.leftovers()
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + grace_s
        pending = dict(victims)
        while pending and time.monotonic() < deadline:
            for pid in list(pending):
                _reap(pid)
                if not _alive(pid, self.seen.get(pid)):
                    del pending[pid]
            if pending:
                time.sleep(0.05)
        for pid in self.seen:
            _reap(pid)
        ended = [f"{pid} {name}" for pid, name in sorted(victims.items())]
        others = [e for e in ended if int(e.split()[0]) != self.pid]
        if others:
            why = "after it was ended" if root_running else "after its launcher exited"
            print(f"[cleanup] {self.label}: {len(others)} process(es) still alive {why}, killed (SIGKILL by pid): "
                  f"{', '.join(others)}", file=sys.stderr, flush=True)
        if pending:
            print(f"[cleanup] {self.label}: WARNING {len(pending)} process(es) survived SIGKILL for {grace_s:.0f} s "
                  f"(uninterruptible?): {', '.join(f'{p} {n}' for p, n in pending.items())}", file=sys.stderr, flush=True)
        self.ended += others
        return others


def read_env(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (empty if unreadable): finds a rank's MPI rank."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
