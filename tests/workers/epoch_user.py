"""An outside user's LightningModule: epoch-level logging, torchmetrics, validation, a checkpoint callback (issue 34).

A tiny causal language model (embedding, one hidden layer, vocabulary head) over random
tokens, trained as a user would write it: ``self.log("train_loss", loss, on_step=True,
on_epoch=True, sync_dist=True)``, a ``MeanMetric`` and a ``Perplexity`` updated in
``training_step`` and logged as metric objects, a validation loss logged on_epoch with
sync_dist, a ModelCheckpoint, and Lightning's own console (banners, model summary off).
``--faults`` is a FaultInjection schedule (JSON). Rank R writes ``rank{R}.json`` into
``$LR_TEST_OUT``: the epoch values it ends with (``callback_metrics`` and the metrics'
``compute()``), the final parameters' checksum and what the checkpoint callback reports.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torchmetrics  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_recover.callbacks import FaultInjection  # noqa: E402
from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402

VOCAB, SEQ = 16, 8


class Tokens(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i]


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        self.train_mean = torchmetrics.MeanMetric()
        self.train_ppl = torchmetrics.text.Perplexity()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))

    def _loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self(batch[:, :-1])
        target = batch[:, 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1)), logits, target

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss, logits, target = self._loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        self.train_mean.update(loss.detach())
        self.train_ppl.update(logits.detach(), target)
        self.log("train_mean", self.train_mean, on_step=False, on_epoch=True)
        self.log("train_ppl", self.train_ppl, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss, _, _ = self._loss(batch)
        self.log("val_loss", loss, on_epoch=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.05)


class SlowWhileDegraded(L.Callback):
    """Sleep after each step while a replica is missing: room for a replacement to start on 2 cores."""

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        comm = trainer.strategy.comm  # type: ignore[attr-defined]
        if len(comm.alive_replicas) < comm.layout.replicas:
            time.sleep(2.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--samples", type=int, default=32, help="training samples (an epoch is samples / (B * mbs) steps)")
    ap.add_argument("--faults", default="[]")
    ap.add_argument("--ckpt-dir", default=None, help="ModelCheckpoint(dirpath=..., monitor=val_loss) there")
    ap.add_argument("--async-save", type=int, default=1)
    ap.add_argument("--rejoin", action="store_true", help="hot re-join; every rank sleeps 2.5 s after a step while a replica is missing")
    args = ap.parse_args()
    out = Path(os.environ["LR_TEST_OUT"])
    torch.manual_seed(0)
    # With a checkpoint directory the ledger goes there too: the strategy's write fence is then the first
    # file in ModelCheckpoint's directory, which must not make Lightning call it "not empty".
    ledger = Path(args.ckpt_dir or out) / "ledger.jsonl"
    strategy = ReCoVerHSDPStrategy(grad_accum=args.grad_accum, shards=args.shards, bucket_mb=0.01, ledger_path=str(ledger),
                                   checkpoint_async_save=bool(args.async_save), rejoin=args.rejoin, rejoin_backoff_s=0.5)
    callbacks: list[Any] = [FaultInjection(json.loads(args.faults))]
    if args.rejoin:
        callbacks.append(SlowWhileDegraded())
    best = None
    if args.ckpt_dir is not None:
        best = ModelCheckpoint(dirpath=args.ckpt_dir, monitor="val_loss", save_top_k=1, save_last=True)
        callbacks.append(best)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=args.epochs, logger=False, callbacks=callbacks,
        enable_checkpointing=best is not None, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        default_root_dir=str(out),
    )
    model = TinyLM()
    trainer.fit(model, DataLoader(Tokens(args.samples, 1), batch_size=2), DataLoader(Tokens(8, 2), batch_size=2))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    result = {
        "callback_metrics": metrics,
        "mean": float(model.train_mean.compute()) if model.train_mean.update_count else None,
        "ppl": float(model.train_ppl.compute()) if model.train_ppl.update_count else None,
        "steps": trainer.global_step,
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
        "best_model_path": best.best_model_path if best is not None else None,
        "last_model_path": best.last_model_path if best is not None else None,
        "faults": strategy.faults_seen,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
