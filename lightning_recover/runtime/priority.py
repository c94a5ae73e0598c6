"""A warm standby's CPU priority: its imports take only the cores the training ranks leave idle.

A standby spawned during training (the pool's refill after a seat) spends 6-7 CPU seconds
importing torch and Lightning. On a host whose cores the ranks share (they wait politely:
:func:`lightning_recover.comm.mpi_wait.polite`), that time is taken from the steps unless the
standby yields. At ``nice +10`` it still took a fifth of a 2-core host and made the steps
of the refill window ~25 % slower (``benchmarks/peers.py``, recover-rejoin); at Linux's
``SCHED_IDLE`` it runs only on cores the ranks leave idle while they wait for each other.

The contract, per standby process:

* :func:`yield_while_warming` puts every thread at ``SCHED_IDLE`` and returns what restores
  them (a seated standby is a training rank: one left behind would be every step's straggler).
  Nothing changes where the priority could not be restored (no root and an ``RLIMIT_NICE``
  that forbids it).
* A host with no idle core would starve it, so after ``fallback_after_s`` a watcher thread,
  kept at normal priority, moves it to ``nice +10``: a small but certain share, as before.
* :func:`promote` is the leader's side: a loss found no warm standby, so the one still
  warming is needed now; the leader (same host, same user) gives it its full share at once.

Linux keeps the policy and the niceness per thread; threads inherit them from their creator,
so every change here walks ``/proc/<pid>/task``.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Callable

__all__ = ["STANDBY_NICE", "promote", "yield_while_warming"]

#: The niceness of a standby whose ``SCHED_IDLE`` warm-up ran past its fallback (CFS: ~1/10 of a busy rank's share).
STANDBY_NICE = 10


def _tids(pid: int | str = "self") -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _set(tids: list[int], policy: int, nice: int | None) -> None:
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            if nice is not None:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass  # a thread that ended meanwhile


def _can_restore(base: int) -> bool:
    """Whether this process may later leave ``SCHED_IDLE`` (and a raised niceness) back to ``base``."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= base


def yield_while_warming(fallback_after_s: float) -> Callable[[], None]:
    """Run this process at ``SCHED_IDLE``, at ``nice +STANDBY_NICE`` once ``fallback_after_s`` passed;
    returns what restores every thread to the normal policy and the niceness it had."""
    if not hasattr(os, "SCHED_IDLE"):
        return lambda: None
    try:
        base = os.getpriority(os.PRIO_PROCESS, 0)
        if not _can_restore(base):
            return lambda: None
    except (OSError, ValueError):
        return lambda: None
    lock = threading.Lock()
    done = threading.Event()

    def fall_back() -> None:
        # Started before the process goes idle, so it wakes on time even on a host with no idle core.
        if done.wait(fallback_after_s):
            return
        with lock:
            if not done.is_set():
                _set(_tids(), os.SCHED_OTHER, min(19, base + STANDBY_NICE))

    watcher = threading.Thread(target=fall_back, name="lightning-recover-standby-priority", daemon=True)
    watcher.start()
    with lock:
        _set([t for t in _tids() if t != watcher.native_id], os.SCHED_IDLE, None)

    def restore() -> None:
        with lock:
            done.set()
            _set(_tids(), os.SCHED_OTHER, base)

    return restore


def promote(pid: int) -> bool:
    """Give every thread of ``pid`` (a standby on this host, same user) the normal policy at this
    process's niceness (the job's: a standby starts at its leader's); False when it is gone or
    this process may not."""
    tids = _tids(pid)
    if not tids:
        return False
    try:
        _set(tids, os.SCHED_OTHER, os.getpriority(os.PRIO_PROCESS, 0))
        return os.sched_getscheduler(pid) == os.SCHED_OTHER
    except OSError:
        return False
