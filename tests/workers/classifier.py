"""A typical Lightning user's classifier script, run unchanged under ReCoVerHSDPStrategy.

LightningDataModule, validation twice an epoch, torchmetrics accuracy, ModelCheckpoint on
``val_acc``, an LR scheduler, EarlyStopping, the stock CSVLogger; then ``trainer.validate()``,
``trainer.test(ckpt_path="best")``, ``trainer.predict()``. Options: ``--batchnorm`` (BatchNorm + dropout),
``--faults`` (a FaultInjection schedule: training, validation or test phases), ``--shards``.

Every sample carries its index, so the job can show what was evaluated: ``*_count`` values
are logged with ``reduce_fx="sum", sync_dist=True`` (the number of samples the step or the
epoch covered, over every rank) and ``train_loss`` / ``val_loss`` with the default mean.
Each rank that reaches the end writes ``rank{R}.json`` into $LR_TEST_OUT: what validate /
test returned, the sample ids it predicted, its final parameters' and buffers' digests.
With one shard, the leader saves the weights validate() evaluated (the end of fit) to ``final.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torchmetrics  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_recover.callbacks import FaultInjection  # noqa: E402
from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402

FEATURES, CLASSES = 8, 3
SIZES = {"train": 192, "val": 50, "test": 37, "predict": 29}  # not multiples of 4 ranks x batch 4


class Blobs(Dataset):
    """Gaussian blobs, one per class; item = (features, label, index)."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, CLASSES, (n,), generator=g)
        centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) * 2
        self.x = centers[self.y] + torch.randn(n, FEATURES, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class BlobData(L.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        self.sets = {name: Blobs(n, seed) for seed, (name, n) in enumerate(SIZES.items(), start=1)}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["train"], batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["val"], batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["test"], batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.sets["predict"], batch_size=self.batch_size)


class Classifier(L.LightningModule):
    def __init__(self, batchnorm: bool = False, lr: float = 0.2) -> None:
        super().__init__()
        self.save_hyperparameters()
        norm: list[torch.nn.Module] = [torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.1)] if batchnorm else []
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), *norm, torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)
        self.test_acc = torchmetrics.Accuracy(task="multiclass", num_classes=CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.log("train_count", float(len(y)), on_step=True, on_epoch=True, reduce_fx="sum", sync_dist=True)
        return loss

    def _evaluate(self, batch: tuple, stage: str, acc: torchmetrics.Metric) -> None:
        x, y, _ = batch
        logits = self(x)
        self.log(f"{stage}_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}_count", float(len(y)), reduce_fx="sum", sync_dist=True)
        acc(logits.argmax(-1), y)
        self.log(f"{stage}_acc", acc)

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: tuple, batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def predict_step(self, batch: tuple, batch_idx: int) -> dict[str, list[int]]:
        x, _, index = batch
        return {"index": index.tolist(), "pred": self(x).argmax(-1).tolist()}

    def configure_optimizers(self) -> dict:
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=6, gamma=0.5)}


def digest(tensors: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Sums of each tensor's local shard (this rank's part of a sharded parameter)."""
    local = {k: (v.to_local() if hasattr(v, "to_local") else v).detach().double() for k, v in tensors.items()}
    return {k: [float(v.sum()), float(v.abs().sum())] for k, v in local.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batchnorm", action="store_true")
    ap.add_argument("--faults", default="[]")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--shards", type=int, default=1)
    args = ap.parse_args()
    out = Path(os.environ["LR_TEST_OUT"])
    L.seed_everything(3)
    model = Classifier(batchnorm=args.batchnorm)
    data = BlobData()
    strategy = ReCoVerHSDPStrategy(shards=args.shards, grad_accum=2, ledger_path=out / "ledger.jsonl", seed=3)
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_acc", mode="max", save_top_k=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=args.epochs, val_check_interval=0.5,
        callbacks=[FaultInjection(json.loads(args.faults)), checkpoint, EarlyStopping("val_loss", patience=10)],
        logger=CSVLogger(out, name="logs"), log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    validated = trainer.validate(model, datamodule=data, verbose=False)
    if strategy.global_rank == 0 and args.shards == 1:  # before test() loads the best checkpoint into the model
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / "final.pt")
    tested = trainer.test(model, datamodule=data, ckpt_path="best", verbose=False)
    predicted = trainer.predict(model, datamodule=data)
    comm = strategy.comm
    assert comm is not None
    result = {
        "rank": comm.rank, "world_rank": strategy.global_rank, "global_step": trainer.global_step,
        "validate": validated, "test": tested,
        "predicted": [i for batch in predicted for i in batch["index"]],  # type: ignore[index]
        "params": digest(dict(model.named_parameters())), "buffers": digest(dict(model.named_buffers())),
        "best_model_path": checkpoint.best_model_path,
    }
    (out / f"rank{comm.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
