"""In-process checks of the commit-time sync of ``self.log(..., sync_dist=True)`` values.

:mod:`lightning_recover.strategies.synced_logs` against Lightning's own result collection
(no MPI): per-microbatch capture, the write-back of reduced totals, and the refusals the
docs/lightning.md promises; :mod:`lightning_recover.recovery.step_values` for the key check.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

from lightning_recover.config import ConfigurationError
from lightning_recover.recovery import step_values
from lightning_recover.strategies.synced_logs import SyncedLogs


def local(value: torch.Tensor, **_: object) -> torch.Tensor:
    return value  # what the strategy's reduce returns inside a step


def log(results: _ResultCollection, name: str, value: float, batch_size: int, reduce_fx: str = "mean") -> None:
    results.log("training_step", name, torch.tensor(value), on_step=True, on_epoch=True, sync_dist=True,
                sync_dist_fn=local, reduce_fx=reduce_fx, batch_size=batch_size)


def test_microbatches_are_captured_and_the_reduced_step_is_written_back() -> None:
    results, logs = _ResultCollection(training=True), SyncedLogs()
    bases = logs.begin_step(results)
    captured = []
    for value, size in [(1.0, 4), (3.0, 2)]:
        logs.start(results)
        log(results, "loss", value, size)
        log(results, "count", float(size), size, reduce_fx="sum")
        captured.append(logs.capture(results))
    assert captured[0]["training_step.loss"] == (1.0, 1.0, 4.0, 4.0)
    assert captured[1]["training_step.count"] == (2.0, 1.0, 2.0, 0.0)
    # Another replica computed two more microbatches of the step: the reduced totals.
    totals = {"training_step.loss": (1.0 + 3.0 + 5.0 + 7.0, 4.0, 4 + 6 + 5 * 4 + 7 * 2, 12.0),
              "training_step.count": (12.0, 4.0, 12.0, 0.0)}
    logs.apply(results, totals, bases, world_size=2)
    loss, count = results["training_step.loss"], results["training_step.count"]
    assert float(loss._forward_cache) == 4.0  # the mean over the step's 4 microbatches
    assert float(count._forward_cache) == 12.0  # the sum
    assert float(loss.value) / float(loss.cumulated_batch_size) == pytest.approx(44 / 12)
    assert float(count.value) * 2 == 12.0  # a share per rank: Lightning's epoch sync sums them
    # The next step continues the epoch totals, exactly.
    bases = logs.begin_step(results)
    assert bases["training_step.loss"] == (44.0, 12.0) and bases["training_step.count"] == (12.0, 0.0)


def test_max_with_sync_dist_in_a_step_is_refused_with_the_fix() -> None:
    results = _ResultCollection(training=True)
    log(results, "peak", 1.0, 1, reduce_fx="max")
    with pytest.raises(ConfigurationError, match="reduce_fx='mean' or 'sum'"):
        SyncedLogs().start(results)


def test_ranks_logging_different_keys_are_told_which() -> None:
    keys = ["training_step.a"]
    reduced = step_values.header(0.0, 0.0, keys) + step_values.header(0.0, 0.0, ["training_step.b"])
    with pytest.raises(step_values.LoggedKeysMismatch, match=r"training_step\.a"):
        step_values.check_header(reduced, keys)
    step_values.check_header(step_values.header(1.0, 1.0, keys) * 2, keys)  # the same keys: no error


def test_a_mean_is_not_divided_by_a_new_world_and_a_replacement_continues_the_totals() -> None:
    # Issue 34: a change of world after the epoch's last commit (a loss in its last validation) divided a
    # mean's accumulators by the live ranks; and a replacement joining mid-epoch started its totals from zero.
    results, logs = _ResultCollection(training=True), SyncedLogs()
    bases = logs.begin_step(results)
    logs.start(results)
    log(results, "loss", 2.0, 4)
    log(results, "count", 4.0, 4, reduce_fx="sum")
    logs.capture(results)
    logs.apply(results, {"training_step.loss": (2.0, 1.0, 8.0, 4.0), "training_step.count": (4.0, 1.0, 4.0, 0.0)}, bases, world_size=2)
    logs.rescale(3)
    loss, count = results["training_step.loss"], results["training_step.count"]
    assert float(loss.value) / float(loss.cumulated_batch_size) == 2.0
    assert float(count.value) * 3 == pytest.approx(4.0)  # a sum's share is spread over the new world
    handed = logs.totals(results)
    assert handed == {"training_step.loss": (8.0, 4.0), "training_step.count": (4.0, 0.0)}
    joined_results, joined = _ResultCollection(training=True), SyncedLogs()
    joined.take_over(handed)
    bases = joined.begin_step(joined_results)  # nothing logged yet on the replacement
    joined.start(joined_results)
    log(joined_results, "loss", 4.0, 4)
    log(joined_results, "count", 4.0, 4, reduce_fx="sum")
    joined.capture(joined_results)
    totals = {"training_step.loss": (4.0, 1.0, 16.0, 4.0), "training_step.count": (4.0, 1.0, 4.0, 0.0)}
    joined.apply(joined_results, totals, bases, world_size=2)
    loss, count = joined_results["training_step.loss"], joined_results["training_step.count"]
    assert (float(loss.value), float(loss.cumulated_batch_size)) == (24.0, 8.0)  # the epoch's, not the step's
    assert float(count.value) * 2 == 8.0
