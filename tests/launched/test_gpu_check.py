"""``python -m benchmarks.gpu_check --device cpu``: the GPU check's own code on a tiny model, as CI runs it.

The script launches real ``lightning-recover`` jobs (a replica SIGKILLed in three of them) and
a stock Lightning ``ModelParallelStrategy`` run, then writes a JSON report. Here every check
must pass on CPU, and the report must say what it measured: the planes each run used, the
one-process comparisons, the NCCL plane named as not testable on one GPU, and the step time
and memory of both strategies side by side.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.mpirun import ROOT

pytestmark = pytest.mark.mpi


def test_gpu_check_passes_on_cpu_and_reports_every_check(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--out", str(tmp_path), "--timeout", "240", "--budget", "800"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["passed"] and report["device"] == "cpu" and report["size"] == "tiny"
    checks = report["checks"]
    assert list(checks) == ["planes", "bf16", "llama", "overhead"]
    assert all(c["ok"] for c in checks.values()), checks
    planes = checks["planes"]
    for plane in ("mpi", "gloo"):
        assert planes[plane]["rank_device"] == "cpu"
        assert planes[plane]["run"]["faults"] == [[], [1], []], "replica 1 was lost in step 1"
        assert planes[plane]["vs_one_process"]["loss_max_rel_diff"] <= 1e-4
    assert "Duplicate GPU detected" in planes["nccl"]
    assert checks["llama"]["kill_losses"] == pytest.approx(checks["llama"]["fault_free_losses"], rel=1e-3)
    overhead = checks["overhead"]
    assert overhead["memory_key"] == "peak_rss_gb" and overhead["step_time_ratio"] > 0
    assert overhead["loss_max_rel_diff_vs_stock"] <= 1e-3, "the same samples as stock Lightning give the same losses"
    for name in ("planes", "bf16", "llama", "overhead"):
        assert f"gpu_check: {name}" in proc.stdout
    assert "gpu_check: passed" in proc.stdout
