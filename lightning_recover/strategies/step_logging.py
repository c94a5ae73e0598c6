"""Lightning's logging through the recovery protocol's steps: what the strategy does around ``self.log``.

The strategy runs a step's microbatches one by one inside one Lightning batch, and the
world's membership changes under Lightning; :class:`StepLogging` keeps Lightning's logging
consistent with both:

* each microbatch logs as one batch of the epoch (:meth:`StepLogging.as_batch`);
* what a microbatch logs with ``sync_dist=True`` is captured for the commit's reduction
  and written back once the step committed (:class:`~.synced_logs.SyncedLogs`: :meth:`begin_step`,
  :meth:`start`, :meth:`capture`, :meth:`apply`), and so is what it adds to the states of the
  module's torchmetrics (:class:`~.step_metrics.StepMetrics`);
* the committed step's own values (loss, live replicas, world epoch, faults) are logged
  (:meth:`log_committed`);
* every rank agrees on the loggers' versions and keeps what the leader logs, so a new
  leader continues the same run directory (:meth:`sync_logger_versions`,
  :class:`~lightning_recover.callbacks.loggers.LeaderLogs`), and a change of membership moves the
  leadership and rescales the summed epoch totals (:meth:`on_membership`).

Private Lightning members are reached only through :mod:`lightning_recover._lightning`
(and :mod:`.synced_logs`, listed there).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch import LightningModule, Trainer

from lightning_recover import _lightning
from lightning_recover.callbacks.loggers import LeaderLogs
from lightning_recover.recovery.engine import StepEngine
from lightning_recover.recovery.step_values import Values
from lightning_recover.strategies.synced_logs import SyncedLogs
from lightning_recover.strategies.step_metrics import StepMetrics

__all__ = ["StepLogging"]


class StepLogging:
    """The strategy's logging state for one job; ``module()`` is the LightningModule (None before setup)."""

    def __init__(self, module: Callable[[], LightningModule | None], is_leader: Callable[[], bool] = lambda: True) -> None:
        self._module = module
        self._is_leader = is_leader
        self._synced_logs = SyncedLogs()
        self._metrics = StepMetrics()
        self._bases: dict[str, tuple[float, float]] = {}
        #: The step-local id of the microbatch running (its logged values are recorded under it).
        self.offset = 0
        #: Every rank's copy of what the leader logs (:mod:`lightning_recover.callbacks.loggers`); None while no successor can exist.
        self.leader_logs: LeaderLogs | None = None

    def _results(self) -> Any:
        return _lightning.fit_results(self._module())

    def begin_step(self) -> None:
        """A step begins: the epoch totals it starts from (logged values and torchmetrics states)."""
        self._bases = self._synced_logs.begin_step(self._results())
        self._metrics.begin_step(self._module())

    def start(self) -> None:
        """A microbatch begins."""
        self._synced_logs.start(self._results())
        self._metrics.start(self._module())

    def capture(self, engine: StepEngine) -> None:
        """What the microbatch just computed logged with sync_dist, and added to torchmetrics states, for the commit's reduction."""
        engine.record_logged(self.offset, {**self._synced_logs.capture(self._results()), **self._metrics.capture(self._module())})

    def apply(self, totals: dict[str, Values], world_size: int) -> None:
        """The step committed: its reduced values go back into Lightning's results and the metrics' states."""
        self._synced_logs.apply(self._results(), totals, self._bases, world_size)
        self._metrics.apply(self._module(), totals, leader=self._is_leader())

    @contextmanager
    def as_batch(self, batch: Any, first: bool) -> Iterator[None]:
        """``self.log`` in this microbatch's ``training_step`` counts it as Lightning counts one batch.

        With ``accumulate_grad_batches`` Lightning reads each batch's size from the batch it
        passed to ``training_step`` (here a :class:`StepTicket`), files values under the hook
        running (``optimizer_step`` for our later microbatches, whose epoch means would then
        replace the first's), and while in an epoch's first batch resets a hook's values
        whenever another hook logged since (``training_step`` and ``on_after_backward``
        alternate between our microbatches). All three live in the loop's private state
        (``trainer._results``, ``_current_fx_name``, the logger connector's
        ``_first_loop_iter``), which no public API sets; the epoch value so covers every
        microbatch, means weighted by their size.
        """
        module = self._module()
        results = _lightning.fit_results(module)
        if module is None or results is None:
            yield
            return
        results.batch, results.batch_size = batch, None
        with _lightning.logging_as_training_step(module, first):
            yield

    def log_committed(self, record: dict[str, Any], *, live_replicas: int, world_epoch: int, faults: int) -> None:
        """The committed step's values, on the progress bar and to the leader's loggers.

        Every rank logs them, although only the leader's reach a logger: each rank keeps a
        copy of what the leader logs (:class:`~lightning_recover.callbacks.loggers.LeaderLogs`),
        so that a leader killed after a commit and before its log call leaves that step's row
        to its successor (``tests/launched/test_leader_logs_mpi.py``).

        The membership values (live replicas, world epoch, faults) change only at a repair or
        a join, and Lightning's ``self.log`` costs ~0.5 ms a call (a walk over the result's
        attributes): they are logged when they changed, when the run's callback metrics lack
        them (a new fit) and at every step whose values reach the loggers, so every logger row
        and every reader of ``trainer.callback_metrics`` or the progress bar (which keep the
        last value logged) sees exactly what logging them at every step would show."""
        lm = self._module()
        if lm is None:
            return
        lm.log("step_loss", record["loss"], prog_bar=True, on_step=True, rank_zero_only=True)
        membership = {"live_replicas": float(live_replicas), "world_epoch": float(world_epoch), "faults": float(faults)}
        shown = lm.trainer.callback_metrics
        if _lightning.loggers_write_this_step(lm.trainer) or any(
            key not in shown or float(shown[key]) != value for key, value in membership.items()
        ):
            for key, value in membership.items():
                lm.log(key, value, prog_bar=True, on_step=True, rank_zero_only=True)

    def sync_logger_versions(
        self, trainer: Trainer, *, rank: Callable[[], int], broadcast: Callable[[Any, int], Any], live_replicas: Callable[[], int],
    ) -> None:
        """All ranks agree on the loggers' version so a new leader writes into the same run directory,
        and keep what the leader logs so a new leader finishes and continues its logs (:class:`LeaderLogs`).

        ``rank()`` is read at each use: a leader's death inside a broadcast moves rank zero."""
        for lg in trainer.loggers:
            if _lightning.keeps_version(lg):
                version = lg.version if rank() == 0 else None
                _lightning.set_logger_version(lg, broadcast(version, 0))
        if live_replicas() < 2 or not trainer.loggers:
            return
        if self.leader_logs is None:
            self.leader_logs = LeaderLogs()
        if self.leader_logs not in trainer.callbacks:
            # Its on_step_committed recovery hook is called on trainer.callbacks (HookCalls).
            trainer.callbacks.append(self.leader_logs)
        leader = rank() == 0
        counts = self.leader_logs.adopt(trainer.loggers, is_leader=leader)
        if counts:  # the same loggers are new on every rank
            # A leader dying in this broadcast leaves the successor's None: its file was just started.
            self.leader_logs.set_bases(broadcast(counts if leader else None, 0) or [0] * len(counts))

    @staticmethod
    def take_logger_versions(trainer: Trainer, versions: list[Any]) -> None:
        """A replacement takes the versions the survivors agreed on at their start, so this rank's
        callbacks (ModelCheckpoint's directory) resolve the same paths."""
        for lg, version in zip(trainer.loggers, versions):
            if version is not None:
                _lightning.set_logger_version(lg, version)

    def handover(self) -> dict[str, Any]:
        """The epoch's committed totals (synced logged values, torchmetrics states) a replacement takes over."""
        return {"logs": self._synced_logs.totals(self._results()), "metrics": self._metrics.totals(self._module())}

    def take_over(self, totals: dict[str, Any]) -> None:
        """A replacement joins mid-epoch with the survivors' totals (:meth:`handover`), so the epoch's values stay
        the fault-free run's on every rank it may lead."""
        self._synced_logs.take_over(totals.get("logs", {}))
        self._metrics.take_over(self._module(), totals.get("metrics", {}), leader=self._is_leader())

    def on_membership(self, world_size: int, is_leader: bool) -> None:
        """The world changed (a repair or a join): the summed epoch totals and the leadership follow."""
        self._synced_logs.rescale(world_size)
        self._metrics.rehome(self._module(), leader=is_leader)
        if self.leader_logs is not None:
            self.leader_logs.leadership(is_leader)
