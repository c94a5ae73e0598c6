"""Loggers that survive a change of leader.

Only the current leader (global rank 0) logs, and the leader's replica can be the one that
dies; after a repair the lowest surviving rank takes over. Lightning's CSV writer deletes
an existing ``metrics.csv`` when it is created -- the moment a new leader logs its first
row -- and buffers rows in memory, which die with the old leader. :class:`LeaderCSVLogger`
writes every step and lets a successor continue the same file.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from typing_extensions import override


class ContinuingWriter(ExperimentWriter):
    """An ExperimentWriter that keeps the rows an earlier leader wrote."""

    # Private Lightning API: the writer's only way to keep an existing metrics.csv is to
    # skip this check (Lightning 2.6 offers no option); revisit on upgrades.
    @override
    def _check_log_dir_exists(self) -> None:
        pass


class LeaderCSVLogger(CSVLogger):
    """CSVLogger for fault-tolerant runs: flushed every step, continued by a new leader."""

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
