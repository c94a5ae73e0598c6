"""One tiny script for the start-up faults: rank ``--rank`` SIGKILLs itself at ``--die POINT`` before its first step.

Points, in the order a rank meets them: ``start`` (the script's first line: before MPI_Init, nothing
imported -- a broken node, an import that cannot even begin), ``imports`` (after MPI_Init -- the
script imported mpi4py first -- while importing torch and Lightning, before the strategy's
communicator), ``setup`` (the LightningModule's ``setup``), ``configure_model``, ``checkpoint``
(``on_load_checkpoint`` while resuming with ``--resume``), ``broadcast`` (the strategy's first
broadcast of the initial weights, FaultInjection's ``first_broadcast`` phase) and ``none``.
Every rank that finishes writes ``rank<R>.json`` (its final step, the live replicas) into
``$LR_TEST_OUT``; the leader writes the ledger there.
"""

from __future__ import annotations

import argparse
import os
import signal

ap = argparse.ArgumentParser()
ap.add_argument("--die", choices=["start", "imports", "setup", "configure_model", "checkpoint", "broadcast", "none"], default="none")
ap.add_argument("--rank", type=int, default=1)
ap.add_argument("--steps", type=int, default=2)
ap.add_argument("--ckpt-every", type=int, default=0)
ap.add_argument("--resume", action="store_true")
args = ap.parse_args()
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))


def maybe_die(point: str) -> None:
    if args.die == point and RANK == args.rank:
        os.kill(os.getpid(), signal.SIGKILL)


maybe_die("start")
if args.die == "imports":
    from mpi4py import MPI  # noqa: F401  (a script that initializes MPI itself, before its other imports)
import json

import torch

maybe_die("imports")
torch.set_num_threads(1)

import lightning as L
from torch.utils.data import DataLoader, TensorDataset

from lightning_recover.callbacks import FaultInjection, resolve_ckpt_path
from lightning_recover.strategies import ReCoVerHSDPStrategy

OUT = os.environ["LR_TEST_OUT"]


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def setup(self, stage: str) -> None:
        maybe_die("setup")

    def configure_model(self) -> None:
        maybe_die("configure_model")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        maybe_die("checkpoint")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    ckpt_dir = os.path.join(OUT, "ckpt")
    strategy = ReCoVerHSDPStrategy(
        grad_accum=1, bucket_mb=0.01, ledger_path=os.path.join(OUT, "ledger.jsonl"),
        checkpoint_dir=ckpt_dir if args.ckpt_every or args.resume else None, checkpoint_every_n_steps=max(args.ckpt_every, 1) if args.ckpt_every or args.resume else 0,
    )
    faults = [{"step": 0, "rank": args.rank, "phase": "first_broadcast", "kind": "kill"}] if args.die == "broadcast" else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, logger=False, callbacks=[FaultInjection(faults)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=2), ckpt_path=resolve_ckpt_path("last", ckpt_dir) if args.resume else None)
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as f:
        json.dump({"step": trainer.global_step, "replicas": list(strategy.comm.alive_replicas)}, f)


if __name__ == "__main__":
    main()
