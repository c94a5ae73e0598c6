"""What a user sees when a launched script raises, dies, ends, or is started the wrong way (issue 11: 1, 9, 10).

Each test launches ``tests/workers/user_script.py`` (a plain Lightning script, tiny model,
one or two steps) and asserts on what reaches the terminal: the traceback, the launcher's
last line, the exit status. Nothing here asserts wall-clock time; the end-of-script test
prints it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.mpirun import MPIJob, run_mpi

pytestmark = pytest.mark.mpi
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/workers/user_script.py"


def last_line(job: MPIJob) -> str:
    lines = job.stderr.strip().splitlines()
    return lines[-1] if lines else ""


@pytest.mark.parametrize(("n", "shards"), [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_user_exception_shows_its_traceback_and_the_launcher_says_the_program_raised(tmp_path: Path, n: int, shards: int) -> None:
    job = run_mpi(n, [SCRIPT, "--shards", str(shards), "--steps", "2", "--raise-in-step", "1"], tmp_path, timeout=240)
    assert job.returncode != 0, job.describe()
    assert "Traceback (most recent call last):" in job.stderr and "in training_step" in job.stderr, job.describe()
    assert "ValueError: user bug 42" in job.stderr, job.describe()
    last = last_line(job)
    assert last.startswith("[lightning-recover] the program raised ValueError on "), job.describe()
    assert "(ValueError: user bug 42)" in last and "traceback above" in last and f"Exit status {job.returncode}" in last
    if shards == 1:  # both ranks reach the bug; with shards a partner may leave through the gate first
        assert "on every rank" in last, job.describe()
    assert "every rank of the job failed" not in job.stderr, "a bug is not a loss of replicas"


def configuration_lines(job: MPIJob) -> list[str]:
    return [line for line in job.stderr.splitlines() if line.startswith("[lightning-recover] configuration error: ")]


def test_strategy_configuration_error_is_one_line_and_status_2(tmp_path: Path) -> None:
    # Refused once MPI is up (the world's size is known): the ranks leave by a signal, the launcher says 2.
    job = run_mpi(2, [SCRIPT, "--target", "3"], tmp_path, timeout=240)
    assert job.returncode == 2, job.describe()
    message = "recover.target_replicas=3 but the job has 2 replicas (2 ranks / 1 shards); set recover.target_replicas <= 2"
    assert [message in line for line in configuration_lines(job)] == [True], job.describe()
    assert "Traceback" not in job.stderr and "uncaught" not in job.stderr and "outlived" not in job.stderr, job.describe()


def test_sigkill_of_every_rank_still_says_the_replicas_died(tmp_path: Path) -> None:
    job = run_mpi(2, [SCRIPT, "--steps", "2", "--kill-in-step", "1"], tmp_path, timeout=240)
    assert job.returncode != 0, job.describe()
    last = last_line(job)
    assert last.startswith("[lightning-recover] every rank of the job failed: no replica survived"), job.describe()
    assert "the replicas died" in last and "ckpt_path=last" in last
    assert "raised" not in last.replace("no rank raised an exception", ""), job.describe()
    assert "Traceback" not in job.stderr


def test_a_script_that_just_ends_exits_0_without_shutdown(tmp_path: Path) -> None:
    started = time.time()
    job = run_mpi(2, [SCRIPT, "--steps", "1", "--end", "none"], tmp_path, timeout=240)
    ended = time.time()
    assert job.returncode == 0, job.describe()
    finished = [float(c) for c in re.findall(r"finished fit at step 1 after [\d.]+s \(clock ([\d.]+)\)", job.stdout)]
    assert len(finished) == 2, job.describe()
    assert not [line for line in job.stderr.splitlines()[1:] if line.startswith("[lightning-recover]")], job.describe()
    print(f"end of script: {ended - max(finished):.1f}s from the last rank's end of fit to the launcher's exit; whole job {ended - started:.1f}s")


def test_devices_above_one_is_refused_with_one_line(tmp_path: Path) -> None:
    job = run_mpi(2, [SCRIPT, "--devices", "2"], tmp_path, timeout=240)
    assert job.returncode != 0, job.describe()
    line = (
        "Trainer(devices=2) with ReCoVerHSDPStrategy: each process drives one device; set Trainer(devices=1) "
        "and start one process per device: lightning-recover launch -n N -- python user_script.py"
    )
    assert job.returncode == 2 and configuration_lines(job) == [f"[lightning-recover] configuration error: {line}"], job.describe()
    assert "Traceback" not in job.stderr, job.describe()


def test_plain_python_warns_it_runs_a_single_replica(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "LIGHTNING_RECOVER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, start_new_session=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("[lightning-recover]")]
    assert warnings == [
        "[lightning-recover] warning: not started by a launcher, so this process trains as a single replica with no "
        "fault tolerance; to run N replicas: lightning-recover launch -n N -- python user_script.py"
    ], proc.stderr[-4000:]
    assert "finished fit at step 1" in proc.stdout
