"""What a user's console shows (issue 34, point 4): the launcher's NBC filter, Lightning's rank-zero
messages and the warnings the strategy itself would cause.

The launched side (a run with a kill: no ``NBC_`` line, one banner) is
``tests/launched/test_user_epoch_mpi.py``; here each piece is held to its contract on its own.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from lightning_recover.cli.console import ConsoleFilter, summary

# What Open MPI 5.0.11's libnbc printed on the survivors of a SIGKILL (seen in a launched run).
NBC = [
    b"NBC_Progress: an error 75 was found during schedule 0x565328f24850 at row-offset 0 - aborting the schedule\n",
    b"\n",
    b"Error in NBC_Start_round() (-1)\n",
    b"NBC_Progress: an error 77 was found during schedule 0x55abc4f77fd0 at row-offset 0 - aborting the schedule\n",
    b"\n",
]


def run(chunks: list[bytes]) -> tuple[bytes, int]:
    f = ConsoleFilter()
    out = b"".join(f.feed(c) for c in chunks) + f.flush()
    return out, f.dropped


def test_nbc_lines_and_their_empty_trailer_are_left_out_and_counted() -> None:
    text = [b"step 1: peer failure\n", *NBC, b"[lightning-recover] world epoch 1: lost replica(s) [1]\n", b"\n", b"after\n"]
    out, dropped = run(text)
    assert out == b"step 1: peer failure\n[lightning-recover] world epoch 1: lost replica(s) [1]\n\nafter\n"
    assert dropped == 3


@pytest.mark.parametrize("size", [1, 3, 7, 64])
def test_any_split_of_the_stream_gives_the_same_console(size: int) -> None:
    data = b"".join([b"before\n", *NBC, b"a progress bar\r", b"50%\r", b"100%\n", b"NBC is a word here\n", b"tail"])
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    out, dropped = run(chunks)
    assert out == b"before\na progress bar\r50%\r100%\nNBC is a word here\ntail"
    assert dropped == 3


def test_a_partial_line_that_is_no_nbc_line_passes_at_once() -> None:
    f = ConsoleFilter()
    assert f.feed(b"Epoch 0: 50%\r") == b"Epoch 0: 50%\r"  # a progress bar is not held back
    assert f.feed(b"100%\n") == b"100%\n"
    assert f.feed(b"NBC_Pro") == b""  # could still become one: held until its end
    assert f.feed(b"gress: an error 75 was found during schedule 0x1 at row-offset 0 - aborting the schedule\n") == b""
    assert f.dropped == 1


def test_summary() -> None:
    assert summary(0) is None
    line = summary(4)
    assert line is not None and line.startswith("left out 4 line(s) of Open MPI's internal NBC errors")


def test_quiet_console_sets_lightnings_rank_and_drops_the_srun_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from lightning_recover.strategies.trainer_setup import quiet_console

    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    for var in ("SLURM_NTASKS", "SLURM_JOB_NAME"):
        monkeypatch.delenv(var, raising=False)
    previous = rank_zero_only.rank
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        SLURMEnvironment.detect()
        assert any("srun" in str(w.message) for w in seen), "the advice this test removes must exist"
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            quiet_console(0)
            SLURMEnvironment.detect()
        assert not [w for w in seen if "srun" in str(w.message)]
        quiet_console(3)
        assert rank_zero_only.rank == fabric_rank_zero_only.rank == 3
    finally:
        rank_zero_only.rank = fabric_rank_zero_only.rank = previous


def test_only_a_directory_holding_nothing_but_the_fence_is_quiet(tmp_path: Path) -> None:
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    from lightning_recover.audit.fence import FENCE_NAME
    from lightning_recover.config import RecoverConfig
    from lightning_recover.strategies.trainer_setup import quiet_fence_warnings

    fenced, used = tmp_path / "fenced", tmp_path / "used"
    for d in (fenced, used):
        d.mkdir()
        (d / FENCE_NAME).write_text('{"job": "j", "epoch": 0}')
    (used / "epoch=0.ckpt").write_text("an earlier run's")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_fence_warnings(RecoverConfig(ledger_path=str(fenced / "ledger.jsonl"), checkpoint={"dir": str(used)}))
        for d in (fenced, used):
            rank_zero_warn(f"Checkpoint directory {os.path.realpath(d)} exists and is not empty.")
    assert [str(w.message) for w in seen] == [f"Checkpoint directory {os.path.realpath(used)} exists and is not empty."]


def test_the_engines_peer_failure_warning_comes_from_rank_zero_only() -> None:
    import logging

    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from lightning_recover.comm.interface import PeerFailure
    from lightning_recover.strategies.trainer_setup import quiet_console

    log = logging.getLogger("lightning_recover.recovery.engine")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, previous = Keep(), rank_zero_only.rank
    log.addHandler(handler)
    try:
        for rank in (1, 0):
            quiet_console(rank)
            log.warning("step %d: %s", 3, PeerFailure((2,), "reduce of bucket 0/1"))
            log.warning("step %d: %d gradient tensor(s) were replaced", 3, 1)
    finally:
        log.removeHandler(handler)
        rank_zero_only.rank = previous
    assert [r.getMessage() for r in records] == [
        "step 3: 1 gradient tensor(s) were replaced",
        "step 3: peer failure during reduce of bucket 0/1; ranks known dead: [2]",
        "step 3: 1 gradient tensor(s) were replaced",
    ]
