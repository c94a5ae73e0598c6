"""The committed step's values through Lightning's logging (StepLogging.log_committed): the membership
values are logged only when they changed or reach a logger, and every reader sees what logging
them at every step would show -- the CSV rows, ``trainer.callback_metrics``, the progress bar's
metrics -- across a loss, a re-join and a new fit."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_recover.strategies.step_logging import StepLogging

#: (live replicas, world epoch, faults) in force at each step: a loss at step 4, a re-join at step 7.
MEMBERSHIP = [(4, 0, 0)] * 4 + [(3, 1, 1)] * 3 + [(4, 2, 1)] * 4
KEYS = ("live_replicas", "world_epoch", "faults")


class Committing(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))
        self.logging = StepLogging(lambda: self)
        self.calls: list[str] = []

    def log(self, name: str, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.calls.append(name)
        super().log(name, *args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        step = self.trainer.global_step
        live, epoch, faults = MEMBERSHIP[step]
        self.logging.log_committed({"loss": float(step)}, live_replicas=live, world_epoch=epoch, faults=faults)
        return (self.w * batch[0]).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Seen(L.Callback):
    """What a callback (ModelCheckpoint, EarlyStopping) and the progress bar read after each step."""

    def __init__(self) -> None:
        self.callback: list[tuple[float, ...]] = []
        self.pbar: list[tuple[float, ...]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.callback.append(tuple(float(trainer.callback_metrics[k]) for k in KEYS))
        self.pbar.append(tuple(float(trainer.progress_bar_metrics[k]) for k in KEYS))


def _fit(tmp_path: Path, module: Committing, steps: int, log_every: int, seen: Seen, version: int) -> list[dict[str, str]]:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(64, 1)), batch_size=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, log_every_n_steps=log_every, callbacks=[seen],
                        logger=CSVLogger(str(tmp_path), name="logs", version=version), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    metrics = tmp_path / "logs" / f"version_{version}" / "metrics.csv"
    if not metrics.exists():  # no step reached the logger
        return []
    with metrics.open(newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("step_loss")]


@pytest.mark.parametrize("log_every", [1, 3])
def test_membership_values_reach_every_reader_as_if_logged_at_every_step(tmp_path: Path, log_every: int) -> None:
    module, seen = Committing(), Seen()
    rows = _fit(tmp_path, module, len(MEMBERSHIP), log_every, seen, version=0)
    expected = [tuple(float(v) for v in m) for m in MEMBERSHIP]
    assert seen.callback == expected and seen.pbar == expected
    written = [int(r["step"]) for r in rows]
    assert written == [s for s in range(len(MEMBERSHIP)) if (s + 1) % log_every == 0], written
    for r in rows:
        s = int(r["step"])
        assert float(r["step_loss"]) == s
        assert tuple(float(r[k]) for k in KEYS) == expected[s], f"row of step {s}: {r}"
    per_step = module.calls.count("step_loss")
    assert per_step == len(MEMBERSHIP)
    # Logged at the first step, at each change (steps 4 and 7) and at every written step.
    logged_at = {0, 4, 7} | set(written)
    assert module.calls.count("faults") == len(logged_at), module.calls
    if log_every > 1:
        assert module.calls.count("faults") < len(MEMBERSHIP)


def test_a_new_fit_shows_the_values_again(tmp_path: Path) -> None:
    """A new fit starts with empty callback metrics: the same module and StepLogging log the values at its first step."""
    module = Committing()
    _fit(tmp_path, module, 3, 50, Seen(), version=0)
    module.calls.clear()
    seen = Seen()
    _fit(tmp_path, module, 3, 50, seen, version=1)
    assert seen.callback == [tuple(float(v) for v in MEMBERSHIP[s]) for s in range(3)]
    assert module.calls.count("faults") == 1, module.calls
