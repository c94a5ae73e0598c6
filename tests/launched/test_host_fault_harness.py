"""HostFaultHarness (benchmarks.rigs.host_faults) on real fake hosts, no MPI job: a process
standing for a rank (``OMPI_COMM_WORLD_RANK`` set) asks for a host fault inside a host the way
FaultInjection does (the request/confirm contract of callbacks/fault_injection.py, without torch, so
each stand-in starts in milliseconds; FaultInjection's own side is tests/inprocess/test_host_fault_injection.py),
and the harness applies it to that host. Needs root, like the other fake-host tests (CI runs as root)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from lightning_recover.callbacks.fault_injection import ENV_HOST_FAULTS
from benchmarks.rigs.fake_cluster import FakeCluster
from benchmarks.rigs.host_faults import HostFaultHarness

from harness.fake_hosts import reachable

#: A rank asking for ``kind`` at step 1's reduce, as request_host_fault does; waits at most argv[2] seconds.
RANK = """
import json, os, socket, sys, time
kind, wait, where = sys.argv[1], float(sys.argv[2]), os.environ["LIGHTNING_RECOVER_HOST_FAULTS"]
req = {"kind": kind, "rank": 3, "step": 1, "phase": "reduce", "host": socket.gethostname(), "pid": os.getpid(), "seconds": None}
with open(os.path.join(where, ".tmp"), "w") as f:
    json.dump(req, f)
os.replace(os.path.join(where, ".tmp"), os.path.join(where, "request.3.1.reduce.json"))
deadline = time.monotonic() + wait
while not os.path.exists(os.path.join(where, "done.3.1.reduce")):
    if time.monotonic() > deadline:
        sys.exit("no harness confirmed it")
    time.sleep(0.01)
print("went on", flush=True)
"""


def _rank_in(cluster: FakeCluster, host: int, kind: str, directory: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, OMPI_COMM_WORLD_RANK="3", **{ENV_HOST_FAULTS: str(directory)})
    return subprocess.Popen(cluster.enter_argv(host) + [sys.executable, "-c", RANK, kind, "30"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_the_harness_applies_what_a_rank_asks_for_to_its_host(tmp_path: Path) -> None:
    with FakeCluster(3) as cluster, HostFaultHarness(cluster, tmp_path / "a") as harness:
        # A partition: the rank is told once its link is down, and goes on into the cut.
        rank = _rank_in(cluster, 1, "host_partition", tmp_path / "a")
        out, err = rank.communicate(timeout=60)
        assert rank.returncode == 0 and out.strip() == "went on", err
        (applied,) = harness.applied
        assert (applied.kind, applied.rank, applied.step, applied.phase, applied.host, applied.ranks, applied.error) == (
            "host_partition", 3, 1, "reduce", cluster.hosts[1].name, [3], None)
        assert not reachable(cluster, 0, 1) and reachable(cluster, 0, 2)
        harness.restore()
        cluster.wait_until(lambda: reachable(cluster, 0, 1), 10, "host 1 back after restore()")

        # Every rank of the host killed: the asking rank never returns.
        harness.reset(tmp_path / "b")
        rank = _rank_in(cluster, 2, "host_ranks_kill", tmp_path / "b")
        rank.communicate(timeout=60)
        assert rank.returncode == -9 and [a.kind for a in harness.applied] == ["host_ranks_kill"]

        # A frozen host: the asking rank stops where it asked; restore() thaws it and it goes on.
        harness.reset(tmp_path / "c")
        rank = _rank_in(cluster, 1, "host_freeze", tmp_path / "c")
        cluster.wait_until(lambda: cluster.stopped_ranks(1) == [3], 60, "rank 3 frozen on host 1")
        harness.restore()
        out, _ = rank.communicate(timeout=60)
        assert rank.returncode == 0 and out.strip() == "went on"


def test_the_head_host_is_refused(tmp_path: Path) -> None:
    with FakeCluster(2) as cluster, HostFaultHarness(cluster, tmp_path) as harness:
        env = dict(os.environ, OMPI_COMM_WORLD_RANK="3", **{ENV_HOST_FAULTS: str(tmp_path)})
        rank = subprocess.run(cluster.enter_argv(0) + [sys.executable, "-c", RANK, "host_kill", "2"], env=env, capture_output=True,
                              text=True, timeout=60)
        assert rank.returncode == 1 and "no harness confirmed it" in rank.stderr, rank.stderr
        (applied,) = harness.applied
        assert applied.error is not None and "head host" in applied.error and applied.ranks == []
        assert cluster.processes(0), "nothing on the head host was touched"
