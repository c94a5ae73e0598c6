"""Hang detection: turn a rank that stopped answering into an ordinary process failure.

ULFM reports a *dead* peer within milliseconds, but a *stopped* one (SIGSTOP, a wedged
driver, a rank stuck in compute) looks alive forever and the survivors would wait in the
reduce until the job's time limit. Open MPI's own failure detector needs its thread to
cope with ranks busy in compute, and that thread crashed at start-up beside torch on the
Open MPI 5.0.11 this project is tested with; so the default is this watchdog instead.

Every rank runs a daemon thread that, every ``period`` seconds,

* publishes a heartbeat file (``<dir>/<rank>.json``: time, pid, process start time,
  progress counter, whether the rank is *computing*), and
* reads the files of the other ranks on its host. A rank whose heartbeat is older than
  ``hang_timeout`` is hung (a stopped process runs no thread). A rank that has been
  computing for ``stuck_timeout`` without its progress counter moving is stuck in
  compute (its heartbeat thread lives on, so only the progress rule can see it). Either
  way the watcher SIGKILLs it with :func:`lightning_recover.runtime.lifecycle.kill_process`
  (which checks that the pid still belongs to the same process) and ULFM then reports an
  ordinary death to the survivors, who repair as for any failure.

*Computing* is narrow on purpose: the strategy raises it only inside a training step
(microbatches, gradient bookkeeping, the optimizer update) and lowers it while the rank
waits in MPI and between steps. So data loading between steps, validation, logging and
checkpoint writes never count as stuck, however long they take. Inside a step the
strategy ticks per layer (forward and gradient hooks on every module), so only a single
layer, bucket or optimizer update running longer than ``stuck_timeout`` does.

Only ranks on the same host can be killed; a node running a single rank needs Open MPI's
detector (``lightning-recover launch --mpi-detector``). Pure standard library.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from lightning_recover.runtime.lifecycle import kill_process, process_start_time

ENV_TIMEOUT = "LIGHTNING_RECOVER_HANG_TIMEOUT"
DEFAULT_HANG_TIMEOUT = 10.0


def default_hang_timeout() -> float | None:
    """The launcher's ``--hang-timeout`` (via the environment), else 10 s; ``0`` turns it off."""
    raw = os.environ.get(ENV_TIMEOUT)
    if raw is None or raw == "":
        return DEFAULT_HANG_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds; use e.g. 10, or 0 to turn hang detection off") from None
    if value < 0:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} must be >= 0 seconds")
    return value or None


def _heartbeat_base() -> Path:
    return Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


def job_directory(job_id: str | None = None) -> Path:
    """Per-job heartbeat directory on this host (memory-backed where available)."""
    job_id = job_id or os.environ.get("PMIX_NAMESPACE") or os.environ.get("OMPI_MCA_ess_base_jobid") or "local"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)
    return _heartbeat_base() / f"lightning-recover-{safe}"


def remove_launch_directories(mpiexec_pid: int, base: Path | None = None) -> list[Path]:
    """Remove the heartbeat directories on this host of the jobs one ``mpiexec`` ran (its own and
    its spawns': PMIx namespaces ``prterun-<host>-<pid>@<n>``); returns them.

    The last rank out removes its job's directory, but a SIGKILLed rank never withdraws its
    heartbeat, so after a fault the directory would outlive the job (one per run, for ever,
    in a memory-backed /dev/shm). The launcher calls this once ``mpiexec`` has exited."""
    removed = []
    for path in (base or _heartbeat_base()).glob(f"lightning-recover-prterun-*-{int(mpiexec_pid)}_*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class HangWatchdog:
    """Heartbeat publisher and same-host hang killer; see the module docstring."""

    def __init__(
        self,
        rank: int,
        hang_timeout: float = DEFAULT_HANG_TIMEOUT,
        *,
        stuck_timeout: float | None = None,
        period: float | None = None,
        directory: Path | None = None,
        on_kill: Callable[[int, str], None] | None = None,
    ) -> None:
        if hang_timeout <= 0:
            raise ValueError(f"hang_timeout must be > 0 seconds, got {hang_timeout}")
        if stuck_timeout is not None and stuck_timeout <= 0:
            raise ValueError(f"stuck_timeout must be > 0 seconds or None, got {stuck_timeout}")
        self.rank = rank
        self.hang_timeout = hang_timeout
        self.stuck_timeout = stuck_timeout
        self.period = period if period is not None else max(0.05, min(1.0, hang_timeout / 10))
        self.dir = directory or job_directory()
        self.on_kill = on_kill
        self.progress = 0
        #: Raised by the strategy while this rank computes inside a step (see the module docstring).
        self.computing = False
        self.killed: dict[int, str] = {}
        self._pid = os.getpid()
        self._start = process_start_time(self._pid)
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (progress, when it last moved)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning-recover-watchdog", daemon=True)

    def start(self) -> HangWatchdog:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._publish()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching and withdraw this rank's heartbeat (a finished rank is not a hung one)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.period + 1)
        try:
            (self.dir / f"{self.rank}.json").unlink()
        except FileNotFoundError:
            pass
        try:
            self.dir.rmdir()  # the last rank out removes the directory
        except OSError:
            pass

    def tick(self) -> None:
        """The main thread made progress (a microbatch, a bucket)."""
        self.progress += 1

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._publish()
                self._check()
            except Exception as exc:  # never let the watchdog take the rank down
                print(f"[lightning-recover] watchdog on rank {self.rank}: {exc}", file=sys.stderr, flush=True)

    def _publish(self) -> None:
        beat = {
            "rank": self.rank, "pid": self._pid, "start": self._start, "time": time.time(),
            "progress": self.progress, "computing": self.computing,
        }
        tmp = self.dir / f".{self.rank}.tmp"
        tmp.write_text(json.dumps(beat))
        os.replace(tmp, self.dir / f"{self.rank}.json")  # readers never see half a heartbeat

    def _check(self) -> None:
        now = time.time()
        for path in self.dir.glob("*.json"):
            try:
                beat = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            rank = int(beat["rank"])
            if rank == self.rank or rank in self.killed:
                continue
            reason = None
            if now - float(beat["time"]) > self.hang_timeout:
                reason = f"no heartbeat for {now - float(beat['time']):.1f}s (> {self.hang_timeout:g}s): hung or stopped"
            elif self.stuck_timeout is not None:
                prog = int(beat["progress"])
                last = self._seen.get(rank)
                if last is None or last[0] != prog or not beat.get("computing", False):
                    self._seen[rank] = (prog, now)
                elif now - last[1] > self.stuck_timeout:
                    reason = (
                        f"no progress for {now - last[1]:.1f}s while computing (> {self.stuck_timeout:g}s): stuck in compute; "
                        "raise stuck_timeout_s (recover.stuck_timeout_s) if a single layer legitimately takes longer"
                    )
            if reason is not None:
                self._kill(rank, int(beat["pid"]), beat.get("start"), reason)

    def _kill(self, rank: int, pid: int, start: str | None, reason: str) -> None:
        self.killed[rank] = reason  # decided once: a pid that is gone or reused is never retried
        if kill_process(pid, start, reason, by=f"watchdog on rank {self.rank}", target=f"rank {rank}") and self.on_kill is not None:
            self.on_kill(rank, reason)
