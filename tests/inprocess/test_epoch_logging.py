"""Epoch-level ``self.log`` in ``training_step`` under grad_accum, against stock Lightning's accumulate_grad_batches.

Single process (one replica). The stock run reads the same microbatches in the same order
(the planner's), so both trainers see the same losses and their epoch means must agree.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Sampler, TensorDataset

from lightning_recover.planner import MicrobatchPlanner
from lightning_recover.strategies import ReCoVerHSDPStrategy

torch.set_num_threads(1)

G, MBS, SEED, SAMPLES, EPOCHS = 4, 3, 5, 96, 2
STEPS_PER_EPOCH = SAMPLES // (G * MBS)


class Regressor(L.LightningModule):
    """Logs its loss per epoch without ``batch_size=`` and remembers every microbatch's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.seen: list[tuple[int, float]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.seen.append((self.current_epoch, float(loss.detach())))
        self.log("epoch_loss", loss, on_step=False, on_epoch=True)
        self.log("target_sum", y.sum(), on_step=False, on_epoch=True, reduce_fx="sum")
        return loss

    def on_after_backward(self) -> None:
        # Another hook logging between microbatches must not reset training_step's epoch values.
        self.log("backward_calls", 1.0, on_step=False, on_epoch=True, reduce_fx="sum")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.3 * torch.randn(SAMPLES, generator=g)
    return TensorDataset(x, y)


class PlannedOrder(Sampler[list[int]]):
    """The planner's microbatches, step by step, one data epoch per pass (what the strategy computes)."""

    def __init__(self) -> None:
        self.planner = MicrobatchPlanner(SAMPLES, G, MBS, shards=1, seed=SEED)
        self.epoch = 0

    def __len__(self) -> int:
        return STEPS_PER_EPOCH * G

    def __iter__(self) -> Iterator[list[int]]:
        first = self.epoch * STEPS_PER_EPOCH * G
        self.epoch += 1
        return (self.planner.sample_indices(m, 0) for m in range(first, first + len(self)))


def epoch_rows(log_dir: str) -> list[dict[str, float]]:
    with open(Path(log_dir) / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("epoch_loss")]
    keys = ("epoch", "epoch_loss", "target_sum", "backward_calls")
    return [{k: float(r[k]) for k in keys} for r in rows]


def run(tmp_path: Path, name: str, ours: bool) -> tuple[Regressor, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = Regressor()
    data = dataset()
    if ours:
        strategy: object = ReCoVerHSDPStrategy(grad_accum=G, seed=SEED)
        loader = DataLoader(data, batch_size=MBS)
        extra = {}
    else:
        strategy, loader, extra = "auto", DataLoader(data, batch_sampler=PlannedOrder()), {"accumulate_grad_batches": G}
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=EPOCHS, logger=CSVLogger(tmp_path, name=name),
        log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **extra,
    )
    try:
        trainer.fit(model, loader)
    finally:
        if isinstance(trainer.strategy, ReCoVerHSDPStrategy):
            trainer.strategy.shutdown()
    return model, trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Regressor, L.Trainer]]:
    tmp = tmp_path_factory.mktemp("epoch_logging")
    # Stock first: the strategy's run sets up (and ends) torch.distributed in this process.
    return {"stock": run(tmp, "stock", ours=False), "ours": run(tmp, "ours", ours=True)}


def test_both_runs_compute_the_same_microbatches(runs: dict[str, tuple[Regressor, L.Trainer]]) -> None:
    stock, ours = runs["stock"][0].seen, runs["ours"][0].seen
    assert len(ours) == EPOCHS * STEPS_PER_EPOCH * G, "every microbatch runs training_step exactly once"
    assert [e for e, _ in ours] == [e for e, _ in stock]
    assert [v for _, v in ours] == pytest.approx([v for _, v in stock], rel=1e-5)
    assert runs["ours"][1].global_step == runs["stock"][1].global_step == EPOCHS * STEPS_PER_EPOCH


def test_epoch_mean_counts_every_microbatch_as_stock_lightning(runs: dict[str, tuple[Regressor, L.Trainer]]) -> None:
    model, trainer = runs["ours"]
    stock_rows = epoch_rows(runs["stock"][1].logger.log_dir)  # type: ignore[union-attr]
    our_rows = epoch_rows(trainer.logger.log_dir)  # type: ignore[union-attr]
    assert [r["epoch"] for r in our_rows] == [r["epoch"] for r in stock_rows] == [float(e) for e in range(EPOCHS)]
    for mine, theirs in zip(our_rows, stock_rows):
        assert mine["epoch_loss"] == pytest.approx(theirs["epoch_loss"], rel=1e-5)
        assert mine["target_sum"] == pytest.approx(theirs["target_sum"], rel=1e-5)
        assert mine["backward_calls"] == theirs["backward_calls"] == STEPS_PER_EPOCH * G
    # The mean over all G microbatches of every step (equal sizes), not over G - 1 of them.
    for epoch, row in enumerate(our_rows):
        values = [v for e, v in model.seen if e == epoch]
        assert row["epoch_loss"] == pytest.approx(sum(values) / len(values), rel=1e-6)
    total = float(dataset().tensors[1].sum())
    assert our_rows[-1]["target_sum"] == pytest.approx(total, rel=1e-5), "each sample counted once per epoch"
    assert float(trainer.callback_metrics["epoch_loss"]) == pytest.approx(our_rows[-1]["epoch_loss"], rel=1e-6)
