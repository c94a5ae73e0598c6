"""Hot re-join, launched: replacements that fail before they are admitted cost the survivors the attempt only (issue 21).

Two replicas are lost in one step, so each attempt spawns two replacements together; both
leave at start-up, the way a broken node's do. Open MPI 5.0.11 reports only one of two
such deaths to the survivors, and a survivor that then sent the other one a message
waited forever inside MPI (the survivors stopped at the next step). That job must end
with status 0, every step committed, and the fault-free reference's ledger and weights.
A replacement stopped (SIGSTOP) after it said READY, with the hang watchdog off, costs the
attempt: the admission's barrier gives up at its deadline and the leader fences it.
And the example with a fault schedule and ``recover.rejoin=true``: its replacement checks
the schedule against the job's world (not its spawn's one process) and is admitted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from harness.mpirun import assert_reference_run, ledger_lines, run_mpi, train_worker

from lightning_recover.audit.ledger import read_ledger
from lightning_recover.audit.ledger_check import check_ledger

pytestmark = pytest.mark.mpi


def kill(step: int, rank: int) -> dict:
    return {"step": step, "rank": rank, "phase": "backward", "kind": "kill"}


def test_two_replacements_that_exit_at_start_up_are_dropped_and_training_finishes(tmp_path: Path) -> None:
    """4 replicas, ranks 2 and 3 killed in step 1: every attempt spawns 2 replacements, which
    exit with status 3 as the script starts -- rank 2's by ``sys.exit(3)`` (the joiner turns it
    into a reported death), rank 3's by ``os._exit(3)`` (nothing of Python runs: Open MPI
    never tells the survivors). Two attempts are dropped, then given up; training goes on
    with 2 replicas and matches the fault-free run."""
    # Ranks sleep 1 s per step only while attempts are still to come: the attempts run their
    # course however slowly replacements start on a loaded machine, and the job stays short.
    argv = ["--steps", "30", "--rejoin", "--slow-while-rejoining", "1.0", "--rejoin-attempts", "2", "--rejoin-timeout", "30",
            "--replacement-exit", "2:raise:3", "--replacement-exit", "3:hard:3"]
    job = train_worker(4, tmp_path, argv, [kill(1, 2), kill(1, 3)], timeout=240)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 4)
    err = job.stderr
    # What the user sees: each attempt named, dropped, then given up; no third one.
    for attempt in (1, 2):
        assert f"re-join attempt {attempt}: spawning 2 rank(s) for replica(s) [2, 3]" in err, job.describe()
        assert f"re-join attempt {attempt} dropped: " in err, job.describe()
    assert "2 failed in a row (recover.rejoin.attempts): training goes on without" in err, job.describe()
    assert "re-join attempt 3" not in err
    # The replacements saw the job's world (4 ranks), not their spawn's (2).
    assert "train_worker: replacement for rank 3 (world 4) exits with status 3 (hard)" in err, job.describe()
    # The survivors finished every step; nobody else wrote a result (a replacement never became rank 2 or 3).
    assert sorted(results) == [0, 1], job.describe()
    assert all(r["alive"] == [0, 1] and r["global_step"] == 30 for r in results.values()), results
    records = ledger_lines(job)
    assert [r["step"] for r in records] == list(range(30))
    assert records[-1]["replicas"] == [0, 1] and all(r["B"] == 8 for r in records)
    assert not any(r.get("joins") for r in records), "a dropped attempt must never show as a join"


def test_example_with_a_fault_schedule_admits_its_replacement(tmp_path: Path) -> None:
    """examples/pretrain.py, 2 ranks, ``fault.schedule`` kills rank 1 in step 1, ``recover.rejoin=true``.
    The replacement validates the schedule (rank 1 of a 2-rank job) as the launched ranks did;
    it used to see its spawn's world of 1 rank and exit with status 2. Here it joins and the
    job ends with both replicas live."""
    run = tmp_path / "run"
    # 600 tiny steps: a replacement was ready after 260-290 of them here, at load averages 1 to 7.5.
    job = run_mpi(
        2,
        ["examples/pretrain.py", "model=tiny", "trainer.max_steps=600", "recover.grad_accum=2", "seed=3",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "recover.rejoin=true",
         "fault.schedule=[{step:1,rank:1,phase:backward,kind:kill}]", f"hydra.run.dir={run}"],
        tmp_path,
        timeout=240,
    )
    assert job.returncode == 0, job.describe()
    assert "before it was admitted" not in job.stderr and "but the job has" not in job.stderr, job.describe()
    ledger = read_ledger(run / "ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(600)), job.describe()
    joins = [(r["step"], j) for r in ledger for j in r.get("joins", [])]
    assert [j["replica"] for _, j in joins] == [1] and joins[0][1]["ok"], (joins, job.describe())
    assert ledger[-1]["replicas"] == [0, 1] and all(r["B"] == 4 for r in ledger)
    verdict = check_ledger(run / "ledger.jsonl")
    assert verdict.ok, verdict.problems
    summary = [line for line in job.stdout.splitlines() if line.startswith("pretrain.py: done:")]
    assert len(summary) == 1 and "live replicas 2/2" in summary[0], job.describe()


def test_replacement_stopped_after_ready_costs_the_attempt_then_the_next_one_joins(tmp_path: Path) -> None:
    """2 replicas, rank 1 killed in step 1, hang watchdog off (``--hang-timeout 0``: nobody kills
    a stopped process for us). Attempt 1's replacement is SIGSTOPped right after it said READY,
    so the admission's barrier never completes: the survivor gives the attempt up at its
    deadline and fences the stopped process; attempt 2's replacement joins."""
    argv = ["--steps", "30", "--rejoin", "--slow-while-rejoining", "1.0", "--rejoin-attempts", "2", "--rejoin-timeout", "15"]
    faults = [kill(1, 1), {"step": 1, "rank": 1, "phase": "join_ready", "kind": "hang"}]
    job = run_mpi(2, ["tests/workers/train_worker.py", *argv, "--faults", json.dumps(faults)], tmp_path, timeout=200, hang_timeout=0)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 2)
    err = job.stderr
    assert "fault injection: hang rank 1 at step 1 join_ready" in err, job.describe()
    assert "re-join attempt 1 dropped: a replacement died or did not come while the world grew" in err, job.describe()
    assert "leader: killing replacement for rank 1 (pid " in err, job.describe()
    assert sorted(results) == [0, 1] and all(r["alive"] == [0, 1] and r["global_step"] == 30 for r in results.values()), results
    joins = [j for r in ledger_lines(job) for j in r.get("joins", [])]
    assert [(j["replica"], j["ok"]) for j in joins] == [(1, True)], joins
