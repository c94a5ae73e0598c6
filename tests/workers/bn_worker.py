"""Launched job for the buffer tests: a tiny BatchNorm classifier, optional faults.

Every rank writes into $LR_TEST_OUT: ``buffers{R}.pt`` (its module buffers after fit,
local tensors), ``presync{R}.pt`` (its buffers at each committed step *before* BufferSync
overwrote them: what each rank's own data made of them), ``params{R}.pt`` (full
parameters) and ``rank{R}.json``; the leader writes the ledger.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_recover.callbacks import FaultInjection, RecoveryCallback  # noqa: E402
from lightning_recover.recovery.hooks import StepCollectives  # noqa: E402
from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402


class BNNet(L.LightningModule):
    """Two Linear-BatchNorm-ReLU blocks (one BatchNorm averaging cumulatively) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU()),
                # momentum=None: the running average is weighed by num_batches_tracked.
                nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU()),
            ]
        )
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def dataset(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g) * torch.linspace(0.5, 3.0, 8) + torch.linspace(-2.0, 2.0, 8)
    y = torch.randint(0, 3, (n,), generator=g)
    return TensorDataset(x, y)


def local_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().cpu().clone() for k, v in module.named_buffers()}


class PreSyncSnapshot(RecoveryCallback):
    """Before BufferSync (installed after the user's callbacks), record this rank's own buffers."""

    def __init__(self) -> None:
        self.steps: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any], collectives: StepCollectives) -> None:
        self.steps[int(record["step"])] = local_buffers(pl_module)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--faults", default="[]")
    args = ap.parse_args()
    out = Path(os.environ["LR_TEST_OUT"])
    L.seed_everything(3, verbose=False)
    model = BNNet()
    snapshot = PreSyncSnapshot()
    strategy = ReCoVerHSDPStrategy(shards=args.shards, grad_accum=2, ledger_path=out / "ledger.jsonl", seed=3, bucket_mb=0.01)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps,
        callbacks=[snapshot, FaultInjection(json.loads(args.faults))], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=args.mbs))
    comm = strategy.comm
    assert comm is not None
    with strategy.replica_guard("final parameter gather"):
        params = {k: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for k, p in model.named_parameters()}
    rank = comm.rank
    torch.save(params, out / f"params{rank}.pt")
    torch.save(local_buffers(model), out / f"buffers{rank}.pt")
    torch.save(snapshot.steps, out / f"presync{rank}.pt")
    result = {
        "rank": rank, "replica": comm.replica, "shard": comm.shard, "alive": list(comm.alive_replicas),
        "global_step": trainer.global_step, "leader": strategy.global_rank == 0,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    strategy.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
