"""Logs that survive a change of leader: every committed step's metrics reach the run's log files.

Only the current leader (global rank 0) writes logs, and the leader's replica can be the one
that dies; after a repair the lowest surviving rank takes over. Stock Lightning loses rows
then: a new ``CSVLogger`` writer deletes ``metrics.csv`` when the new leader first logs, and
rows the old leader was asked to log after it died (a step committed by the survivors only)
were never written anywhere.

:class:`LeaderLogs` fixes both for the loggers the user passes, unchanged (the strategy
installs it): every rank keeps a :class:`LogJournal` of what each logger was asked to log
(Lightning runs the same logging code on every rank; only the write is rank-zero gated),
trimmed at each step the leader committed with the survivors (it wrote everything before
that step). On a change of leader the successor

- ``CSVLogger``: continues the same ``metrics.csv`` with a :class:`ContinuingWriter`, appends
  exactly the rows the file lacks, and merges header keys (the file is rewritten, atomically,
  with the union header whenever a row brings a key the header lacks, as Lightning's writer does);
- any other logger (``TensorBoardLogger``: the successor writes its own event file in the
  same run directory): logs the journal's rows again, so the last step before the death may
  appear twice, never zero times.

A successor's rows carry *its* values of rank-local metrics (``self.log`` without
``sync_dist``); the strategy's own ``step_loss`` is the committed value on every rank.
"""

from __future__ import annotations

import csv
import io
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning.fabric.loggers import CSVLogger as FabricCSVLogger
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.core.saving import load_hparams_from_yaml
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override

from lightning_recover.callbacks.base import RecoveryCallback
from lightning_recover.recovery.hooks import StepCollectives

MetricsRow = dict[str, Any]


# ---------------------------------------------------------------------- metrics.csv
def read_metrics_csv(path: str) -> tuple[list[str], list[dict[str, str]], bool]:
    """``(header, complete rows, cut)`` of a metrics CSV; ``([], [], False)`` if it does not exist.

    A writer killed mid-row leaves a last line without its newline: that line is not a row
    (``cut`` is True then)."""
    fs = get_filesystem(path)
    if not fs.isfile(path):
        return [], [], False
    with fs.open(path, "r", newline="") as f:
        text = f.read()
    cut = bool(text) and not text.endswith("\n")
    if cut:
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = list(reader)
    return list(reader.fieldnames or []), rows, cut


def write_metrics_csv(path: str, header: list[str], rows: Iterable[Mapping[str, Any]]) -> None:
    """Replace ``path`` by ``header`` and ``rows`` atomically: a writer killed meanwhile leaves the old file whole."""
    fs = get_filesystem(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with fs.open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    fs.mv(tmp, path)


def append_metrics_csv(path: str, rows: list[Mapping[str, Any]], header: list[str] | None = None) -> list[str]:
    """Append ``rows`` to the metrics CSV at ``path`` and return its header afterwards.

    ``header`` is the file's header if the caller knows it (read from the file otherwise).
    Rows with a key the header lacks make the file be rewritten with the sorted union of
    keys (Lightning's convention), keeping every earlier row; never an error."""
    if not rows:
        return list(header or read_metrics_csv(path)[0])
    keys = set().union(*rows)
    fs = get_filesystem(path)
    if not fs.isfile(path):
        header = sorted(keys)
        write_metrics_csv(path, header, rows)
        return header
    if header is None:
        header = read_metrics_csv(path)[0]
    if keys - set(header):
        old_header, old_rows, _ = read_metrics_csv(path)
        union = sorted(set(old_header) | set(header) | keys)
        write_metrics_csv(path, union, [*old_rows, *rows])
        return union
    with fs.open(path, "a", newline="") as f:
        csv.DictWriter(f, fieldnames=header).writerows(rows)
    return list(header)


class ContinuingWriter(ExperimentWriter):
    """Lightning's CSV ExperimentWriter made safe for a change of leader.

    ``fresh=False`` (a successor) keeps the rows already in ``metrics.csv``, drops a row the
    dead leader left half-written, and starts from the file's header and ``hparams.yaml``.
    ``fresh=True`` starts the file anew, as Lightning's writer does. Either way new header
    keys rewrite the file atomically with the union header. :attr:`rows_on_disk` counts the
    file's rows."""

    def __init__(self, log_dir: str, *, fresh: bool = False) -> None:
        self._fresh = fresh
        super().__init__(log_dir=log_dir)
        header, rows, cut = read_metrics_csv(self.metrics_file_path)
        if cut:
            write_metrics_csv(self.metrics_file_path, header, rows)
        self.metrics_keys = header
        self.rows_on_disk = len(rows)
        hparams_file = os.path.join(log_dir, self.NAME_HPARAMS_FILE)
        if not fresh and get_filesystem(hparams_file).isfile(hparams_file):
            # Later log_hparams calls rewrite the whole file from this dict: start from what is there.
            self.hparams = dict(load_hparams_from_yaml(hparams_file, use_omegaconf=False) or {})

    # Private Lightning API: the writer deletes an existing metrics.csv in this check and Lightning
    # 2.6 offers no option to keep it; a successor must keep it. Revisit on upgrades.
    @override
    def _check_log_dir_exists(self) -> None:
        if self._fresh:
            super()._check_log_dir_exists()

    @override
    def save(self) -> None:
        if not self.metrics:
            return
        rows, self.metrics = self.metrics, []
        self.metrics_keys = append_metrics_csv(self.metrics_file_path, rows, self.metrics_keys or None)
        self.rows_on_disk += len(rows)


class LeaderCSVLogger(CSVLogger):
    """A ``CSVLogger`` flushed every step whose writer continues an existing ``metrics.csv``.

    Kept for existing scripts: under ``ReCoVerHSDPStrategy`` the stock ``CSVLogger`` survives a
    change of leader just as well (:class:`LeaderLogs`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("flush_logs_every_n_steps", 1)
        super().__init__(*args, **kwargs)

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        # CSVLogger builds its writer inline here (private `_experiment`, `_fs`); overriding the
        # property is the only way to substitute ContinuingWriter in Lightning 2.6.
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuingWriter(log_dir=self.log_dir)
        return self._experiment


# ---------------------------------------------------------------------- journal
@dataclass
class LogJournal:
    """The ``log_metrics`` calls one logger received on this rank that may not be on the leader's disk.

    Held entry ``k`` has the run-wide index ``base + k``: the number of calls before it, which
    for a CSV logger is its row number in ``metrics.csv``."""

    base: int = 0
    entries: list[tuple[MetricsRow, int | None]] = field(default_factory=list)

    def record(self, metrics: Mapping[str, Any], step: int | None) -> None:
        self.entries.append((dict(metrics), step))

    def durable(self) -> None:
        """Everything recorded so far is on the leader's disk: forget it."""
        self.base += len(self.entries)
        self.entries = []

    def since(self, index: int) -> list[tuple[MetricsRow, int | None]]:
        """The entries from run-wide index ``index`` on (all held entries if ``index`` precedes them)."""
        return self.entries[max(0, index - self.base) :]


@dataclass
class _Adapted:
    logger: Logger
    log_metrics: Callable[..., Any]  # the logger's own (rank-zero gated) log_metrics
    journal: LogJournal


class LeaderLogs(RecoveryCallback):
    """Keeps every rank ready to finish and continue the leader's logs; see the module docstring.

    The strategy calls :meth:`adopt` in ``setup`` (all ranks, same logger order),
    :meth:`set_bases` with the leader's answer, and :meth:`leadership` after every repair."""

    def __init__(self) -> None:
        self._adapted: list[_Adapted] = []
        self._repaired = False
        self.is_leader = False

    @property
    def journals(self) -> list[LogJournal]:
        return [a.journal for a in self._adapted]

    def adopt(self, loggers: Iterable[Logger], is_leader: bool) -> list[int]:
        """Journal the loggers not adopted yet; returns, on the leader, each one's rows on disk.

        On the leader a CSV logger gets a :class:`ContinuingWriter` (atomic header merges)."""
        self.is_leader = is_leader
        known = {id(a.logger) for a in self._adapted}
        counts = []
        for lg in loggers:
            if id(lg) in known:
                continue
            adapted = _Adapted(lg, lg.log_metrics, LogJournal())
            # Lightning offers no hook that sees what a logger is given on ranks other than 0;
            # shadowing the instance's public log_metrics records it, then calls the original.
            lg.log_metrics = _journaling(adapted)  # type: ignore[method-assign]
            self._adapted.append(adapted)
            if is_leader and isinstance(lg, FabricCSVLogger):
                # A LeaderCSVLogger continues an existing file by design; a CSVLogger starts it anew.
                counts.append(_install_writer(lg, fresh=not isinstance(lg, LeaderCSVLogger)))
            else:
                counts.append(0)
        return counts

    def set_bases(self, counts: list[int]) -> None:
        """The leader's rows on disk for the loggers just adopted: where their journals start."""
        for adapted, count in zip(self._adapted[len(self._adapted) - len(counts) :], counts):
            adapted.journal.base = count

    def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any], collectives: StepCollectives) -> None:
        # With no repair since the last commit, the leader reduced this step with us, so it had
        # written everything it logged before the step: what we hold is on its disk.
        if not self._repaired:
            for journal in self.journals:
                journal.durable()
        self._repaired = False

    def leadership(self, is_leader: bool) -> None:
        """After a repair: if this rank just became the leader, finish and continue the logs."""
        self._repaired = True
        if is_leader and not self.is_leader:
            self.take_over()
        self.is_leader = is_leader

    def take_over(self) -> None:
        """Write what the dead leader may not have written, and continue its files."""
        for adapted in self._adapted:
            lg = adapted.logger
            try:
                if isinstance(lg, FabricCSVLogger):
                    missing = adapted.journal.since(_install_writer(lg, fresh=False))
                else:
                    missing = adapted.journal.entries
                for metrics, step in missing:
                    adapted.log_metrics(metrics, step)
                lg.save()
            except (OSError, ValueError, csv.Error) as exc:
                # Losing a log must not turn one failure into two: training goes on.
                warnings.warn(
                    f"lightning-recover: the new leader could not continue the logs of {type(lg).__name__} "
                    f"in {getattr(lg, 'log_dir', None)!r}: {exc!r}; check that directory is writable from this node",
                    stacklevel=2,
                )


def _journaling(adapted: _Adapted) -> Callable[..., Any]:
    def log_metrics(metrics: Mapping[str, Any], step: int | None = None) -> Any:
        adapted.journal.record(metrics, step)
        return adapted.log_metrics(metrics, step)

    return log_metrics


def _install_writer(lg: FabricCSVLogger, *, fresh: bool) -> int:
    """Give a CSV logger a :class:`ContinuingWriter`; returns the rows its file holds."""
    old = lg._experiment
    if old is not None:
        # A writer already started this run's file (the user logged before fit): keep its rows.
        lg.save()
        fresh = False
    writer = ContinuingWriter(lg.log_dir, fresh=fresh)
    if old is not None:
        writer.hparams = {**writer.hparams, **getattr(old, "hparams", {})}
    # Private Lightning API: CSVLogger keeps its writer in `_experiment` with no setter; it is
    # the only way to hand a leader a writer that continues the file.
    lg._experiment = writer
    return writer.rows_on_disk
