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

import json
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from harness.mpirun import MPIJob, assert_reference_run, joins_by_replica, ledger_lines, train_worker

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
    # The second standby (spawned to replace the one used) was told to leave, or, still importing
    # when training ended, fenced; the used one never.
    assert not re.search(r"killing standby \(pid \d+\): standby 1:", err), job.describe()
    for line in err.splitlines():
        if "killing standby" in line:
            assert "training ended" in line, line


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


def test_a_loss_during_the_pools_refill_promotes_the_standby_still_importing(tmp_path: Path) -> None:
    """4 replicas, 1 standby: replica 1 is lost at step 3 and its standby seated, so the leader
    refills the pool with a standby that imports at idle priority beside the training ranks;
    replica 3 is lost at step 6, seconds before that standby can be warm. The leader gives
    its imports their full share (the user is told), it takes replica 3's seat, and the run
    is the reference's."""
    argv = ["--steps", "40", "--rejoin", "--rejoin-standbys", "1", "--slow-while-degraded", "0.5"]
    job = train_worker(4, tmp_path, argv, [kill(3, 1), kill(6, 3)], timeout=360)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 4)
    assert all(r["alive"] == [0, 1, 2, 3] and r["global_step"] == 40 for r in results.values()), results
    err = job.stderr
    assert "standby 1 takes the seat of replica 1" in err, job.describe()
    assert re.search(r"standby 2 \(pid \d+\) is needed before it is warm", err), job.describe()
    assert "standby 2 takes the seat of replica 3" in err, job.describe()
    assert "spawning" not in err, job.describe()  # no cold spawn: the promoted standby served
    joins = joins_by_replica(ledger_lines(job))
    assert [j["ok"] for j in joins[1]] == [True] and [j["ok"] for j in joins[3]] == [True], joins


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


def _standbys_of(outdir: Path, *, importing: bool) -> list[int]:
    """Pids of the standby processes of the job writing to ``outdir`` (their leader's ``LR_TEST_OUT``);
    ``importing``: only those that already mapped torch (they said hello and are importing)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if b"lightning_recover.cli.joiner" not in argv or b"--standby" not in argv:
                continue
            spec = json.loads(argv[argv.index(b"--standby") + 1])
            leader_env = Path(f"/proc/{spec['leader_pid']}/environ").read_bytes().split(b"\0")
            if f"LR_TEST_OUT={outdir}".encode() not in leader_env:
                continue
            if importing and b"libtorch" not in (entry / "maps").read_bytes():
                continue
        except (OSError, ValueError, KeyError, IndexError):
            continue  # it ended meanwhile
        found.append(int(entry.name))
    return found


def _signal_first_standby(outdir: Path, sig: signal.Signals, hit: list[int]) -> Callable[[], None]:
    """What runs beside the job: ``sig`` to its first standby as soon as it imports torch."""

    def during() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pids = _standbys_of(outdir, importing=True)
            if pids:
                os.kill(pids[0], sig)
                hit.append(pids[0])
                return
            time.sleep(0.02)
        raise AssertionError("no standby of the job appeared within 120 s")

    return during


def _line_index(err: str, pattern: str) -> int:
    """The index of the first stderr line matching ``pattern`` (fails the test if none does)."""
    lines = err.splitlines()
    found = next((i for i, ln in enumerate(lines) if re.search(pattern, ln)), None)
    assert found is not None, f"no line matches {pattern!r}:\n{err[-4000:]}"
    return found


def _assert_replica_1_came_back(job: MPIJob, argv: list[str], steps: int, hit: list[int]) -> None:
    """The job finished on the reference run with all 4 replicas; one standby was hit; replica 1 joined once."""
    assert job.returncode == 0, job.describe()
    assert len(hit) == 1, hit
    results = assert_reference_run(job, argv, 4)
    assert all(r["alive"] == [0, 1, 2, 3] and r["global_step"] == steps for r in results.values()), results
    joins = joins_by_replica(ledger_lines(job))
    assert [j["ok"] for j in joins[1]] == [True], joins


def test_the_first_step_waits_for_the_standbys_and_one_killed_while_importing_is_replaced(tmp_path: Path) -> None:
    """4 replicas, 1 standby. The standby is SIGKILLed while it imports torch, while the first
    step waits for it: the leader counts it lost, spawns another, and training starts only
    once that one is warm. Rank 1 is then SIGKILLed in step 3 and the new standby takes its
    seat at once (no cold spawn); the run stays the reference's."""
    argv = ["--steps", "30", "--rejoin", "--rejoin-standbys", "1", "--slow-while-degraded", "0.5"]
    hit: list[int] = []
    beats_before = set(Path("/dev/shm").glob("lightning-recover-*"))
    job = train_worker(4, tmp_path, argv, [kill(3, 1)], timeout=300, during=_signal_first_standby(tmp_path, signal.SIGKILL, hit))
    _assert_replica_1_came_back(job, argv, 30, hit)
    # The killed rank's heartbeat directory did not outlive the job (the launcher removed it).
    assert set(Path("/dev/shm").glob("lightning-recover-*")) <= beats_before
    err = job.stderr
    lost = _line_index(err, r"standby 1 lost: a standby process died")
    ready = _line_index(err, r"1 warm standby\(s\) ready [\d.]+ s into the job's set-up; training starts")
    first_loss = _line_index(err, r"world epoch \d+: lost replica\(s\) \[1\]")
    assert lost < ready < first_loss, job.describe()
    assert "standby 2 takes the seat of replica 1" in err and "spawning" not in err, job.describe()
    # The replacement came from a standby that was warm before the loss.
    line = err.splitlines()[_line_index(err, r"replacement for rank 1 .* starts its first step")]
    assert "standby waiting for a loss" in line, line


def test_a_standby_stopped_while_importing_delays_the_first_step_at_most_the_wait_and_is_given_up(tmp_path: Path) -> None:
    """4 replicas, 1 standby, hang watchdog off. The standby is SIGSTOPped while it imports:
    training starts after ``rejoin_standbys_wait_s`` (5 s) and says so; rank 1 is SIGKILLed in
    step 3; the stopped standby is fenced ``rejoin_timeout_s`` (20 s) after its spawn, a new
    one is spawned and brings replica 1 back; nothing is left stopped at the end."""
    argv = ["--steps", "90", "--rejoin", "--rejoin-standbys", "1", "--rejoin-standbys-wait", "5", "--rejoin-timeout", "20",
            "--slow-while-degraded", "0.5"]
    hit: list[int] = []
    job = train_worker(4, tmp_path, argv, [kill(3, 1)], timeout=300, hang_timeout=0,
                       during=_signal_first_standby(tmp_path, signal.SIGSTOP, hit))
    _assert_replica_1_came_back(job, argv, 90, hit)
    err = job.stderr
    waited = _line_index(err, r"1 standby\(s\) not warm after 5 s \(recover.rejoin.standbys_wait_s\): training starts")
    given_up = _line_index(err, r"standby 1 lost: not warm 20 s after its spawn \(recover.rejoin.timeout_s\)")
    assert waited < given_up < _line_index(err, r"standby 2 takes the seat of replica 1"), job.describe()
    assert f"killing standby (pid {hit[0]}): standby 1: not warm 20 s" in err, job.describe()
    assert not Path(f"/proc/{hit[0]}").exists(), f"the stopped standby {hit[0]} outlived the job"


def test_a_survivor_lost_as_the_survivors_accept_a_standby_ends_that_standby_and_others_take_both_seats(tmp_path: Path) -> None:
    """Two failures at once: rank 1 is SIGKILLed in step 3, standby 1 takes its seat, and rank 2
    dies just before the survivors accept standby 1 (attempt 1), so standby 1 connects to an
    accept its shrunk world never completes. The survivors' repair drops the attempt; standby 1,
    not merged, is ended (kept seated, it waited in its connect for the rest of the run and
    replica 1 never came back), and both lost replicas return from the other standby and the
    pool's refill. The ledger stays exact."""
    argv = ["--steps", "60", "--rejoin", "--rejoin-standbys", "2", "--slow-while-degraded", "0.5"]
    accept = {"step": 1, "rank": 2, "phase": "join_accept", "kind": "kill"}
    job = train_worker(4, tmp_path, argv, [kill(3, 1), accept], timeout=420)
    assert job.returncode == 0, job.describe()
    results = assert_reference_run(job, argv, 4)
    assert sorted(results) == [0, 1, 2, 3], job.describe()
    assert all(r["alive"] == [0, 1, 2, 3] for r in results.values()), job.describe()
    err = job.stderr
    assert "fault injection: kill rank 2 at step 1 join_accept" in err, job.describe()
    assert "re-join attempt 1 dropped: the survivors' world was repaired" in err, job.describe()
    assert "(the standby was not merged yet: ended, another one takes the seat)" in err, job.describe()
    joins = joins_by_replica(ledger_lines(job))
    assert joins[1][-1]["ok"] and joins[2][-1]["ok"], joins
