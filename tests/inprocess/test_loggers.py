"""Logs across a change of leader, in one process: metrics.csv merges, the journal, the takeover.

The launched end-to-end check (a leader SIGKILLed mid-run) is tests/launched/test_leader_logs_mpi.py;
here two logger instances play the old and the new leader, with Lightning's rank-zero gate
set to the rank that is calling.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_recover.callbacks.loggers import (
    ContinuingWriter,
    LeaderCSVLogger,
    LeaderLogs,
    append_metrics_csv,
    read_metrics_csv,
)


@contextmanager
def as_rank(rank: int) -> Iterator[None]:
    """Lightning's rank-zero gate as the given global rank sees it."""
    before = rank_zero_only.rank
    rank_zero_only.rank = rank
    try:
        yield
    finally:
        rank_zero_only.rank = before


def rows_of(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def test_new_keys_rewrite_the_file_with_the_union_header_keeping_every_row(tmp_path: Path) -> None:
    path = str(tmp_path / "metrics.csv")
    header = append_metrics_csv(path, [{"loss": 1.5, "step": 0}])
    header = append_metrics_csv(path, [{"loss": 1.25, "step": 1}], header)
    header = append_metrics_csv(path, [{"loss": 1.0, "late": 7.0, "step": 2}], header)
    assert header == ["late", "loss", "step"]
    assert rows_of(tmp_path / "metrics.csv") == (
        ["late", "loss", "step"],
        [
            {"late": "", "loss": "1.5", "step": "0"},
            {"late": "", "loss": "1.25", "step": "1"},
            {"late": "7.0", "loss": "1.0", "step": "2"},
        ],
    )
    # A caller with a stale (shorter) header still merges instead of failing.
    append_metrics_csv(path, [{"other": 1.0, "step": 3}], ["loss", "step"])
    header, rows = rows_of(tmp_path / "metrics.csv")
    assert header == ["late", "loss", "other", "step"]
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"] and rows[2]["late"] == "7.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]  # no temporary file left


def test_a_row_cut_short_by_a_killed_writer_is_dropped_and_the_file_continues(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("loss,step\n1.5,0\n1.25,1\n1.0,")  # the old leader died writing row 2
    header, rows, cut = read_metrics_csv(str(path))
    assert (header, [r["step"] for r in rows], cut) == (["loss", "step"], ["0", "1"], True)
    writer = ContinuingWriter(str(tmp_path))
    assert writer.rows_on_disk == 2
    writer.log_metrics({"loss": 1.0}, 2)
    writer.save()
    assert [r["step"] for r in rows_of(path)[1]] == ["0", "1", "2"]
    assert writer.rows_on_disk == 3


def test_leader_csv_logger_successor_with_a_new_key_continues_instead_of_crashing(tmp_path: Path) -> None:
    old = LeaderCSVLogger(tmp_path, name="logs", version=0)
    for step in range(2):
        old.log_metrics({"loss": 2.0 - step}, step)
    # The new leader's logger: same version, first row brings a key the file's header lacks.
    new = LeaderCSVLogger(tmp_path, name="logs", version=0)
    new.log_metrics({"loss": 0.5, "late": 3.0}, 2)
    new.save()
    header, rows = rows_of(tmp_path / "logs" / "version_0" / "metrics.csv")
    assert header == ["late", "loss", "step"]
    assert [(r["step"], r["loss"], r["late"]) for r in rows] == [("0", "2.0", ""), ("1", "1.0", ""), ("2", "0.5", "3.0")]


class ListLogger(Logger):
    """A logger keeping its rows in memory (rank-zero gated like every Lightning logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[dict[str, Any], int | None]] = []
        self.saves = 0

    @property
    def name(self) -> str:
        return "list"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.rows.append((dict(metrics), step))

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def save(self) -> None:
        self.saves += 1


class Rank:
    """One rank's loggers (a stock CSVLogger and another logger) and its LeaderLogs."""

    def __init__(self, root: Path, rank: int) -> None:
        self.rank = rank
        self.csv = CSVLogger(root, name="logs", version=0)
        self.other = ListLogger()
        self.logs = LeaderLogs()
        with as_rank(rank):
            counts = self.logs.adopt([self.csv, self.other], is_leader=rank == 0)
        self.counts = counts

    def log(self, metrics: dict[str, float], step: int) -> None:
        """What Lightning's logger connector does on this rank after a step."""
        with as_rank(self.rank):
            for lg in (self.csv, self.other):
                lg.log_metrics(metrics=metrics, step=step)
                lg.save()

    def committed(self) -> None:
        self.logs.on_step_committed(None, None, {}, None)  # type: ignore[arg-type]  (LeaderLogs runs no collective)


def test_stock_csv_logger_keeps_every_row_across_a_leader_death_and_merges_a_late_key(tmp_path: Path) -> None:
    leader, successor = Rank(tmp_path, 0), Rank(tmp_path, 1)
    assert leader.counts == [0, 0]
    successor.logs.set_bases(leader.counts)
    ranks = (leader, successor)
    for step in range(2):  # commit step, then each rank logs that step's row
        for r in ranks:
            r.committed()
            r.log({"step_loss": 3.0 - step}, step)
    # Step 2: the leader dies after the step's reduction was agreed and before it logs; the
    # survivor commits step 2 and logs its row (gated: not written), then repairs in step 3.
    successor.committed()
    successor.log({"step_loss": 1.0}, 2)
    successor.rank = 0
    with as_rank(0):
        successor.logs.leadership(True)
    successor.log({"step_loss": 0.5, "late": 9.0}, 3)
    header, rows = rows_of(tmp_path / "logs" / "version_0" / "metrics.csv")
    assert header == ["late", "step", "step_loss"]
    assert [(r["step"], r["step_loss"], r["late"]) for r in rows] == [
        ("0", "3.0", ""), ("1", "2.0", ""), ("2", "1.0", ""), ("3", "0.5", "9.0"),
    ]
    # The other logger cannot be read back: the successor logs again what the leader may have missed.
    assert [s for _, s in successor.other.rows] == [2, 3]
    assert [s for _, s in leader.other.rows] == [0, 1]


def test_successor_adds_no_duplicate_when_the_dead_leader_had_written_its_last_row(tmp_path: Path) -> None:
    leader, successor = Rank(tmp_path, 0), Rank(tmp_path, 1)
    successor.logs.set_bases(leader.counts)
    for step in range(3):
        for r in (leader, successor):
            r.committed()
            r.log({"step_loss": float(step)}, step)
    # The leader dies in step 3's backward, after it wrote row 2.
    successor.rank = 0
    with as_rank(0):
        successor.logs.leadership(True)
    successor.committed()  # step 3 commits after the repair
    successor.log({"step_loss": 3.0}, 3)
    _, rows = rows_of(tmp_path / "logs" / "version_0" / "metrics.csv")
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]


def test_journal_is_trimmed_only_at_commits_without_a_repair(tmp_path: Path) -> None:
    rank = Rank(tmp_path, 1)
    rank.log({"a": 1.0}, 0)
    rank.committed()
    assert [len(j.entries) for j in rank.logs.journals] == [0, 0]
    rank.log({"a": 2.0}, 1)
    with as_rank(1):
        rank.logs.leadership(False)  # another replica died; this rank is still not the leader
    rank.committed()  # the step that saw the repair: the leader may be new, keep the rows
    assert [len(j.entries) for j in rank.logs.journals] == [1, 1]
    rank.committed()
    assert [(j.base, len(j.entries)) for j in rank.logs.journals] == [(2, 0), (2, 0)]


@pytest.mark.parametrize("existing_rows", [0, 2])
def test_leader_adopting_a_csv_logger_reports_the_rows_its_file_holds(tmp_path: Path, existing_rows: int) -> None:
    lg = CSVLogger(tmp_path, name="logs", version=0)
    for step in range(existing_rows):  # the user logged before fit: the writer exists already
        lg.log_metrics({"x": 1.0}, step)
    assert LeaderLogs().adopt([lg], is_leader=True) == [existing_rows]
    assert isinstance(lg.experiment, ContinuingWriter)
