"""A rank SIGKILLed at each point of its start, before its first step (tests/workers/startup_worker.py, 2 ranks).

Before the communicator exists (``start``: before MPI_Init; ``imports``: after it, before the
strategy) the job cannot go on: it ends within its bound with exit status 69 and ONE line
naming the lost rank, its host and the fix, no traceback. From the communicator on
(``setup``, ``configure_model``, ``broadcast``: the first broadcast of the weights,
``checkpoint``: while resuming) the survivor goes on without that replica and its ledger is
exact: every step committed once with the same B. Under ``--supervise`` a launch lost at start is
relaunched, within ``--max-relaunches``; a rank lost on another host, which the launcher cannot see,
is caught by the start bound (fake hosts).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from harness.mpirun import ROOT, run_mpi

from lightning_recover.audit.ledger import read_ledger
from lightning_recover.audit.ledger_check import check_ledger
from benchmarks.rigs.fake_cluster import FakeCluster

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/startup_worker.py"
#: What the user must read: the lost rank, its host, the fix; said once.
LOST = re.compile(r"^\[lightning-recover\] lost while the job started, before its first step: rank 1 on host (\S+),.*relaunch", re.MULTILINE)


def _launch(out: Path, *args: str, timeout: float = 120, nprocs: int = 2, **options: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    job = run_mpi(nprocs, [WORKER, *args], out, timeout=timeout, **options)
    return job, time.monotonic() - t0


@pytest.mark.parametrize("point", ["start", "imports"])
def test_a_rank_lost_before_the_communicator_ends_the_job_with_one_line(tmp_path: Path, point: str) -> None:
    job, took = _launch(tmp_path, "--die", point, "--steps", "2")
    lines = LOST.findall(job.stderr)
    assert lines == [socket.gethostname()], job.describe()
    assert job.returncode == 69, job.describe()
    assert "Traceback" not in job.stderr and "outlived mpiexec" not in job.stderr, job.describe()
    assert not list(tmp_path.glob("rank*.json")) and not (tmp_path / "ledger.jsonl").exists(), "nothing trained"
    print(f"rank lost at {point}: the launch ended after {took:.1f} s")


@pytest.mark.parametrize("point", ["setup", "configure_model", "broadcast", "checkpoint"])
def test_a_rank_lost_after_the_communicator_leaves_the_survivor_training_exactly(tmp_path: Path, point: str) -> None:
    steps = 2
    if point == "checkpoint":
        # A checkpoint to resume from: step 1 of a fault-free run, then a resumed run whose rank 1 dies while loading it.
        first, _ = _launch(tmp_path, "--steps", "1", "--ckpt-every", "1")
        assert first.returncode == 0 and (tmp_path / "ckpt" / "last.ckpt").exists(), first.describe()
        steps = 3
    job, took = _launch(tmp_path, "--die", point, "--steps", str(steps), *(["--resume"] if point == "checkpoint" else []))
    assert job.returncode == 0, job.describe()
    assert "lost replica(s) [1]; alive [0]" in job.stderr, job.describe()
    survivor = json.loads((tmp_path / "rank0.json").read_text())
    assert survivor == {"step": steps, "replicas": [0]}, survivor
    assert not (tmp_path / "rank1.json").exists() or point == "checkpoint"  # the first run's rank 1 wrote one
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(steps)), ledger
    assert all(line["B"] == 2 for line in ledger), "constant B: the survivor runs the lost replica's microbatches"
    lost_at = 1 if point == "checkpoint" else 0
    assert [i for i, line in enumerate(ledger) if line["faults"]] == [lost_at] and ledger[lost_at]["faults"] == [1], ledger
    verdict = check_ledger(tmp_path / "ledger.jsonl")
    assert verdict.ok, verdict.problems
    print(f"rank lost at {point}: the survivor finished {steps} steps in {took:.1f} s")


def test_the_supervisor_relaunches_a_launch_lost_at_start_within_its_bound(tmp_path: Path) -> None:
    # Rank 1 dies before MPI_Init on every attempt (a node that stays broken): one relaunch, then it gives up.
    cmd = [sys.executable, "-m", "lightning_recover.cli", "launch", "-n", "2", "--supervise", "--checkpoint-dir", str(tmp_path / "ckpt"),
           "--max-relaunches", "1", "--relaunch-backoff", "0.1", "--", sys.executable, WORKER, "--die", "start", "--steps", "1"]
    env = dict(os.environ, LR_TEST_OUT=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert LOST.findall(done.stderr) == [socket.gethostname()] * 2, done.stderr
    assert "relaunch 1/1" in done.stderr and "giving up: a rank was lost while the job started" in done.stderr, done.stderr
    assert done.returncode == 69, done.stderr


def test_a_rank_lost_before_mpi_init_on_another_host_ends_the_launch_at_the_start_bound(
    tmp_path: Path, fake_cluster: Callable[..., FakeCluster]
) -> None:
    # 2 fake hosts x 2 ranks; rank 3 (host 1) dies before MPI_Init. The launcher on host 0 cannot see
    # host 1's processes: the start bound (15 s from the first rank's init marker) ends the job.
    cluster = fake_cluster(2)
    job, took = _launch(tmp_path, "--die", "start", "--rank", "3", timeout=150, nprocs=4, cluster=cluster,
                        env={"LIGHTNING_RECOVER_START_TIMEOUT": "15"})
    line = re.search(r"^\[lightning-recover\] lost while the job started, before its first step: (.*)$", job.stderr, re.M)
    assert line is not None, job.describe()
    assert line.group(1).startswith("rank 3 (host unknown: it never reached the strategy's start), with no communicator 15 s"), line.group(1)
    assert job.stderr.count("lost while the job started") == 1 and job.returncode == 69, job.describe()
    assert took < 120, f"the launch took {took:.0f} s"
