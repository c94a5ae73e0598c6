"""Lightning's bundled demo transformer (tests/workers/demo_transformer.py) under the strategy.

One launched 4x1 job with the leader SIGKILLed in step 2, against the one-process run of
the same script (one replica accumulating the same B = 4 microbatches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_recover.ledger import read_ledger
from harness.mpirun import ROOT, run_mpi

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/demo_transformer.py"
STEPS = 5


def test_demo_transformer_survives_the_leaders_death_on_the_one_process_trajectory(tmp_path: Path) -> None:
    job = run_mpi(4, [WORKER, "--steps", str(STEPS), "--faults", json.dumps([{"step": 2, "rank": 0, "phase": "forward"}])],
                  tmp_path / "job", timeout=240)
    assert job.returncode == 0, job.describe()
    ref_out = tmp_path / "reference"
    ref_out.mkdir()
    env = {**os.environ, "LR_TEST_OUT": str(ref_out), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    ref = subprocess.run([sys.executable, WORKER, "--steps", str(STEPS), "--grad-accum", "4"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=240)
    assert ref.returncode == 0, ref.stderr[-3000:]
    ledger, reference = read_ledger(job.outdir / "ledger.jsonl"), read_ledger(ref_out / "ledger.jsonl")
    assert [line["faults"] for line in ledger] == [[], [], [0], [], []]
    assert [line["loss"] for line in ledger] == pytest.approx([line["loss"] for line in reference], rel=1e-4)
    results = job.results()
    assert sorted(results) == [1, 2, 3] and all(r["global_step"] == STEPS for r in results.values())
    params = [r["params"] for r in results.values()]
    assert all(p == params[0] for p in params), "survivors hold identical parameters"
    expected = json.loads((ref_out / "rank0.json").read_text())["params"]
    assert params[0] == pytest.approx(expected, rel=1e-3, abs=1e-4)
