"""Salvage at the communicator's level: a broken replica's live ranks wait as orphans and re-form a replica.

Real mpiexec, real SIGKILLs (``tests/workers/salvage_worker.py``): 3 replicas x 2 shards, shard 0
of replica 1 killed in step 1, shard 1 of replica 2 in step 3. No process is spawned; the job
ends with 2 whole replicas, the orphans seated as replica 1.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness.mpirun import assert_reference_run, joins_by_replica, ledger_lines, run_mpi, train_worker

pytestmark = pytest.mark.mpi


def test_two_broken_replicas_reform_one_whole_replica_from_orphans(tmp_path: Path) -> None:
    job = run_mpi(6, ["tests/workers/salvage_worker.py"], tmp_path / "out", timeout=120)
    results = job.results()
    assert sorted(results) == [0, 1, 3, 4], job.describe()
    assert [r for r, res in results.items() if res["orphaned"]] == [3, 4], job.describe()
    assert results[3]["orphan_lost"] == [2] and results[4]["orphan_lost"] == [5]
    # Launch rank 4 (shard 0 of replica 2) takes the seat of rank 2 (shard 0 of replica 1); rank 3 keeps its own.
    assert results[4]["seated_as"] == 2 and results[3]["seated_as"] == 3
    for launch, res in results.items():
        assert res["members"] == [0, 1, 2, 3] and res["alive_replicas"] == [0, 1], (launch, res)
        assert res["exact"], f"launch rank {launch}: wrong sums over the re-formed world\n{job.describe()}"
    assert {res["world_epoch"] for res in results.values()} == {3}, "two repairs and one growth"
    assert results[0]["reformed_at_step"] == 3 and results[0]["reformed_in_s"] < 10
    assert "spawn" not in job.stderr.lower(), job.describe()


def test_a_lightning_job_ends_with_two_whole_replicas_from_orphans_alone(tmp_path: Path) -> None:
    """Issue 37's first acceptance: 3 replicas x 2 shards, shard 0 of replica 1 SIGKILLed in step 2 and
    shard 1 of replica 2 in step 5. Their mates wait as orphans, are seated together as replica 1
    (no process spawned), run the script again, receive the live state, and the run ends with 2
    whole replicas and the fault-free run's ledger and weights."""
    argv = ["--shards", "2", "--steps", "14", "--salvage", "--slow-while-degraded", "1.0"]
    faults = [{"step": 2, "rank": 2, "phase": "backward", "kind": "kill"}, {"step": 5, "rank": 5, "phase": "backward", "kind": "kill"}]
    job = train_worker(6, tmp_path, argv, faults, timeout=300)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 3)
    assert sorted(results) == [0, 1, 2, 3], job.describe()
    assert all(r["alive"] == [0, 1] for r in results.values()), results
    err = job.stderr
    assert "orphan rank(s) [4, 3] re-form replica 1 (salvage: no process spawned)" in err, job.describe()
    assert "seated as rank 2 of a re-formed replica" in err and "seated as rank 3 of a re-formed replica" in err, job.describe()
    assert "waits for a seat in a re-formed replica" in err and "spawning" not in err, "no process is spawned"
    joins = joins_by_replica(ledger_lines(job))
    assert [j["ok"] for j in joins[1]] == [True], joins


def test_with_rejoin_the_orphans_spawn_only_the_missing_rank(tmp_path: Path) -> None:
    """Issue 37's second acceptance: 2 replicas x 2 shards with re-join and salvage, shard 1 of replica 1
    SIGKILLed in step 2. Its mate waits as an orphan; the leader seats it with one spawned rank (1
    process, not 2), the job is back to 2 replicas, the ledger's join record says so, and the run
    is exact against the fault-free run."""
    argv = ["--shards", "2", "--steps", "12", "--salvage", "--rejoin", "--slow-while-degraded", "1.0"]
    job = train_worker(4, tmp_path, argv, [{"step": 2, "rank": 3, "phase": "backward", "kind": "kill"}], timeout=300)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 2)
    assert sorted(results) == [0, 1, 2, 3] and all(r["alive"] == [0, 1] for r in results.values()), job.describe()
    err = job.stderr
    assert "re-join attempt 1: orphan rank(s) [2] re-form replica 1 (salvage: 1 process(es) spawned by the orphans, not 2" in err, \
        job.describe()
    assert "seated as rank 2 of a re-formed replica" in err and "spawning" not in err, job.describe()
    joins = joins_by_replica(ledger_lines(job))
    assert [(j["ok"], j["spawned"]) for j in joins[1]] == [(True, 1)], joins


def test_an_orphan_never_seated_leaves_when_training_ends(tmp_path: Path) -> None:
    """Salvage without re-join, 2 x 2, one kill: no orphan completes the lost replica, so its mate waits to
    the end of training and is then told to leave -- not after ``salvage_wait_s`` (300 s), which would
    hold ``mpiexec`` open long after the survivors finished."""
    argv = ["--shards", "2", "--steps", "8", "--salvage"]
    started = time.monotonic()
    job = train_worker(4, tmp_path, argv, [{"step": 2, "rank": 3, "phase": "backward", "kind": "kill"}], timeout=150)
    wall_s = time.monotonic() - started
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 2)
    assert sorted(results) == [0, 1] and all(r["alive"] == [0] for r in results.values()), job.describe()
    err = job.stderr
    assert "waits for a seat in a re-formed replica" in err, job.describe()
    assert "rank 2: replica-consistency gate: an orphan not seated: training ended" in err, job.describe()
    assert wall_s < 120, f"the orphan held the job open: {wall_s:.0f} s\n{job.describe()}"


def test_an_orphan_whose_survivors_all_died_leaves_at_once(tmp_path: Path) -> None:
    """Salvage without re-join, 2 x 2: rank 3 SIGKILLed in step 2 (rank 2 waits as an orphan), then both ranks
    of the other replica in step 4. Nobody is left to seat rank 2 or tell it to leave: it must leave when it
    sees its lobby's survivors dead -- not after ``salvage_wait_s`` (300 s), which would hold ``mpiexec`` (and a
    supervisor's relaunch) open that long."""
    argv = ["--shards", "2", "--steps", "8", "--salvage"]
    faults = [{"step": 2, "rank": 3, "phase": "backward", "kind": "kill"},
              {"step": 4, "rank": 0, "phase": "backward", "kind": "kill"},
              {"step": 4, "rank": 1, "phase": "backward", "kind": "kill"}]
    started = time.monotonic()
    job = train_worker(4, tmp_path, argv, faults, timeout=200)
    wall_s = time.monotonic() - started
    assert job.returncode != 0, f"every replica died, the job cannot have succeeded\n{job.describe()}"
    err = job.stderr
    assert "waits for a seat in a re-formed replica" in err, job.describe()
    assert "rank 2: replica-consistency gate: an orphan not seated: every survivor of its lobby is gone" in err, job.describe()
    assert wall_s < 120, f"the orphan held the job open: {wall_s:.0f} s\n{job.describe()}"


def test_a_seated_orphan_is_orphaned_again_and_seated_again(tmp_path: Path) -> None:
    """2 x 2 with re-join and salvage: rank 3 SIGKILLed in step 2, its mate (rank 2) seated again with one
    spawned rank; that spawned rank SIGKILLed in the first step after it joined. Rank 2 -- still a
    process of the launch -- waits as an orphan a second time and is seated again with a second
    spawned rank: every join spawns 1 process, and the run is exact."""
    argv = ["--shards", "2", "--steps", "26", "--salvage", "--rejoin", "--slow-while-degraded", "1.0"]
    faults = [{"step": 2, "rank": 3, "phase": "backward", "kind": "kill"}, {"step": 1, "rank": 3, "phase": "joined", "kind": "kill"}]
    job = train_worker(4, tmp_path, argv, faults, timeout=300)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 2)
    assert sorted(results) == [0, 1, 2, 3] and all(r["alive"] == [0, 1] for r in results.values()), job.describe()
    err = job.stderr
    assert err.count("rank 2: replica 1 lost rank(s) [3]: rank 2 waits as an orphan") == 2, job.describe()
    assert err.count("seated as rank 2 of a re-formed replica") == 2, job.describe()
    joins = joins_by_replica(ledger_lines(job))
    assert [j["spawned"] for j in joins[1]] == [1, 1] and joins[1][-1]["ok"], joins


def test_with_warm_standbys_the_orphan_is_completed_and_the_standby_kept_for_a_replica_lost_whole(tmp_path: Path) -> None:
    """Salvage, re-join and one warm standby, 2 x 2, shard 1 of replica 1 SIGKILLed in step 2: the orphan
    (rank 2) and one spawned rank re-form replica 1 -- the healthy rank keeps working -- and the standby is
    not seated on that replica too (it stays warm for a replica that no orphan can help); the run is
    exact and the job ends by itself."""
    argv = ["--shards", "2", "--steps", "12", "--salvage", "--rejoin", "--rejoin-standbys", "1", "--slow-while-degraded", "1.0"]
    job = train_worker(4, tmp_path, argv, [{"step": 2, "rank": 3, "phase": "backward", "kind": "kill"}], timeout=300)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 2)
    assert sorted(results) == [0, 1, 2, 3] and all(r["alive"] == [0, 1] for r in results.values()), job.describe()
    err = job.stderr
    assert "orphan rank(s) [2] re-form replica 1 (salvage: 1 process(es) spawned by the orphans, not 2" in err, job.describe()
    assert "takes the seat of replica" not in err, f"a standby was seated on the replica the orphan re-forms\n{job.describe()}"
    joins = joins_by_replica(ledger_lines(job))
    assert [(j["ok"], j["spawned"]) for j in joins[1]] == [(True, 1)], joins
