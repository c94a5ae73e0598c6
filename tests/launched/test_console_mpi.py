"""What the console shows in a launched run with a kill (issue 34, point 4).

A user's LightningModule (``tests/workers/epoch_user.py``: Lightning's own console on, a
ModelCheckpoint whose directory also holds the step ledger, so the strategy's write fence
is there first) runs on 3 ranks with an ``srun`` binary on the PATH, and one rank is
SIGKILLed in the epoch's last step. The test reads the captured output as the user would:
no Open MPI ``NBC_`` line, Lightning's banner once (not once per rank), no advice to use
srun, no "Checkpoint directory ... exists and is not empty", no DCP single-process warning;
the project's own line about the loss is there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.mpirun import run_mpi

pytestmark = pytest.mark.mpi
SCRIPT = "tests/workers/epoch_user.py"


def test_a_kill_shows_the_projects_lines_once_and_nothing_of_open_mpi_or_lightning_per_rank(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake / "srun").chmod(0o755)
    kill = [{"step": 1, "rank": 1, "phase": "forward", "kind": "kill"}]
    job = run_mpi(
        3, [SCRIPT, "--samples", "24", "--epochs", "1", "--ckpt-dir", str(tmp_path / "out" / "ck"), "--faults", json.dumps(kill)],
        tmp_path / "out", timeout=300, env={"PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"},
    )
    assert job.returncode == 0, job.describe()
    console = job.stdout + job.stderr
    assert "NBC_" not in console, job.describe()
    assert console.count("GPU available:") == 1 and console.count("TPU available:") == 1, job.describe()
    assert console.count("💡 Tip") <= 1, job.describe()
    assert "srun" not in console, job.describe()
    assert "exists and is not empty" not in console, job.describe()
    assert "torch.distributed is disabled" not in console, job.describe()
    assert "[lightning-recover] world epoch 1: lost replica(s) [1]; alive [0, 2]" in console, job.describe()
    left_out = [line for line in job.stderr.splitlines() if "line(s) of Open MPI's internal NBC errors" in line]
    assert len(left_out) <= 1, job.describe()
    print(left_out[0] if left_out else "no NBC line this time")
    results = job.results()
    assert sorted(results) == [0, 2] and all(r["faults"] == 1 and r["steps"] == 2 for r in results.values()), job.describe()
