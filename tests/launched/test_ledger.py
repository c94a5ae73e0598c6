"""Tests of the step ledger writer and checker, and of the no-torch/no-MPI import rule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_recover.audit import ledger_writer as ledger_writer_module
from lightning_recover.audit.ledger import LEDGER_FIELDS, LedgerFormatError, read_ledger
from lightning_recover.audit.ledger_check import check_ledger, main
from lightning_recover.audit.ledger_writer import MAX_UNSYNCED_LINES, LeaderLedger, LedgerWriter
from lightning_recover.workload.static_world import StaticWorld

B = 8


def record(step: int, loss: float | None = None, **over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "step": step,
        "loss": 2.0 / (step + 1) if loss is None else loss,
        "B": B,
        "committed": B,
        "microbatch_ids": list(range(step * B, step * B + B)),
        "replicas": [0, 1, 2, 3],
        "world_epoch": 0,
        "roles": {"0": "major", "1": "major", "2": "major", "3": "major"},
        "faults": [],
        "extra_microbatches": 0,
        "step_time_s": 0.1,
        "recovery_s": 0.0,
        "policy": "static",
    }
    rec.update(over)
    return rec


def write(path: Path, records: list[dict[str, Any]]) -> Path:
    with LedgerWriter(path) as w:
        for r in records:
            w.write(r)
    return path


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write(tmp_path / "good.jsonl", [record(t) for t in range(20)])


# ---------------------------------------------------------------------------------------
# writer


def test_writer_round_trip_and_append(tmp_path: Path):
    path = tmp_path / "deep" / "dir" / "ledger.jsonl"
    write(path, [record(0), record(1)])
    with LedgerWriter(path, append=True) as w:
        w.write(record(2))
    recs = read_ledger(path)
    assert [r["step"] for r in recs] == [0, 1, 2]
    assert recs[1] == json.loads(json.dumps(record(1)))
    assert path.read_text().count("\n") == 3 and path.read_text().endswith("\n")
    write(path, [record(0)])  # append=False starts afresh
    assert len(read_ledger(path)) == 1


def test_writer_requires_all_fields(tmp_path: Path):
    rec = record(0)
    del rec["loss"], rec["recovery_s"]
    with LedgerWriter(tmp_path / "l.jsonl") as w:
        with pytest.raises(ValueError, match=r"missing fields \['loss', 'recovery_s'\]"):
            w.write(rec)


def test_writer_converts_sets_tuples_and_numpy(tmp_path: Path):
    import numpy as np

    rec = record(0, loss=np.float32(1.5), replicas=(0, 1), faults={3, 2}, world_epoch=np.int64(2))
    write(tmp_path / "l.jsonl", [rec])
    (got,) = read_ledger(tmp_path / "l.jsonl")
    assert got["loss"] == 1.5 and got["replicas"] == [0, 1] and got["faults"] == [2, 3]
    with LedgerWriter(tmp_path / "m.jsonl") as w:
        with pytest.raises(TypeError, match=r"fields \['world_epoch'\]"):
            w.write(record(0, world_epoch=object()))


def test_writer_unwritable_path_is_a_clear_error(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot open the step ledger for writing"):
        LedgerWriter(blocker / "ledger.jsonl")


def test_writer_closed(tmp_path: Path):
    w = LedgerWriter(tmp_path / "l.jsonl")
    w.close()
    w.close()
    assert w.closed
    with pytest.raises(ValueError, match="closed"):
        w.write(record(0))


class _Disk:
    """os.fsync stand-in: counts calls, can block them (a slow disk) or fail them (EIO)."""

    def __init__(self) -> None:
        import threading

        self.calls = 0
        self.open = threading.Event()
        self.open.set()
        self.fail = False

    def fsync(self, fd: int) -> None:
        assert self.open.wait(10), "test: fsync blocked for good"
        self.calls += 1
        if self.fail:
            raise OSError(5, "Input/output error")


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> _Disk:
    d = _Disk()
    monkeypatch.setattr(ledger_writer_module.os, "fsync", d.fsync)
    return d


def test_writer_lines_are_readable_at_once_and_durable_after_sync_and_close(tmp_path: Path, disk: _Disk):
    path = tmp_path / "l.jsonl"
    disk.open.clear()  # the disk is slow: no fsync completes yet
    w = LedgerWriter(path)
    for t in range(3):
        w.write(record(t))
    # Written to the kernel before the next step: a reader (and a killed writer's successor) sees every line.
    assert [r["step"] for r in read_ledger(path)] == [0, 1, 2]
    disk.open.set()
    w.sync()
    assert disk.calls >= 1
    calls = disk.calls
    w.sync()  # nothing new: no fsync
    assert disk.calls == calls
    w.write(record(3))
    w.close()  # close makes the last line durable before closing the descriptor
    assert disk.calls > calls and w.closed


def test_writer_waits_for_the_disk_once_too_many_lines_lag(tmp_path: Path, disk: _Disk):
    import threading

    disk.open.clear()
    w = LedgerWriter(tmp_path / "l.jsonl")
    done = threading.Event()

    def writer() -> None:
        for t in range(MAX_UNSYNCED_LINES + 2):
            w.write(record(t))
        done.set()

    th = threading.Thread(target=writer, daemon=True)
    th.start()
    assert not done.wait(0.5), f"more than MAX_UNSYNCED_LINES={MAX_UNSYNCED_LINES} lines went out with no fsync done"
    disk.open.set()
    assert done.wait(10)
    th.join()
    w.close()


def test_writer_fsync_error_is_raised_by_the_next_call(tmp_path: Path, disk: _Disk):
    disk.fail = True
    w = LedgerWriter(tmp_path / "l.jsonl")
    w.write(record(0))
    with pytest.raises(OSError, match="could not be made durable"):
        w.sync()
    with pytest.raises(OSError, match="could not be made durable"):
        w.close()
    assert w.closed


def test_writer_without_background_fsync_syncs_every_line(tmp_path: Path, disk: _Disk):
    with LedgerWriter(tmp_path / "l.jsonl", background_fsync=False) as w:
        w.write(record(0))
        assert disk.calls == 1
        w.write(record(1))
        assert disk.calls == 2


def test_leader_ledger_keeps_more_history_than_unsynced_lines(tmp_path: Path):
    with pytest.raises(ValueError, match="MAX_UNSYNCED_LINES"):
        LeaderLedger(tmp_path / "l.jsonl", history=MAX_UNSYNCED_LINES)


def test_resume_drops_a_torn_tail_with_the_redone_steps(tmp_path: Path):
    # An OS crash left lines 0-4 durable and the tail of line 5 torn (zeros, half a line);
    # the relaunch resumes from a checkpoint at step 3 and redoes steps 4.. .
    path = write(tmp_path / "l.jsonl", [record(t) for t in range(5)])
    with open(path, "ab") as f:
        f.write(json.dumps(record(5)).encode()[:40] + b"\x00" * 30)
    with pytest.raises(LedgerFormatError):
        read_ledger(path)
    assert [r["step"] for r in read_ledger(path, torn_tail=True)] == [0, 1, 2, 3, 4]
    led = LeaderLedger(path, resumed=True)
    led.record(record(4), is_leader=True)
    led.close()
    assert [r["step"] for r in read_ledger(path)] == [0, 1, 2, 3, 4]
    assert check_ledger(path).ok


def test_a_torn_line_before_a_good_one_is_still_an_error(tmp_path: Path):
    path = tmp_path / "l.jsonl"
    path.write_text(json.dumps(record(0)) + "\n" + '{"step": 1, "lo' + "\n" + json.dumps(record(2)) + "\n")
    with pytest.raises(LedgerFormatError, match=":2: not a JSON line"):
        read_ledger(path, torn_tail=True)


def test_policy_commit_record_makes_a_valid_ledger(tmp_path: Path):
    pol = StaticWorld(W_init=4, G_init=2)
    with LedgerWriter(tmp_path / "l.jsonl") as w:
        for step in range(4):
            pol.begin_step(step, pol.live)
            if step == 1:
                pol.fail([2])
            rec = pol.commit().as_dict()
            rec.update(loss=1.0, world_epoch=step, step_time_s=0.1, recovery_s=0.0)
            w.write(rec)
    verdict = check_ledger(tmp_path / "l.jsonl")
    assert verdict.ok, verdict.problems
    assert verdict.steps == 4 and verdict.B == 8


def test_policy_commit_records_with_rejoins_make_a_valid_ledger(tmp_path: Path):
    # Replica 2 is lost in step 1 and re-joins before step 3: the join's line lists it.
    pol = StaticWorld(W_init=4, G_init=2)
    with LedgerWriter(tmp_path / "l.jsonl") as w:
        for step in range(5):
            if step == 3:
                pol.join([2])
            pol.begin_step(step, pol.live)
            if step == 1:
                pol.fail([2])
            rec = pol.commit().as_dict()
            rec.update(loss=1.0, world_epoch=step, step_time_s=0.1, recovery_s=0.0)
            rec["joins"] = [{"replica": r, "transfer_s": 0.5, "pause_s": 0.25} for r in rec["joined"]]
            w.write(rec)
    lines = read_ledger(tmp_path / "l.jsonl")
    assert [line["joined"] for line in lines] == [[], [], [], [2], []]
    assert [line["replicas"] for line in lines][2:4] == [[0, 1, 3], [0, 1, 2, 3]]
    verdict = check_ledger(tmp_path / "l.jsonl")
    assert verdict.ok, verdict.problems
    assert verdict.joins == 1 and verdict.summary_line().endswith("policy static, 1 join")


def test_rejects_inconsistent_joins_and_keeps_exactly_once_on_join_steps(tmp_path: Path):
    recs = [record(t) for t in range(6)]
    recs[1].update(replicas=[0, 1, 3], faults=[2])
    recs[2].update(replicas=[0, 1, 3])
    recs[3].update(joined=[2], joins=[{"replica": 2, "transfer_s": 1.5, "pause_s": None, "spawned": 1}])
    assert check_ledger(write(tmp_path / "ok.jsonl", recs)).ok
    bad = [dict(r) for r in recs]
    bad[3] = dict(bad[3], microbatch_ids=bad[3]["microbatch_ids"][:-1] + [bad[3]["microbatch_ids"][0]])
    bad[4] = dict(bad[4], joined=[1])  # replica 1 was live in step 3 and is no fault of step 4
    bad[5] = dict(bad[5], replicas=[0, 1, 2], faults=[], joined=[3], joins=[{"replica": 0, "transfer_s": -1, "spawned": -2}])
    v = check_ledger(write(tmp_path / "bad.jsonl", bad))
    assert not v.ok and v.first_bad_step == 3
    assert v.problems == [
        "step 3: duplicated microbatch ids [24]",
        "step 3: missing microbatch ids [31]",
        "step 4: joined replicas [1] were live in step 3 and are not among this step's faults "
        "(a joiner takes a lost replica's index)",
        "step 5: joined replicas [3] neither committed the step nor are among its faults",
        "step 5: joined replicas [3] were live in step 4 and are not among this step's faults "
        "(a joiner takes a lost replica's index)",
        "step 5: joins are for replicas [0] but joined is [3]",
        "step 5: join of replica 0: transfer_s must be seconds >= 0 or null, got -1",
        "step 5: join of replica 0: spawned must be a process count >= 0, got -2",
    ]
    v = check_ledger(write(tmp_path / "bad2.jsonl", [record(0, joined="2")]))
    assert v.problems == ["step 0: joined must be a list of replica indices, got '2'"]


# ---------------------------------------------------------------------------------------
# checker


def test_accepts_a_correct_ledger(good: Path):
    v = check_ledger(good)
    assert v.ok and v.steps == 20 and v.first_bad_step is None and v.problems == []
    assert v.summary_line().startswith("ledger OK: 20 steps, B=8")
    v = check_ledger(good, reference=good)
    assert v.ok and "reference" in v.summary_line()


def test_rejects_missing_id(tmp_path: Path):
    recs = [record(t) for t in range(6)]
    recs[3]["microbatch_ids"].remove(27)
    recs[3]["committed"] = 7
    v = check_ledger(write(tmp_path / "l.jsonl", recs))
    assert not v.ok and v.first_bad_step == 3
    assert any("missing microbatch ids [27]" in p for p in v.problems)
    assert any("committed=7, expected B=8" in p for p in v.problems)


def test_rejects_duplicated_id(tmp_path: Path):
    recs = [record(t) for t in range(6)]
    recs[4]["microbatch_ids"][5] = 33  # 37 missing, 33 twice; committed still 8
    v = check_ledger(write(tmp_path / "l.jsonl", recs))
    assert not v.ok and v.first_bad_step == 4
    assert any("duplicated microbatch ids [33]" in p for p in v.problems)
    assert any("missing microbatch ids [37]" in p for p in v.problems)


def test_rejects_foreign_id(tmp_path: Path):
    recs = [record(t) for t in range(3)]
    recs[1]["microbatch_ids"][0] = 0  # id of step 0 applied again in step 1
    v = check_ledger(write(tmp_path / "l.jsonl", recs))
    assert v.first_bad_step == 1
    assert any("outside the step's range 8..15: [0]" in p for p in v.problems)


def test_rejects_wrong_B(tmp_path: Path):
    recs = [record(t) for t in range(5)]
    recs[2]["B"] = 7
    v = check_ledger(write(tmp_path / "l.jsonl", recs))
    assert not v.ok and v.first_bad_step == 2
    assert any("B=7, but the run's B is 8" in p for p in v.problems)


def test_rejects_committed_below_B_even_with_ids_that_match(tmp_path: Path):
    recs = [record(t) for t in range(3)]
    recs[1]["committed"] = 6
    v = check_ledger(write(tmp_path / "l.jsonl", recs))
    assert v.first_bad_step == 1 and any("committed=6" in p for p in v.problems)


def test_rejects_gaps_in_steps(tmp_path: Path):
    recs = [record(t) for t in (0, 1, 3, 4)]
    v = check_ledger(write(tmp_path / "l.jsonl", recs))
    assert v.first_bad_step == 3
    assert any("step 3 follows step 1" in p for p in v.problems)


def test_rejects_loss_drift_from_reference(tmp_path: Path, good: Path):
    recs = [record(t) for t in range(20)]
    recs[7]["loss"] *= 1 + 1e-3
    recs[9]["loss"] *= 1 + 1e-2
    v = check_ledger(write(tmp_path / "l.jsonl", recs), reference=good)
    assert not v.ok and v.first_bad_step == 7
    want = f"loss {recs[7]['loss']!r} differs from the reference {record(7)['loss']!r}"
    assert any(want in p for p in v.problems)
    assert any("2 of 20 compared steps differ" in p for p in v.problems)
    # Inside the tolerance: fine.
    recs = [record(t) for t in range(20)]
    recs[7]["loss"] *= 1 + 1e-6
    assert check_ledger(write(tmp_path / "m.jsonl", recs), reference=good).ok
    assert not check_ledger(write(tmp_path / "n.jsonl", recs), reference=good, rtol=1e-8).ok


def test_rejects_different_step_counts(tmp_path: Path, good: Path):
    short = write(tmp_path / "short.jsonl", [record(t) for t in range(15)])
    v = check_ledger(short, reference=good)
    assert not v.ok and v.first_bad_step == 15
    assert any("ledger has 15 steps, reference has 20" in p for p in v.problems)


def test_adaptive_ledger(tmp_path: Path):
    recs = [record(t, policy="adaptive") for t in range(3)]
    recs[1]["microbatch_ids"] = [8, 9, 12, 13, 14, 15]
    recs[1]["committed"] = 6
    path = write(tmp_path / "a.jsonl", recs)
    assert check_ledger(path).ok
    assert not check_ledger(path, policy="static").ok
    recs[2]["microbatch_ids"] = [16, 16, 17]
    recs[2]["committed"] = 3
    v = check_ledger(write(tmp_path / "b.jsonl", recs))
    assert v.first_bad_step == 2 and any("duplicated" in p for p in v.problems)


def test_unreadable_and_empty_ledgers(tmp_path: Path):
    v = check_ledger(tmp_path / "nope.jsonl")
    assert not v.ok and "cannot read ledger" in v.summary_line()
    (tmp_path / "empty.jsonl").write_text("")
    assert not check_ledger(tmp_path / "empty.jsonl").ok
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(record(0)) + "\n" + '{"step": 1, "lo')
    with pytest.raises(LedgerFormatError, match="bad.jsonl:2"):
        read_ledger(bad)
    assert "bad.jsonl:2" in check_ledger(bad).summary_line()


def test_missing_fields_in_a_line(tmp_path: Path):
    rec = record(0)
    del rec["world_epoch"]
    (tmp_path / "l.jsonl").write_text(json.dumps(rec) + "\n")
    v = check_ledger(tmp_path / "l.jsonl")
    assert v.first_bad_step == 0 and "missing fields ['world_epoch']" in v.summary_line()


# ---------------------------------------------------------------------------------------
# CLI


def test_main_ok(good: Path, capsys: pytest.CaptureFixture[str]):
    assert main([str(good), "--reference", str(good), "--rtol", "1e-6"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith("ledger OK: 20 steps, B=8")


def test_main_bad_prints_problems_then_verdict_last(tmp_path: Path, capsys):
    recs = [record(t) for t in range(40)]
    for t in range(5, 40):
        recs[t]["microbatch_ids"].pop()  # 35 bad steps, 2 problems each
    assert main([str(write(tmp_path / "l.jsonl", recs))]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("ledger BAD: first bad step 5: missing microbatch ids [47]")
    assert "... and 50 more problems" in lines[-2]
    assert len(lines) == 22 and lines[0].startswith("step 5:")


def test_main_loss_drift(tmp_path: Path, good: Path, capsys):
    recs = [record(t) for t in range(20)]
    recs[3]["loss"] = 9.0
    assert main([str(write(tmp_path / "l.jsonl", recs)), "--reference", str(good)]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("ledger BAD: first bad step 3: loss 9.0 differs from the reference 0.5")


def test_cli_subprocess(good: Path):
    """The installed entry point routes through cli.main when it exists; main() directly here."""
    out = subprocess.run(
        [sys.executable, "-m", "lightning_recover.audit.ledger_check", str(good)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("ledger OK")


# ---------------------------------------------------------------------------------------
# the pure-Python rule


def test_modules_import_neither_torch_nor_mpi():
    code = (
        "import sys\n"
        "import lightning_recover.workload.factory, lightning_recover.workload.planner, lightning_recover.audit.ledger\n"
        "import lightning_recover.audit.ledger_writer, lightning_recover.audit.ledger_check\n"
        "bad = [m for m in ('torch', 'torch.distributed', 'mpi4py') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, check=True
    )
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"


def test_ledger_fields_are_the_documented_ones():
    assert LEDGER_FIELDS == (
        "step", "loss", "B", "committed", "microbatch_ids", "replicas", "world_epoch",
        "roles", "faults", "extra_microbatches", "step_time_s", "recovery_s",
    )  # fmt: skip
