"""benchmarks/scaling.py: the fits, the victim choice, and ``--quick`` for real (4 and 8 launched ranks, real SIGKILLs)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lightning_recover.audit.ledger import microbatch_ids, read_ledger


from benchmarks import scaling  # noqa: E402


def test_power_and_log_fits_recover_known_curves() -> None:
    ns = [4, 8, 16, 32, 64]
    a, k = scaling.fit_power(ns, [0.5 * n**1.5 for n in ns])
    assert a == pytest.approx(0.5) and k == pytest.approx(1.5)
    a2, b = scaling.fit_log2(ns, [0.1 + 0.02 * (i + 2) for i in range(len(ns))])
    assert a2 == pytest.approx(0.1) and b == pytest.approx(0.02)
    with pytest.raises(ValueError, match="two distinct sizes"):
        scaling.fit_power([8, 8], [1.0, 2.0])


@pytest.mark.parametrize("n", [3, 4, 8, 64])
def test_victims_are_distinct_non_leaders_and_leave_two_survivors(n: int) -> None:
    victims = scaling.victims_for(n, 3)
    assert len(victims) == min(3, n - 2) and len(set(victims)) == len(victims)
    assert all(0 < v < n for v in victims)


def test_planning_and_ledger_rows_are_measured_by_the_package() -> None:
    row = scaling.time_planning(50, reps=2)
    assert row["B"] == 100 and row["step"] >= row["fail"] > 0


def test_ledger_line_holds_every_id_of_the_step(tmp_path: Path) -> None:
    row = scaling.ledger_line(64, 8, True, tmp_path / "l.jsonl")
    line = json.loads((tmp_path / "l.jsonl").read_text())
    assert microbatch_ids(line) == list(range(64)) and line["ids"] == [[0, 64]] and line["faults"] == [4]
    assert read_ledger(tmp_path / "l.jsonl")[0]["replicas"] == [0, 1, 2, 3, 5, 6, 7]
    assert row["bytes"] == len((tmp_path / "l.jsonl").read_bytes()) and row["G"] == 8


@pytest.mark.mpi
def test_quick_runs_the_curve_with_real_kills_and_leaves_no_process(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``scaling.py --quick``: 4 and 8 ranks, 2 SIGKILLs each, every fault recovered with exact sums."""
    from benchmarks.proctree import all_pids, cmdline

    def ours() -> set[int]:
        return {p for p in all_pids() if "scaling_rank.py" in cmdline(p)}

    before = ours()
    out_json = tmp_path / "scaling.json"
    rc = scaling.main(["--quick", "--quiet-wait", "0", "--out", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0, out
    res = json.loads(out_json.read_text())
    assert [pt["ranks"] for pt in res["curve"]] == [4, 8] and not res["failed"]
    # Issue 23: layer 1 alone loads no torch (the ranks import it afterwards, for their tensors).
    assert not any(pt["torch_loaded_by_comm"] for pt in res["curve"]), res["curve"]
    for pt in res["curve"]:
        assert len(pt["faults"]) == 2
        for fault in pt["faults"]:
            times = fault["times_s"]
            assert all(times[p] >= 0 for p in scaling.PHASES), times
            assert times["recovery"] == pytest.approx(sum(times[p] for p in scaling.PHASES))
            assert fault["buckets_redone"] == 4 and 0 <= fault["buckets_stale"] <= 2  # killed before bucket 2 of 4
            assert times["detect"] < 10.0
    assert "recovery" in res["fits"] and "plan_step" in res["fits"]
    assert out.strip().splitlines()[-1].startswith("recovery time 4 -> 8 ranks:")
    time.sleep(0.5)
    assert not ours() - before, f"ranks of the benchmark left behind: {ours() - before}"
