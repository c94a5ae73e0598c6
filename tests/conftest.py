"""Test set-up for both folders (inprocess/, launched/): the session's local Slurm; fake hosts.

Import paths are pytest's ``pythonpath`` (pyproject.toml): the checkout's root (``benchmarks``,
``examples``), ``tests/`` (the ``harness`` package) and ``tests/workers`` (the launched scripts' modules)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from benchmarks.rigs.fake_cluster import FakeCluster
from benchmarks.rigs.fake_netns import cleanup_stale


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
