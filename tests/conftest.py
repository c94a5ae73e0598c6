"""Test set-up for both folders (inprocess/, launched/): import paths for the harness and the
workers; the session's local Slurm; fake hosts."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from lightning_recover.testing.fake_cluster import FakeCluster, cleanup_stale

HERE = Path(__file__).resolve().parent
# The harness package (tests/harness: launched jobs, Slurm, fake-host probes) and the worker
# modules are imported by the tests of both folders. benchmarks/ is not put here: the few
# tests of benchmark scripts say so themselves (harness.benchmark_scripts).
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "workers"))

if TYPE_CHECKING:
    from harness.slurm_cluster import LocalSlurm


@pytest.fixture(scope="session")
def slurm() -> Iterator[LocalSlurm]:
    """A real one-node Slurm (tests/harness/slurm_cluster.py), started once for the session and always stopped.

    No Slurm here is an error naming the fix (apt-get install -y slurmctld slurmd slurm-client), never a skip.
    """
    from harness.slurm_cluster import LocalSlurm

    with LocalSlurm() as cluster:
        yield cluster



@pytest.fixture
def fake_cluster(request: pytest.FixtureRequest) -> Callable[..., FakeCluster]:
    """``make(n_hosts=2, **options) -> FakeCluster``: started fake hosts, torn down when the test ends (passed, failed or
    timed out): every process on them killed, namespaces, links and /etc/netns entries deleted."""

    def make(n_hosts: int = 2, **options: object) -> FakeCluster:
        cleanup_stale()  # what a SIGKILLed earlier run left (only instances whose owner process is gone)
        cluster = FakeCluster(n_hosts, **options)  # type: ignore[arg-type]
        request.addfinalizer(cluster.teardown)
        return cluster.start()

    return make
