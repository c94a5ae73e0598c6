"""Hot re-join, launched: real SIGKILLs, real spawned replacement processes (issue 12).

Each job trains tests/workers/train_worker.py with ``rejoin=True``; while replicas are
missing every rank sleeps after each step (``--slow-while-degraded``) so that a replacement
can import torch on the 2-core test machine before the run is over. Every job must end
with an exact ledger (check-ledger against the single-process reference), the reference's
final weights, and bitwise-identical parameters on every rank that finished, replacements
included.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness.mpirun import MPIJob, assert_reference_run, joins_by_replica, ledger_lines, train_worker

pytestmark = pytest.mark.mpi

SLOW = ["--rejoin", "--slow-while-degraded", "1.0"]


def kill(step: int, rank: int, phase: str = "backward") -> dict:
    return {"step": step, "rank": rank, "phase": phase, "kind": "kill"}


def launch(tmp_path: Path, nprocs: int, argv: list[str], faults: list[dict], timeout: float = 240) -> MPIJob:
    job = train_worker(nprocs, tmp_path, argv, faults, timeout=timeout)
    assert job.returncode == 0, job.describe()
    return job


def check_exact(job: MPIJob, argv: list[str], replicas: int) -> dict[int, dict]:
    """The reference run's ledger and weights, and zero false positives of the corruption check."""
    results = assert_reference_run(job, argv, replicas)
    # Every finished rank ran the corruption check after every step: zero false positives.
    assert all(r["sdc_checks"] > 0 and r["sdc_detections"] == 0 for r in results.values()), results
    # A torchmetrics SumMetric of samples updated in training_step: the fault-free total on every rank, the
    # replacements' included (they take the epoch's totals over with the live state; issue 34).
    steps = int(argv[argv.index("--steps") + 1])
    shards = int(argv[argv.index("--shards") + 1]) if "--shards" in argv else 1
    expected = float(steps * replicas * 2 * 2 * shards)  # train_worker's grad_accum 2 x microbatch size 2 per shard rank
    assert {r["samples_seen"] for r in results.values()} == {expected}, results
    return results


def test_two_replicas_lost_at_different_steps_come_back_through_faults_around_their_joins(tmp_path: Path) -> None:
    """4 replicas; rank 1 is killed in step 2 and rank 0 (the leader, the donor) while sending
    the state to rank 1's replacement; both come back, and the run ends with 4 live replicas.
    On the way: attempt 1's replacement dies while starting, attempt 3's right after joining
    (joined and lost in one step); none of it hangs, and the ledger stays exact."""
    argv = ["--steps", "90", *SLOW]
    faults = [kill(2, 1), kill(1, 1, "join_startup"), kill(2, 0, "join_transfer"), kill(3, 0, "joined")]
    job = launch(tmp_path, 4, argv, faults, timeout=360)
    results = check_exact(job, argv, 4)
    err = job.stderr
    assert "re-join attempt 1 dropped: a replacement died while starting" in err, job.describe()
    assert "fault injection: kill rank 0 at step 2 join_transfer" in err
    assert "fault injection: kill rank 0 at step 3 joined" in err
    # The replacements of ranks 0 and 1 finished the run: 4 live replicas at the end, G_cur back to G_init.
    assert sorted(results) == [0, 1, 2, 3], job.describe()
    assert all(r["alive"] == [0, 1, 2, 3] and r["global_step"] == 90 for r in results.values())
    records = ledger_lines(job)
    assert records[-1]["replicas"] == [0, 1, 2, 3] and records[-1]["G_cur"] == 2
    assert sum(len(r["faults"]) for r in records) == 3  # rank 1, rank 0 (the donor), replica 0's first replacement
    joins = joins_by_replica(records)
    # Replica 1 came back in attempt 2 although its donor died mid-transfer.
    assert [j["ok"] for j in joins[1]] == [True], joins
    # Replica 0: joined and lost in one step (attempt 3), then back for good (attempt 4).
    assert [j["ok"] for j in joins[0]] == [False, True], joins
    assert 0 in records[joins[0][0]["step"]]["faults"]
    for js in joins.values():
        for j in js:
            assert 0 <= j["transfer_s"] <= j["pause_s"] < 10, j
    # A joiner's first step: a spare shadowing a veteran; B constant all along.
    rec = records[joins[0][1]["step"]]
    assert rec["roles"]["0"].endswith("spare") and all(r["B"] == 8 for r in records)
    assert "re-joined (state transfer" in err


def test_sharded_replica_replaced_after_its_first_replacement_died_in_the_transfer(tmp_path: Path) -> None:
    """2x2 (shards=2): replica 1 is lost; in attempt 1 one of its two replacements dies while
    receiving its shard, so the other leaves through the gate; attempt 2 brings both back."""
    argv = ["--shards", "2", "--steps", "40", *SLOW]
    job = launch(tmp_path, 4, argv, [kill(2, 2), kill(1, 3, "join_transfer")])
    results = check_exact(job, argv, 2)
    assert sorted(results) == [0, 1, 2, 3], job.describe()
    assert all(r["alive"] == [0, 1] for r in results.values())
    joins = joins_by_replica(ledger_lines(job))
    assert [j["ok"] for j in joins[1]] == [True], joins
    assert "replica-consistency gate" in job.stderr


def test_spawn_that_fails_is_retried_then_given_up_and_training_goes_on(tmp_path: Path) -> None:
    argv = ["--steps", "12", "--rejoin", "--slow-while-degraded", "0.3", "--rejoin-hosts", "no-such-host-lightning-recover", "--rejoin-attempts", "2"]
    job = launch(tmp_path, 2, argv, [kill(1, 1)])
    results = check_exact(job, argv, 2)
    assert sorted(results) == [0] and results[0]["alive"] == [0]
    err = job.stderr
    assert "re-join attempt 1 dropped: spawn failed" in err and "re-join attempt 2 dropped: spawn failed" in err, job.describe()
    assert "2 failed in a row (recover.rejoin.attempts): training goes on without" in err
    assert "re-join attempt 3" not in err
    assert "mpiexec exited with status" in err  # the runtime's status after the failed spawns, and why the job's is 0
