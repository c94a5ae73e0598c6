"""Warm standbys, launched: real SIGKILLs, standbys spawned by the leader ahead of any loss.

Each job trains tests/workers/train_worker.py with ``rejoin=True`` and
``rejoin_standbys``: the leader spawns the standbys while the job sets up; they import torch
and Lightning and sleep. A SIGKILLed replica's seat goes to a warm standby, whose script
starts at once and is merged at the next step boundary after it is ready. What the user
sees: the log says which standby took which seat, each replacement prints where its
start-up time went, the lost replicas come back, the run's ledger and weights are the
single-process reference's, and no standby outlives the job.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from harness.mpirun import assert_reference_run, joins_by_replica, ledger_lines, train_worker

pytestmark = pytest.mark.mpi


def kill(step: int, rank: int, phase: str = "backward") -> dict:
    return {"step": step, "rank": rank, "phase": phase, "kind": "kill"}


def test_a_lost_replica_comes_back_from_a_warm_standby_and_the_spare_standby_leaves_at_the_end(tmp_path: Path) -> None:
    """4 replicas, 1 standby: rank 1 is SIGKILLed in step 3; the standby takes its seat, joins,
    and the leader keeps one more standby ready, which leaves when training ends."""
    argv = ["--steps", "40", "--rejoin", "--rejoin-standbys", "1", "--slow-while-degraded", "0.5"]
    job = train_worker(4, tmp_path, argv, [kill(3, 1)], timeout=300)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 4)
    assert sorted(results) == [0, 1, 2, 3], job.describe()
    assert all(r["alive"] == [0, 1, 2, 3] and r["global_step"] == 40 for r in results.values())
    err = job.stderr
    assert "standby 1 takes the seat of replica 1" in err, job.describe()
    assert re.search(r"re-join attempt \d+: merging standby 1 for replica 1", err), job.describe()
    # The replacement says where its start-up went, and that it came from a standby.
    line = next((ln for ln in err.splitlines() if "replacement for rank 1" in ln and "starts its first step" in ln), None)
    assert line is not None and "standby imports" in line and "after the loss" in line, job.describe()
    assert "spawning" not in err  # no cold spawn: the standby served
    joins = joins_by_replica(ledger_lines(job))
    assert [j["ok"] for j in joins[1]] == [True], joins
    # The second standby (spawned to replace the one used) was told to leave, not left behind.
    assert "killing standby" not in err, job.describe()


def test_two_losses_close_together_are_both_served_by_standbys(tmp_path: Path) -> None:
    """4 replicas, 2 standbys: ranks 1 and 3 are SIGKILLed two steps apart, so the second loss
    can land while the first replacement sets up or is being merged (then that attempt is
    dropped by the survivors' own repair, without backoff, and the standby keeps its seat).
    Both replicas come back from standbys; the ledger stays exact."""
    argv = ["--steps", "50", "--rejoin", "--rejoin-standbys", "2", "--slow-while-degraded", "0.5"]
    job = train_worker(4, tmp_path, argv, [kill(3, 1), kill(5, 3)], timeout=360)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 4)
    assert sorted(results) == [0, 1, 2, 3], job.describe()
    assert all(r["alive"] == [0, 1, 2, 3] for r in results.values())
    err = job.stderr
    # Both standbys start together while the job sets up (one after the other, the second was
    # ready seconds after an early loss): the user sees how many.
    assert "2 warm standby(s) starting while the job sets up" in err, job.describe()
    assert re.search(r"standby \d+ takes the seat of replica 1", err) and re.search(r"standby \d+ takes the seat of replica 3", err), job.describe()
    assert "spawning" not in err, job.describe()
    # A drop caused by the survivors' own repair never backs off.
    for line in err.splitlines():
        if "dropped: the survivors' world was repaired" in line:
            assert "next attempt at the next step boundary" in line, line
    records = ledger_lines(job)
    joins = joins_by_replica(records)
    assert [j["ok"] for j in joins[1]] == [True] and [j["ok"] for j in joins[3]] == [True], joins
    assert all(r["B"] == 8 for r in records)


def test_the_leaders_death_orphans_its_standby_which_leaves_and_the_new_leader_brings_replica_0_back(tmp_path: Path) -> None:
    """4 replicas, 1 standby: rank 0 -- the leader, whose link the standby hangs on -- is SIGKILLed
    in step 3. Its standby leaves by itself (its leader is gone), the new leader (rank 1) spawns
    its own, which takes replica 0's seat; the job ends with 4 replicas and nothing left over."""
    argv = ["--steps", "40", "--rejoin", "--rejoin-standbys", "1", "--slow-while-degraded", "0.5"]
    job = train_worker(4, tmp_path, argv, [kill(3, 0)], timeout=300)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 4)
    assert sorted(results) == [0, 1, 2, 3], job.describe()
    assert all(r["alive"] == [0, 1, 2, 3] for r in results.values())
    err = job.stderr
    assert "standby 1 takes the seat of replica 0" in err, job.describe()
    joins = joins_by_replica(ledger_lines(job))
    assert [j["ok"] for j in joins[0]] == [True], joins
