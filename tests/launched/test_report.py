"""Tests of `lightning-recover report`: recovery metrics from hand-built step ledgers."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_recover.audit.ledger_writer import LedgerWriter
from lightning_recover.audit.report import (
    ReportError,
    load_ledger,
    main,
    plot_report,
    report_from_path,
    summarize,
)

ROOT = Path(__file__).resolve().parents[2]
B = 4


def record(step: int, replicas: list[int], **over: Any) -> dict[str, Any]:
    """A ledger line as StepEngine.finish writes it (fault-free unless overridden)."""
    rec: dict[str, Any] = {
        "step": step,
        "loss": 1.0 / (step + 1),
        "B": B,
        "committed": B,
        "microbatch_ids": list(range(step * B, step * B + B)),
        "replicas": replicas,
        "world_epoch": 0,
        "roles": {str(r): "major" for r in replicas},
        "faults": [],
        "extra_microbatches": 0,
        "G_cur": 1,
        "step_time_s": 1.0,
        "recovery_s": 0.0,
        "pauses_s": [],
        "detect_s": 0.0,
        "detects_s": [],
        "stale_buckets": 0,
        "policy": "static",
        "divisor": B,
    }
    rec.update(over)
    return rec


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    with LedgerWriter(path) as w:
        for r in records:
            w.write(r)
    return path


def faulty_run() -> list[dict[str, Any]]:
    """6 steps: replica 1 dies in step 2, replicas 2 and 3 in step 4 (two recoveries), then
    replica 1 re-joins in step 5 while a second joiner fails. Times are binary fractions so
    every expected number below is exact."""
    return [
        record(0, [0, 1, 2, 3]),
        record(1, [0, 1, 2, 3]),
        record(2, [0, 2, 3], faults=[1], extra_microbatches=1, step_time_s=1.5, recovery_s=0.5,
               pauses_s=[0.5], detect_s=0.125, detects_s=[0.125], world_epoch=1),
        record(3, [0, 2, 3], world_epoch=1),
        record(4, [0], faults=[2, 3], extra_microbatches=2, step_time_s=2.0, recovery_s=1.0,
               pauses_s=[0.25, 0.75], detect_s=0.25, detects_s=[0.125, 0.125], world_epoch=3),
        record(5, [0, 1], world_epoch=4, joins=[
            {"replica": 1, "transfer_s": 0.5, "pause_s": 0.25, "ok": True},
            {"replica": 2, "transfer_s": 0.0, "pause_s": 0.125, "ok": False},
        ]),
    ]


# ---------------------------------------------------------------------------------------
# exact metrics


def test_metrics_of_a_faulty_run_are_exact():
    r = summarize(faulty_run(), microbatch_size=8)
    assert (r.steps, r.first_step, r.last_step, r.B, r.policy) == (6, 0, 5, 4, "static")
    assert r.wall_s == 7.5
    assert (r.replicas_start, r.replicas_min, r.replicas_end) == (4, 1, 2)
    # MTTR: three recoveries (0.5, 0.25, 0.75) for three lost replicas.
    assert (r.faults, r.faulted_steps, r.recoveries) == (3, 2, 3)
    assert (r.paused_s, r.mttr_s, r.pause_max_s, r.pause_per_fault_s) == (1.5, 0.5, 0.75, 0.5)
    assert (r.detections, r.detect_mean_s, r.detect_max_s) == (3, 0.125, 0.125)
    # MTBF: 7.5 s / 3 lost replicas; the faulted steps start at 2.0 s and 4.5 s.
    assert (r.mtbf_s, r.fault_gap_mean_s) == (2.5, 2.5)
    assert (r.replayed_microbatches, r.committed_microbatches, r.replay_ratio) == (3, 24, 0.125)
    assert (r.join_attempts, r.joins_ok, r.join_success_rate) == (2, 1, 0.5)
    assert (r.join_transfer_mean_s, r.join_pause_mean_s, r.join_paused_s) == (0.5, 0.1875, 0.375)
    assert r.microbatches_per_s == 24 / 7.5 and r.samples_per_s == 24 * 8 / 7.5
    assert r.unpaused_fraction == 1 - (1.5 + 0.375) / 7.5 == 0.75
    assert r.steady_step_time_s == 1.0
    assert r.warnings == ()


def test_text_report_shows_the_metrics(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = write(tmp_path / "ledger.jsonl", faulty_run())
    assert main([str(path), "--microbatch-size", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ledger {path}: 6 steps (0..5), B=4, policy static, 7.500 s in steps\n")
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "4 at start, 1 at least, 2 at end" in lines["replicas"]
    assert "3 replicas lost in 2 steps" in lines["faults"]
    assert "0.500 s mean pause per recovery (3 recoveries, max 0.750 s, 1.500 s in all; 0.500 s per lost replica)" in lines["MTTR"]
    assert "0.125 s mean per failed round (3 rounds, max 0.125 s)" in lines["detection"]
    assert "2.500 s per lost replica; 2.500 s mean between faulted steps" in lines["MTBF"]
    assert "0.1250 (3 replayed of 24 committed microbatches)" in lines["replay"]
    assert "1 of 2 succeeded (50%), 0.500 s mean state transfer, 0.188 s mean survivors' pause" in lines["joins"]
    assert "3.2 microbatches/s (25.6 samples/s at 8 per microbatch); 75.0% of the time not paused" in lines["throughput"]


def test_fault_free_run_reports_no_faults_and_no_joins(tmp_path: Path, capsys):
    path = write(tmp_path / "ledger.jsonl", [record(t, [0, 1]) for t in range(4)])
    r = report_from_path(path)
    assert (r.faults, r.recoveries, r.mttr_s, r.mtbf_s, r.fault_gap_mean_s) == (0, 0, None, None, None)
    assert (r.join_attempts, r.join_success_rate, r.replay_ratio, r.unpaused_fraction) == (0, None, 0.0, 1.0)
    assert r.microbatches_per_s == 4.0
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "  joins         no joins\n" in out
    assert "  faults        none\n" in out
    assert "  MTBF          no faults in 4.000 s\n" in out
    assert "samples/s" not in out  # no microbatch size given: no made-up sample count


def test_older_ledger_without_pause_lists_uses_recovery_s():
    """Ledgers written before pauses_s/detects_s existed: one pause per step from recovery_s."""
    recs = faulty_run()
    for rec in recs:
        del rec["pauses_s"], rec["detects_s"]
        rec.pop("joins", None)
    r = summarize(recs)
    assert (r.recoveries, r.paused_s, r.mttr_s) == (2, 1.5, 0.75)
    assert (r.detections, r.detect_mean_s) == (2, 0.1875)


def test_json_output(tmp_path: Path, capsys):
    path = write(tmp_path / "ledger.jsonl", faulty_run())
    assert main([str(path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["mttr_s"] == 0.5 and got["mtbf_s"] == 2.5 and got["replay_ratio"] == 0.125
    assert got["join_success_rate"] == 0.5 and got["unpaused_fraction"] == 0.75
    assert got["samples_per_s"] is None and got["warnings"] == []


# ---------------------------------------------------------------------------------------
# errors name the bad value and the fix


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "absent.jsonl", r"no ledger at '.*absent.jsonl': the file does not exist; pass the file the run wrote"),
        (lambda d: d, r"is a directory; pass the ledger file in it"),
        (lambda d: _text(d / "empty.jsonl", "\n"), r"has no steps: the run committed none"),
        (lambda d: _text(d / "x.jsonl", "hello\n"), r"x.jsonl:1: not a JSON line .*; `report` reads a lightning-recover step ledger"),
        (lambda d: _text(d / "x.jsonl", '{"step": 0, "loss": 1.0}\n'),
         r"record 1 \(step 0\) lacks \['B', 'committed', .*\]: not a lightning-recover step ledger"),
        (lambda d: _bytes(d / "fig.png", b"\x89PNG\r\n\x1a\n\xff\xfe"), r"is not text, so not a step ledger"),
    ],
)
def test_unreadable_ledgers_are_explained(tmp_path: Path, capsys, make, message):
    path = make(tmp_path)
    with pytest.raises(ReportError, match=message):
        report_from_path(path)
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-recover report: ")
    assert str(path) in err


def _text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "over, message",
    [
        ({"step_time_s": -1.0}, r"record 3 \(step 2\): step_time_s must be seconds >= 0, got -1.0"),
        ({"faults": 1}, r"step 2\): faults must be a list of replica indices, got 1"),
        ({"pauses_s": [0.5, "x"]}, r"step 2: pauses_s must be a list of seconds >= 0, got \[0.5, 'x'\]"),
        ({"joins": {"replica": 1}}, r"step 2: joins must be a list of \{replica, transfer_s, pause_s, ok\}"),
        ({"joins": [{"replica": 1, "ok": "yes"}]}, r"step 2: joins\[0\].ok must be true or false, got 'yes'"),
        ({"joins": [{"replica": 1, "ok": True, "transfer_s": math.inf}]}, r"joins\[0\].transfer_s must be seconds >= 0, got inf"),
    ],
)
def test_bad_values_are_named(over: dict[str, Any], message: str):
    recs = faulty_run()
    recs[2].update(over)
    with pytest.raises(ReportError, match=message):
        summarize(recs)


def test_inconsistent_ledgers_warn(tmp_path: Path, capsys):
    recs = faulty_run()
    del recs[3]
    recs.append(dict(recs[0]))
    r = summarize(recs)
    assert r.warnings == (
        "steps [0] appear more than once; their metrics count twice (run check-ledger)",
        "steps are missing before step(s) [4] (run check-ledger)",
    )
    assert main([str(write(tmp_path / "l.jsonl", recs))]) == 0
    assert "warning: steps are missing before step(s) [4] (run check-ledger)" in capsys.readouterr().out


def test_bad_microbatch_size(tmp_path: Path, capsys):
    path = write(tmp_path / "ledger.jsonl", faulty_run())
    with pytest.raises(SystemExit):
        main([str(path), "--microbatch-size", "0"])
    assert "--microbatch-size must be a positive integer, got 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# invariants


@st.composite
def ledgers(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Valid ledgers: B fixed, committed <= B, replays among the committed ids, any pauses/joins."""
    n = draw(st.integers(1, 12))
    b = draw(st.integers(1, 8))
    secs = st.floats(0, 10, allow_nan=False, allow_infinity=False)
    recs = []
    for step in range(n):
        committed = draw(st.integers(1, b))
        faults = draw(st.lists(st.integers(0, 7), max_size=3, unique=True))
        pauses = draw(st.lists(secs, max_size=3)) if faults else []
        joins = draw(st.lists(st.fixed_dictionaries(
            {"replica": st.integers(0, 7), "transfer_s": secs, "pause_s": secs, "ok": st.booleans()}
        ), max_size=2))
        # step time covers the pauses of its step, as StepEngine measures it
        step_time = sum(pauses) + sum(j["pause_s"] for j in joins) + draw(secs)
        recs.append(record(
            step, draw(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True)), B=b,
            committed=committed, microbatch_ids=list(range(step * b, step * b + committed)),
            faults=faults, extra_microbatches=draw(st.integers(0, committed)) if faults else 0,
            step_time_s=step_time, recovery_s=sum(pauses), pauses_s=pauses,
            detects_s=draw(st.lists(secs, max_size=3)), joins=joins,
        ))
    return recs


@settings(max_examples=60, deadline=None)
@given(ledgers(), st.randoms(use_true_random=False))
def test_metrics_do_not_depend_on_line_order(recs: list[dict[str, Any]], rnd: random.Random):
    shuffled = list(recs)
    rnd.shuffle(shuffled)
    assert summarize(shuffled) == summarize(recs)


@settings(max_examples=60, deadline=None)
@given(ledgers(), st.data())
def test_counts_add_up_over_a_split(recs: list[dict[str, Any]], data: st.DataObject):
    """A run cut in two (e.g. a resumed job's two ledgers) has the counts of both parts."""
    if len(recs) < 2:
        return
    cut = data.draw(st.integers(1, len(recs) - 1))
    whole, a, b = summarize(recs), summarize(recs[:cut]), summarize(recs[cut:])
    for key in ("steps", "committed_microbatches", "replayed_microbatches", "faults", "faulted_steps",
                "recoveries", "detections", "join_attempts", "joins_ok"):
        assert getattr(whole, key) == getattr(a, key) + getattr(b, key), key
    for key in ("wall_s", "paused_s", "join_paused_s"):
        assert math.isclose(getattr(whole, key), getattr(a, key) + getattr(b, key), rel_tol=1e-9, abs_tol=1e-9), key


@settings(max_examples=100, deadline=None)
@given(ledgers())
def test_ratios_are_fractions_and_means_are_consistent(recs: list[dict[str, Any]]):
    r = summarize(recs)
    assert 0.0 <= r.replay_ratio <= 1.0
    assert r.unpaused_fraction is None or 0.0 <= r.unpaused_fraction <= 1.0
    assert r.join_success_rate is None or 0.0 <= r.join_success_rate <= 1.0
    assert r.warnings == ()
    if r.faults:
        assert math.isclose(r.mtbf_s * r.faults, r.wall_s, rel_tol=1e-9, abs_tol=1e-12)
    if r.recoveries:
        assert r.mttr_s <= r.pause_max_s * (1 + 1e-12)
        assert math.isclose(r.mttr_s * r.recoveries, r.paused_s, rel_tol=1e-9, abs_tol=1e-12)
    assert r.replicas_min <= min(r.replicas_start, r.replicas_end)


# ---------------------------------------------------------------------------------------
# the figure


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.ticker"):
        monkeypatch.setitem(sys.modules, name, None)  # import of a None entry raises ImportError
    out = tmp_path / "fig.png"
    with pytest.raises(ReportError, match=r"--plot needs matplotlib, which is not installed; run: pip install lightning-recover\[plots\]"):
        plot_report(faulty_run(), out)
    assert not out.exists()


@pytest.mark.plots
def test_plot_draws_a_png(tmp_path: Path, capsys):
    import matplotlib.image

    path = write(tmp_path / "ledger.jsonl", faulty_run())
    out = tmp_path / "report.png"
    assert main([str(path), "--plot", str(out)]) == 0
    assert f"figure        {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(out)
    assert img.shape[:2] == (660, 960)  # 8 x 5.5 inches at 120 dpi
    # Not blank: the curves and markers put many distinct colours on the canvas.
    assert len({tuple(px) for px in img.reshape(-1, img.shape[2])[::97]}) > 20
    with pytest.raises(ReportError, match=r"cannot write the figure .*; pass a writable --plot path"):
        plot_report(load_ledger(path), tmp_path / "no" / "such" / "dir" / "f.png")


# ---------------------------------------------------------------------------------------
# the installed command


def test_cli_subprocess(tmp_path: Path):
    path = write(tmp_path / "ledger.jsonl", faulty_run())
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ok = subprocess.run(
        [sys.executable, "-m", "lightning_recover.cli", "report", str(path), "--json"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["mttr_s"] == 0.5
    missing = subprocess.run(
        [sys.executable, "-m", "lightning_recover.cli", "report", str(tmp_path / "nope.jsonl")],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=60,
    )
    assert missing.returncode == 2
    assert missing.stderr.startswith("lightning-recover report: no ledger at ")
    assert "the file does not exist" in missing.stderr
    # The pure layer stays pure: the command ran without importing torch or MPI.
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, lightning_recover.audit.report; "
         "print(','.join(m for m in ('torch', 'mpi4py', 'matplotlib') if m in sys.modules))"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=60, check=True,
    )
    assert probe.stdout.strip() == ""
