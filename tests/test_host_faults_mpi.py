"""Host failures that ranks cannot report, on fake hosts: partitions, frozen hosts, lost daemons.

A partitioned or frozen host's ranks are declared dead by Open MPI's heartbeat detector
while they live on, so both sides of a cut repair; the quorum rule
(lightning_recover.quorum) lets exactly one go on. Each test judges the run by what the
ranks wrote (the ledger against the fault-free reference, the survivors' results, the
status markers) and what the user reads, never by mpiexec's status alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lightning_recover.ledger import read_ledger
from lightning_recover.testing.fake_cluster import FakeCluster
from mpirun import MPIJob, assert_reference_run, train_worker

pytestmark = pytest.mark.mpi

#: Open MPI's heartbeat detector, without its thread (which hung fault-free jobs at finalize):
#: a rank silent for 4 s is declared dead. The only way a cut-off host's ranks are noticed.
DETECTOR = ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "4"]
#: What the tests hold a side without quorum to: detection (4 s per rank it must declare, one
#: at a time) plus the repair, with room for a loaded 2-core machine.
QUORUM_EXIT_BOUND_S = 60.0
STEPS = 6


def _markers(root: Path, ranks: list[int]) -> dict[int, str]:
    """The ``exited`` markers ``ranks`` left in the job's kept status directory (``--status-dir root``)."""
    return {int(p.suffix[1:]): p.read_text() for p in root.glob("job-*/exited.*") if int(p.suffix[1:]) in ranks}


def _ledger_steps(out: Path) -> int:
    try:
        return len(read_ledger(out / "ledger.jsonl"))
    except (OSError, ValueError):
        return 0


def _files_of(out: Path, ranks: list[int]) -> list[str]:
    """What ``ranks`` wrote into the run's output directory (results, parameters)."""
    return sorted(p.name for r in ranks for p in out.glob(f"*{r}.*") if p.stem.endswith(str(r)) and p.stem[:-len(str(r))].isalpha())


def cut_off_while_paused(
    cluster: FakeCluster, out: Path, host: int, fault: Callable[[int], object], seen: dict[str, Any]
) -> Callable[[], None]:
    """A ``during`` hook: once step 0 is in the ledger (rank 0 then pauses, so every rank waits in
    step 1), apply ``fault`` to ``host``; record when, and when its ranks are gone."""

    def run() -> None:
        cluster.wait_until(lambda: _ledger_steps(out) >= 1, 120, "step 0 in the ledger")
        seen["ranks"] = sorted(set(cluster.ranks(host).values()))
        seen["cut_at"] = time.monotonic()
        seen["steps_before_cut"] = _ledger_steps(out)
        fault(host)
        cluster.wait_until(lambda: _ledger_steps(out) >= 2, QUORUM_EXIT_BOUND_S, "step 1 committed after the cut")
        seen["majority_back_after_s"] = time.monotonic() - seen["cut_at"]
        try:
            cluster.wait_until(lambda: not cluster.ranks(host), QUORUM_EXIT_BOUND_S + 30, f"host {host}'s ranks to leave")
            seen["gone_after_s"] = time.monotonic() - seen["cut_at"]
        except TimeoutError:
            seen["gone_after_s"] = None

    return run


def _assert_majority_went_on_exactly(job: MPIJob, out: Path, argv: list[str], replicas: int, survivors: list[int], lost: list[int]) -> list[dict]:
    assert (out / "ledger.jsonl").exists(), job.describe()
    results = assert_reference_run(job, argv, replicas=replicas)  # the fault-free trajectory and parameters
    ledger = read_ledger(out / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(STEPS)), ledger
    assert sorted(r for line in ledger for r in line["faults"]) == lost, ledger
    assert all(line["B"] == 2 * replicas for line in ledger), "constant B through the cut"
    assert sorted(results) == survivors, job.describe()
    assert all(r["global_step"] == STEPS for r in results.values()), results
    assert job.returncode == 0, job.describe()
    return ledger


def test_a_partitioned_minority_host_stops_and_the_majority_goes_on_exactly(tmp_path: Path, fake_cluster: Callable[..., FakeCluster]) -> None:
    # 3 hosts, one rank (one replica) each; host 2 is cut off during step 1.
    cluster = fake_cluster(3, slots=1)
    argv = ["--steps", str(STEPS), "--shards", "1", "--pause", "0:2"]
    seen: dict[str, Any] = {}
    during = cut_off_while_paused(cluster, tmp_path, 2, cluster.partition, seen)
    job = train_worker(3, tmp_path, argv, [], timeout=300, cluster=cluster, during=during, mpi_args=DETECTOR,
                       launcher_options=["--status-dir", str(tmp_path / "status")])
    assert seen["ranks"] == [2], seen
    ledger = _assert_majority_went_on_exactly(job, tmp_path, argv, 3, survivors=[0, 1], lost=[2])
    # The cut-off rank stopped on its own, for want of quorum, within the bound, and wrote nothing
    # into the run after the cut (its results and parameters never appeared; the ledger is the leader's).
    assert seen["gone_after_s"] is not None and seen["gone_after_s"] < QUORUM_EXIT_BOUND_S, seen
    markers = _markers(tmp_path / "status", [2])
    assert markers.get(2, "").startswith("no quorum"), markers
    assert _files_of(tmp_path, [2]) == [], _files_of(tmp_path, [2])
    print(
        f"minority partition: step 1 committed without host 2 {seen['majority_back_after_s']:.1f}s after the cut "
        f"(repair {ledger[1]['recovery_s']:.2f}s); the cut-off rank left {seen['gone_after_s']:.1f}s after the cut"
    )


def test_an_even_split_goes_on_only_on_the_leaders_side(tmp_path: Path, fake_cluster: Callable[..., FakeCluster]) -> None:
    # 2 hosts x 2 replicas: ranks 0, 1 (the leader's side) on host 0, ranks 2, 3 on host 1, which is cut off.
    cluster = fake_cluster(2)
    argv = ["--steps", str(STEPS), "--shards", "1", "--pause", "0:2"]
    seen: dict[str, Any] = {}
    during = cut_off_while_paused(cluster, tmp_path, 1, cluster.partition, seen)
    job = train_worker(4, tmp_path, argv, [], timeout=300, cluster=cluster, during=during, mpi_args=DETECTOR,
                       launcher_options=["--status-dir", str(tmp_path / "status")])
    assert seen["ranks"] == [2, 3], seen
    _assert_majority_went_on_exactly(job, tmp_path, argv, 4, survivors=[0, 1], lost=[2, 3])
    assert seen["gone_after_s"] is not None and seen["gone_after_s"] < QUORUM_EXIT_BOUND_S, seen
    markers = _markers(tmp_path / "status", [2, 3])
    assert all(markers.get(r, "").startswith("no quorum") for r in (2, 3)), markers
    assert "leader" in markers[2], markers  # the tie went to the side holding the leader
    assert _files_of(tmp_path, [2, 3]) == [], _files_of(tmp_path, [2, 3])


def test_a_frozen_host_is_detected_within_the_bound_and_the_job_ends(tmp_path: Path, fake_cluster: Callable[..., FakeCluster]) -> None:
    # 3 hosts, one replica each; host 2 freezes (SIGSTOP of every process on it, its daemon too).
    cluster = fake_cluster(3, slots=1)
    argv = ["--steps", str(STEPS), "--shards", "1", "--pause", "0:2"]
    seen: dict[str, Any] = {}

    def freeze_and_watch() -> None:
        cluster.wait_until(lambda: _ledger_steps(tmp_path) >= 1, 120, "step 0 in the ledger")
        seen["cut_at"] = time.monotonic()
        seen["frozen"] = cluster.freeze(2)
        cluster.wait_until(lambda: _ledger_steps(tmp_path) >= 2, 120, "step 1 committed without host 2")
        seen["detected_after_s"] = time.monotonic() - seen["cut_at"]

    job = train_worker(3, tmp_path, argv, [], timeout=300, cluster=cluster, during=freeze_and_watch, mpi_args=DETECTOR)
    ledger = _assert_majority_went_on_exactly(job, tmp_path, argv, 3, survivors=[0, 1], lost=[2])
    # Detected by the heartbeat detector within its bound; the job ended (mpiexec, waiting on the
    # frozen daemon, was ended once the last world finished) with status 0.
    assert seen["detected_after_s"] < QUORUM_EXIT_BOUND_S, seen
    assert "mpiexec keeps waiting on ranks it cannot reach" in job.stderr, job.describe()
    assert cluster.stopped_ranks(2) == [2], "the frozen rank is still there, stopped: nothing could fence it"
    print(f"frozen host: step 1 committed {seen['detected_after_s']:.1f}s after the freeze (recovery {ledger[1]['recovery_s']:.2f}s)")
