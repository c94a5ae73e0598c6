"""Smoke test of benchmarks/dataloader_workers.py (tiny settings, one plain-python process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_workers_shorten_the_step_of_an_io_bound_dataset() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = ["--workers", "2", "--steps", "7", "--warmup", "2", "--rounds", "1", "--sleep-ms", "15", "--mbs", "2",
            "--grad-accum", "2", "--dim", "16"]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.dataloader_workers", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = re.fullmatch(r"step time 2 workers / 0 workers: (\d+\.\d\d)x", last)
    assert match, proc.stdout
    # 4 reads of 15 ms per step without workers; 2 workers read two microbatches at once.
    assert float(match.group(1)) < 0.9, proc.stdout
