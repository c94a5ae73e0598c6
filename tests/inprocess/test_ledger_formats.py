"""The compact ledger line: small whatever W and B, and the same meaning as the full line it replaced.

``tests/data/ledger_before_compact.jsonl`` was written by the code of d097eaf (full lines:
every id, replica and role) for a 4-replica run with a spare, a loss the spare absorbs, a
replayed loss and a re-join. The same run with today's policy must resolve to the very same
ids, replicas and roles, and both files must pass check-ledger and report.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_recover.audit.ledger import LedgerFormatError, microbatch_ids, read_ledger
from lightning_recover.audit.ledger_check import check_ledger
from lightning_recover.audit.report import report_from_path
from lightning_recover.workload.static_world import StaticWorld

from harness.ledgers import FIXTURE, write_fixture_run

OLD = FIXTURE
MEANING = ("step", "B", "committed", "replicas", "roles", "faults", "extra_microbatches", "G_cur", "joined")


def test_a_ledger_written_before_the_compact_format_still_checks_and_reports() -> None:
    verdict = check_ledger(OLD)
    assert verdict.ok and verdict.steps == 10 and verdict.joins == 1, verdict.problems
    assert report_from_path(OLD).faults == 2


def test_compact_lines_mean_what_the_full_lines_meant(tmp_path: Path) -> None:
    new = tmp_path / "ledger.jsonl"
    write_fixture_run(new)
    old_lines, new_lines = read_ledger(OLD), read_ledger(new)
    for before, now in zip(old_lines, new_lines, strict=True):
        assert {k: now[k] for k in MEANING} == {k: before[k] for k in MEANING}, now["step"]
        assert microbatch_ids(now) == before["microbatch_ids"]
    raw = read_ledger(new, raw=True)
    # The membership is written once per change: at the start, after each loss, at the join and after it.
    assert [r["step"] for r in raw if "members" in r] == [0, 4, 7, 8, 9]
    assert all("microbatch_ids" not in r and "replicas" not in r for r in raw)
    assert check_ledger(new, reference=OLD).ok
    assert report_from_path(new).faults == report_from_path(OLD).faults


def test_a_steady_line_stays_under_a_kilobyte_at_32k_replicas() -> None:
    pol = StaticWorld(32_768, 8)  # B = 262,144
    alive = tuple(range(32_768))
    pol.begin_step(0, alive)
    first = json.dumps(pol.commit().as_dict())
    pol.begin_step(1, alive)
    steady = json.dumps(pol.commit().as_dict())
    assert len(steady) < 1024 and len(first) < 1024, (len(steady), len(first))
    pol.begin_step(2, alive)
    pol.fail([100, 20_000])
    faulty = pol.commit().as_dict()
    assert faulty["died"] == [100, 20_000] and len(json.dumps(faulty)) < 1024


def corrupt(tmp_path: Path, mutate) -> str:  # type: ignore[no-untyped-def]
    src = tmp_path / "good.jsonl"
    write_fixture_run(src)
    lines = read_ledger(src, raw=True)
    mutate(lines)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in lines))
    verdict = check_ledger(bad)
    assert not verdict.ok
    return verdict.summary_line()


def test_check_ledger_finds_an_id_applied_twice_in_a_compact_line(tmp_path: Path) -> None:
    def twice(lines: list[dict]) -> None:  # type: ignore[type-arg]
        lines[2]["ids"] = [[12, 16], [15, 18]]

    assert "first bad step 2" in corrupt(tmp_path, twice) and "overlap" in corrupt(tmp_path, twice)


def test_check_ledger_finds_missing_ids_in_a_compact_line(tmp_path: Path) -> None:
    def missing(lines: list[dict]) -> None:  # type: ignore[type-arg]
        lines[5]["ids"] = [[30, 35]]

    assert "first bad step 5: missing microbatch ids: 1 of the step's 6" in corrupt(tmp_path, missing)


def test_check_ledger_finds_a_line_that_refers_to_a_membership_no_line_holds(tmp_path: Path) -> None:
    def cut(lines: list[dict]) -> None:  # type: ignore[type-arg]
        del lines[4]["members"]  # step 5 and later refer to step 4's membership

    line = corrupt(tmp_path, cut)
    assert "first bad step 4" in line and "no earlier line holds" in line
    with pytest.raises(LedgerFormatError, match="no earlier line holds"):
        bad = tmp_path / "bad.jsonl"
        read_ledger(bad)


def test_a_torn_tail_of_a_compact_ledger_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "ledger.jsonl"
    write_fixture_run(path)
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[3][:40])
    assert [r["step"] for r in read_ledger(path, torn_tail=True)] == list(range(10))
    assert read_ledger(path, torn_tail=True)[-1]["replicas"] == [0, 2, 3]


def precision_pair(tmp_path: Path, precision: str | None, rel: float) -> tuple[Path, Path]:
    """A run's ledger and a reference whose losses differ by ``rel`` (relative) in one step."""
    run, ref = tmp_path / f"run-{precision}.jsonl", tmp_path / "ref.jsonl"
    write_fixture_run(run)
    lines = read_ledger(run, raw=True)
    ref.write_text("".join(json.dumps({"step": r["step"], "loss": r["loss"]}) + "\n" for r in lines))
    for r in lines:
        if precision is not None:
            r["precision"] = precision
    lines[5]["loss"] *= 1 + rel
    run.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return run, ref


def test_check_ledger_fits_its_tolerance_to_the_precision_the_ledger_records(tmp_path: Path) -> None:
    run, ref = precision_pair(tmp_path, "bf16-mixed", 3e-3)
    verdict = check_ledger(run, reference=ref)
    assert verdict.ok and verdict.summary_line().endswith("within rtol=0.01 (for bf16-mixed precision)"), verdict.summary_line()
    # The same difference in an fp32 run is a problem, and so is one past bf16's tolerance.
    run32, ref = precision_pair(tmp_path, "32-true", 3e-3)
    assert not check_ledger(run32, reference=ref).ok
    assert not check_ledger(*precision_pair(tmp_path, "bf16-mixed", 3e-2)).ok
    # An explicit --rtol wins and is named; a ledger without precision keeps fp32's 1e-4.
    assert check_ledger(run32, reference=ref, rtol=1e-2).summary_line().endswith("(--rtol)")
    old, ref = precision_pair(tmp_path, None, 0.0)
    assert check_ledger(old, reference=ref).summary_line().endswith(
        "within rtol=0.0001 (the default for fp32; the ledger records no precision)")
