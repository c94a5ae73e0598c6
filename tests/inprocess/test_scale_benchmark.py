"""Smoke test of benchmarks/scale.py: one rank's bookkeeping at several job sizes, in-process.

Its numbers are CPU times, which a unit test must not judge (the machine is shared); what is
asserted is what does not depend on the machine: every quantity measured at every size, the
ledger lines' bytes, the generated ledger checked, the fitted curves readable by simulate.py,
and the headline ratio printed last.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest


from benchmarks import scale


def test_scale_quick_measures_every_size_and_prints_the_ratio_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "scale.json"
    assert scale.main(["--quick", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"steady step \(plan \+ commit \+ ledger record\) at W=2048: .* ratio \d+\.\d\dx", lines[-1]), lines[-1]
    assert any(line.startswith("ledger at W=2048, B=16384: 1000 steps") and "ledger OK: 1000 steps" in line for line in lines)
    result = json.loads(out.read_text())
    assert [r["W"] for r in result["rows"]] == [64, 512, 2048]
    for row in result["rows"]:
        assert all(row[key] > 0 for key, *_ in scale.COLUMNS), row
        assert row["steady_line_bytes"] < 1024 and row["change_line_bytes"] < 1024, row
    fits = {k: tuple(v) for k, v in result["curves"].items()}
    assert set(fits) == {"rank_step_s", "engine_loss_s", "engine_replan_s", "join64_s"} and fits == scale.fitted_costs(result["rows"])
    a, k = fits["engine_loss_s"]
    assert a > 0 and abs(a * 2048**k - result["rows"][-1]["engine_loss_s"]) < 10 * result["rows"][-1]["engine_loss_s"]
