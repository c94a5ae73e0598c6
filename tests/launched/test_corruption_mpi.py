"""Silent data corruption, launched (issue 13): a real bit flip in one rank's state, found by the
replicas' fingerprint comparison, repaired in place or evicted; with two replicas, a clear stop."""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.mpirun import MPIJob, assert_reference_run, ledger_lines, train_worker

pytestmark = pytest.mark.mpi


def corrupt(step: int, rank: int, target: str) -> dict:
    return {"step": step, "rank": rank, "phase": "optimizer", "kind": "corrupt", "target": target}


def launch(tmp_path: Path, nprocs: int, argv: list[str], faults: list[dict]) -> MPIJob:
    return train_worker(nprocs, tmp_path, argv, faults, timeout=180)


def test_gradients_caught_before_the_reduction_and_parameters_repaired_in_place(tmp_path: Path) -> None:
    """4 replicas, T=3 (replica 3 is a spare shadowing a contributor). Step 1: a bit of the spare's
    accumulated gradient flips mid-step; the cross-check catches it before the reduction and the
    pair recomputes. Step 3: a bit of replica 2's parameters flips before the update; the
    fingerprint check after the commit names it by majority and it is repaired in place. The
    trajectory and the final weights are the fault-free run's."""
    argv = ["--steps", "8", "--target", "3", "--sdc-every", "1", "--sdc-action", "repair"]
    faults = [
        {"step": 1, "rank": 3, "phase": "backward", "microbatch": 1, "kind": "corrupt", "target": "grads"},
        corrupt(3, 2, "params"),
    ]
    job = launch(tmp_path, 4, argv, faults)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 4)
    assert sorted(results) == [0, 1, 2, 3] and all(r["alive"] == [0, 1, 2, 3] for r in results.values())
    events = [(rec["step"], e) for rec in ledger_lines(job) for e in rec.get("sdc", [])]
    assert len(events) == 2, events
    (s1, grads), (s3, params) = events
    assert s1 == 1 and grads["what"] == "gradients (spare cross-check)" and grads["action"] == "recompute" and grads["shards"] == [0]
    assert 3 in grads["replicas"] and len(grads["replicas"]) == 2  # the spare and the contributor it shadows
    assert (s3, params) == (3, {"step": 3, "replicas": [2], "shards": [0], "what": "parameters+optimizer state", "lag_steps": 1, "action": "repair"})
    assert "computed different gradients; both recompute the step before it is reduced" in job.stderr
    assert "silent data corruption after step 3: replica(s) [2] differ in shard(s) [0]" in job.stderr


def test_corrupted_optimizer_state_is_found_by_majority_and_the_replica_evicted(tmp_path: Path) -> None:
    """3 replicas; replica 1's optimizer state is corrupted before step 2's update; the check after
    step 3 (every 2 steps, so within N) evicts it and the 2 others go on, bitwise alike. With N = 2
    the corrupted replica's step-3 gradients reached the sum (the documented cost of N > 1); a
    one-bit flip moves the trajectory less than the reference tolerance here."""
    argv = ["--steps", "8", "--sdc-every", "2", "--sdc-action", "evict"]
    job = launch(tmp_path, 3, argv, [corrupt(2, 1, "optimizer")])
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 3)
    assert sorted(results) == [0, 2]
    records = ledger_lines(job)
    assert [e["replicas"] for rec in records for e in rec.get("sdc", [])] == [[1]]
    assert records[3]["sdc"][0]["action"] == "evict" and records[3]["sdc"][0]["lag_steps"] == 2
    assert 1 in records[4]["faults"]  # evicted: the next step recovers as from any failure
    assert "silent data corruption after step 3: this replica's state is the odd one out; evicted" in job.stderr


def test_two_replicas_that_differ_stop_with_a_clear_error(tmp_path: Path) -> None:
    argv = ["--steps", "8", "--sdc-every", "1"]
    job = launch(tmp_path, 2, argv, [corrupt(2, 1, "grads")])
    assert job.returncode != 0, job.describe()
    assert "SilentDataCorruptionError" in job.stderr
    assert "without a majority no replica can be trusted over another; relaunch from the newest checkpoint" in job.stderr
    records = ledger_lines(job)
    assert len(records) == 3 and records[2]["sdc"][0]["action"] == "stop"
