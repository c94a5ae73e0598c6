"""The harness side of host-level fault injection: applies the host faults ranks ask for, on fake hosts.

Role: test support (the chaos campaign's ``--hosts N``, launched tests). A rank cannot
kill, freeze or cut off its own host; :class:`~lightning_recover.callbacks.FaultInjection`
therefore only *asks* (a request file in the directory named by
:data:`~lightning_recover.callbacks.fault_injection.ENV_HOST_FAULTS`, see that module's
docstring for the contract), and :class:`HostFaultHarness`, running in the process that
owns the :class:`~benchmarks.rigs.fake_cluster.FakeCluster`, applies it to the
requesting rank's host and confirms. Every fault it applied is kept in
:attr:`HostFaultHarness.applied` (which ranks ran on the host at that moment, when), so a
caller can judge the run afterwards.

The head host (where mpiexec runs) is refused: losing it loses the job on any cluster,
so a request naming it is a mistake in the schedule; it is recorded with an error and
not applied (the requesting rank then times out with an error naming the variable).

Use::

    with FakeCluster(3) as cluster, HostFaultHarness(cluster, tmpdir) as harness:
        env = {**os.environ, **harness.env()}          # the job's ranks must see the variable
        ... launch the job with env ...
    harness.applied                                    # what was done, when, to which ranks
    harness.restore()                                  # links up, frozen hosts thawed, lost hosts back (before the next job)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from lightning_recover.callbacks.fault_injection import ENV_HOST_FAULTS, FLAP_DEFAULT_S, HOST_KINDS
from benchmarks.rigs.fake_cluster import FakeCluster

__all__ = ["AppliedHostFault", "HostFaultHarness"]


@dataclass
class AppliedHostFault:
    """One host fault a rank asked for, and what the harness did."""

    kind: str
    rank: int
    step: int
    phase: str
    host: str
    #: World ranks running on the host when the fault was applied (the ranks it hit).
    ranks: list[int] = field(default_factory=list)
    #: ``time.monotonic()`` when it was applied.
    at: float = 0.0
    seconds: float | None = None
    #: Why it was not applied (a request for the head host or an unknown host); None when applied.
    error: str | None = None


class HostFaultHarness:
    """Watches ``directory`` for host-fault requests and applies them to ``cluster``'s hosts (module docstring).

    A context manager: entering starts the watcher thread, leaving stops it. ``poll_s``: how
    often the directory is read (the requesting rank waits that long at most, plus the fault)."""

    def __init__(self, cluster: FakeCluster, directory: str | os.PathLike[str], *, poll_s: float = 0.05) -> None:
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0 seconds, got {poll_s}")
        self.cluster, self.directory, self.poll_s = cluster, Path(directory), poll_s
        self.applied: list[AppliedHostFault] = []
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._partitioned: set[str] = set()
        self._frozen: set[str] = set()
        self._killed: set[str] = set()
        self._lock = threading.Lock()

    def env(self) -> dict[str, str]:
        """The environment a job's ranks need to reach this harness."""
        return {ENV_HOST_FAULTS: str(self.directory)}

    def __enter__(self) -> HostFaultHarness:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="host-fault-harness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def reset(self, directory: str | os.PathLike[str]) -> None:
        """Watch a new directory (the next job) and forget what was applied; :meth:`restore` first."""
        with self._lock:
            self.directory = Path(directory)
            self.directory.mkdir(parents=True, exist_ok=True)
            self.applied = []
            self._seen = set()

    def restore(self, timeout: float = 30.0) -> None:
        """Undo what can be undone so the hosts serve the next job: every cut link up (and carrying
        traffic again: a job started before that lost a daemon that could not call back), every
        frozen host thawed, every host lost whole brought back (a rebooted node).
        :class:`TimeoutError` when a healed host stays unreachable for ``timeout`` s."""
        with self._lock:
            healed = sorted(self._partitioned)
            for name in healed:
                self.cluster.heal(name)
            for name in sorted(self._frozen):
                self.cluster.thaw(name)
            for name in sorted(self._killed):
                self.cluster.revive(name)
            self._partitioned.clear()
            self._frozen.clear()
            self._killed.clear()
        for name in healed:
            self.cluster.wait_until(lambda name=name: self._reachable(name), timeout, f"host {name} reachable from the head after heal")

    def _reachable(self, name: str) -> bool:
        """A TCP connect from the head host to a closed port of ``name``: refused means the link carries traffic."""
        address = self.cluster.host(name).address
        probe = (
            "import socket, sys\n"
            f"try: socket.create_connection(({address!r}, 9), timeout=0.5)\n"
            "except ConnectionRefusedError: sys.exit(0)\n"
            "except OSError: sys.exit(1)\n"
        )
        return self.cluster.run(self.cluster.head, [sys.executable, "-c", probe], check=False).returncode == 0

    # ------------------------------------------------------------------ the watcher
    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                names = sorted(os.listdir(self.directory))
            except OSError:
                names = []
            for name in names:
                if name.startswith("request.") and name.endswith(".json") and name not in self._seen:
                    self._seen.add(name)
                    self._apply(name)
            self._stop.wait(self.poll_s)

    def _apply(self, name: str) -> None:
        try:
            req = json.loads((self.directory / name).read_text())
            kind, host = str(req["kind"]), str(req["host"])
            fault = AppliedHostFault(kind, int(req["rank"]), int(req["step"]), str(req["phase"]), host,
                                     seconds=req.get("seconds"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.applied.append(AppliedHostFault("?", -1, -1, "?", "?", error=f"unreadable request {name}: {exc!r}"))
            return
        names = [h.name for h in self.cluster.hosts]
        if kind not in HOST_KINDS:
            fault.error = f"unknown host fault kind {kind!r}; one of {HOST_KINDS}"
        elif host not in names:
            fault.error = f"rank {fault.rank} runs on {host!r}, not on a fake host of this cluster ({names})"
        elif host == self.cluster.head.name:
            fault.error = (f"rank {fault.rank} asked for {kind} of the head host {host} (where mpiexec runs): losing it loses "
                           "the job on any cluster; schedule host faults on a rank of another host")
        if fault.error is not None:
            self.applied.append(fault)
            return
        with self._lock:
            fault.ranks = sorted(set(self.cluster.ranks(host).values()))
            fault.at = time.monotonic()
            if kind == "host_ranks_kill":
                self.cluster.kill_ranks(host)
            elif kind == "host_kill":
                self._killed.add(host)
                self.cluster.kill_host(host)
            elif kind == "host_freeze":
                self._frozen.add(host)
                self.cluster.freeze(host)
            elif kind == "host_partition":
                self._partitioned.add(host)
                self.cluster.partition(host)
            else:  # host_flap: down now, up again after its seconds (the cluster's timer heals it)
                self._partitioned.add(host)  # restore() heals it too if the job ended before the timer did
                self.cluster.flap(host, float(fault.seconds or FLAP_DEFAULT_S))
            self.applied.append(fault)
        # The rank waits for this: after a partition or a flap it goes on into the cut.
        (self.directory / ("done." + name[len("request.") : -len(".json")])).touch()
