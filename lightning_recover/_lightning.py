"""Every use of Lightning's private API, in one place: what, where, why, and the version checked.

Installation, not the protocol: the strategy adapts Lightning's hooks through public API
wherever Lightning has one; the few things it cannot reach that way are done here (the
strategy's) or listed here (the loggers' and step logs' overrides of private members,
which must stay in their classes). :data:`CHECKED_WITH` is the Lightning release every
entry was checked against; ``tests/inprocess/test_lightning_private.py`` checks that each entry of
:data:`PRIVATE` still exists in the installed Lightning, so an upgrade that moves one
fails there, naming it, instead of deep inside a training run. Adding a private use
means adding its row here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: The Lightning release the entries below were checked against.
CHECKED_WITH = "2.6.6"

#: Private member (``Class.attribute``: ``Trainer``, ``LightningModule``, ``CSVLogger``, the CSV
#: ``ExperimentWriter`` of ``lightning.pytorch``; ``Metric`` of torchmetrics, Lightning's metrics package) -> (where it is used, why no public API serves).
PRIVATE: dict[str, tuple[str, str]] = {
    "Trainer._accelerator_connector": (
        "no_distributed_sampler", "the Trainer's use_distributed_sampler has no setter after construction; data placement is the planner's"),
    "LightningModule._device_mesh": (
        "set_device_mesh", "LightningModule.device_mesh has no setter; ModelParallelStrategy assigns it the same way"),
    "Trainer._checkpoint_connector": (
        "hand_over_checkpoint, dump_checkpoint", "a re-joined rank's checkpoint arrives in memory, and a donor sends "
        "what trainer.save_checkpoint would write: neither has a public API"),
    "Trainer._results": (
        "fit_results; strategies/synced_logs.py", "the logged values of a step: no public API exposes per-call values"),
    "Trainer._logger_connector": (
        "logging_as_training_step, loggers_write_this_step", "a later microbatch of a step is a later batch of the epoch "
        "(its _first_loop_iter); whether this step's values reach the loggers (its should_update_logs)"),
    "LightningModule._current_fx_name": (
        "logging_as_training_step", "values logged by every microbatch file under training_step, as with accumulate_grad_batches"),
    "Metric._reductions": (
        "metric_reductions; strategies/step_metrics.py", "how torchmetrics syncs each state (sum, mean, cat, ...): "
        "no public accessor; only summed states are recovered after a loss"),
    "Metric._computed": (
        "forget_computed; strategies/step_metrics.py", "a metric's cached compute() result: states written at a commit "
        "must not return a value cached before (update() clears it the same way)"),
    "CSVLogger._experiment": (
        "loggers.py", "the CSV writer has no setter; a new leader's writer must continue the file"),
    "Precision._after_closure": (
        "after_closure; strategies/steps.py", "on_before_optimizer_step and gradient clipping must see the reduced gradient, "
        "as with stock strategies; this is the one hook that runs both (no public equivalent)"),
    "CSVLogger._version": (
        "set_logger_version; strategies/step_logging.py", "loggers keep their resolved version there with no setter; every "
        "rank (and a replacement) must write into the leader's run directory"),
    "LightningOptimizer._optimizer": (
        "unwrapped_optimizer; strategies/recover_hsdp.py", "the optimizer Lightning wraps, for DCP's optimizer state "
        "(LightningOptimizer.optimizer is read-only and absent before 2.1)"),
    "_TrainingEpochLoop._broadcast_sigterm_tensor": (
        "skip_sigterm_broadcast; strategies/recover_hsdp.py", "Lightning broadcasts a SIGTERM flag over the default "
        "group before every batch, and no option turns it off; under this strategy a SIGTERM ends the rank at once "
        "(lifecycle.die_on_sigterm), so the flag is always 0 and the broadcast (5.5 % of a profiled rank's main thread) buys nothing"),
    "ExperimentWriter._check_log_dir_exists": (
        "loggers.py (override)", "it deletes an existing metrics.csv with no option to keep it; a new leader must keep it"),
}


def no_distributed_sampler(trainer: Any) -> None:
    """Lightning's DistributedSampler would pad with duplicates: training data is the planner's, evaluation an exactly-once split."""
    trainer._accelerator_connector.use_distributed_sampler = False


def set_device_mesh(module: Any, mesh: Any) -> None:
    """``module.device_mesh``: the replica's mesh."""
    module._device_mesh = mesh


def hand_over_checkpoint(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Let Lightning restore ``checkpoint`` (received in memory) right after setup, as ``resume_start`` would from a file."""
    trainer._checkpoint_connector._loaded_checkpoint = checkpoint


def dump_checkpoint(trainer: Any) -> dict[str, Any]:
    """What ``trainer.save_checkpoint`` would write at this moment, in memory."""
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)  # type: ignore[no-any-return]


def skip_sigterm_broadcast(trainer: Any) -> None:
    """No per-batch broadcast of Lightning's SIGTERM flag in this trainer's fit loop (the flag is never set)."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def fit_results(module: Any) -> Any:
    """The fit loop's result collection (the values ``self.log`` stored), or None without a module."""
    return module.trainer._results if module is not None else None


@contextmanager
def logging_as_training_step(module: Any, first: bool) -> Iterator[None]:
    """Values logged inside the block file under ``training_step``; ``first=False``: as a later batch of the epoch."""
    if not first:
        module.trainer._logger_connector._first_loop_iter = False
    previous, module._current_fx_name = module._current_fx_name, "training_step"
    try:
        yield
    finally:
        module._current_fx_name = previous


def loggers_write_this_step(trainer: Any) -> bool:
    """Whether Lightning hands this training step's logged values to the loggers (``log_every_n_steps``,
    the run stopping, ``fast_dev_run``): the condition its ``update_train_step_metrics`` applies."""
    return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)


def after_closure(precision_plugin: Any, model: Any, optimizer: Any) -> None:
    """Lightning's after-closure step: ``on_before_optimizer_step`` and gradient clipping, on the reduced gradient."""
    precision_plugin._after_closure(model, optimizer)


def keeps_version(logger: Any) -> bool:
    """Whether ``logger`` resolves a run version of its own (Lightning's loggers do), which ranks must agree on."""
    return hasattr(logger, "_version")


def set_logger_version(logger: Any, version: Any) -> bool:
    """Give ``logger`` the run version every rank agreed on; False for a logger that keeps none."""
    if not keeps_version(logger):
        return False
    logger._version = version
    return True


def unwrapped_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (any other optimizer as it is)."""
    return getattr(optimizer, "_optimizer", optimizer)


def metric_reductions(metric: Any) -> dict[str, Any]:
    """How a torchmetrics ``Metric`` syncs each of its states (its ``dist_reduce_fx``, as a function)."""
    return dict(metric._reductions)


def forget_computed(metric: Any) -> None:
    """Drop a torchmetrics ``Metric``'s cached ``compute()`` result, as its ``update()`` does."""
    metric._computed = None
