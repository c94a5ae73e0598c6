"""A real single-replica fit over several data epochs: loading through DataLoader workers changes nothing.

Dropout in the model and torch-random augmentation in the dataset make every loss depend
on the RNG state the forward starts from; with ``num_workers=2`` (persistent or not) the
fit must see bitwise the losses of ``num_workers=0`` (every microbatch loaded in the main
process when asked), epoch after epoch, with the batches loaded by the workers.
"""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_recover.strategies import ReCoVerHSDPStrategy

torch.set_num_threads(1)
G, MBS, SAMPLES, EPOCHS = 2, 3, 36, 2  # 6 steps per epoch


class Augmented(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, 4, generator=g), torch.randn(SAMPLES, generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i] + 0.1 * torch.randn(4), self.y[i], os.getpid()


class Noisy(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))
        self.seen: list[tuple[int, float]] = []
        self.pids: set[int] = set()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y, pid = batch
        self.pids.update(int(p) for p in pid)
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.seen.append((self.current_epoch, float(loss.detach())))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def fit(workers: int, persistent: bool = False) -> Noisy:
    L.seed_everything(0, verbose=False)
    model = Noisy()
    loader = DataLoader(Augmented(), batch_size=MBS, num_workers=workers, persistent_workers=persistent)
    strategy = ReCoVerHSDPStrategy(grad_accum=G, seed=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=EPOCHS, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(model, loader)
        assert trainer.global_step == EPOCHS * SAMPLES // (G * MBS)
    finally:
        strategy.shutdown()
        if dist.is_initialized():  # the next fit in this process sets up its own replica group
            dist.destroy_process_group()
    return model


@pytest.fixture(scope="module")
def direct() -> Noisy:
    return fit(0)


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_give_the_same_losses_every_epoch(direct: Noisy, persistent: bool) -> None:
    streamed = fit(2, persistent)
    assert {e for e, _ in streamed.seen} == set(range(EPOCHS))
    assert streamed.seen == direct.seen  # bitwise: same samples, same augmentation, same dropout
    assert direct.pids == {os.getpid()}
    assert streamed.pids - {os.getpid()}, "no batch came from a worker process"
