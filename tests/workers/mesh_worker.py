"""Launched job for the ``configure_model`` test: the tiny GPT, sharded by the strategy or by the user.

With ``--user-shard`` the LightningModule shards itself in ``configure_model`` over
``self.device_mesh`` (the ModelParallelStrategy convention), with units of its own choice
(each block's MLP, then the root), so the strategy's default wrapping (one unit per block)
would be visible if it ran anyway. Every rank writes ``rank{R}.json``: the mesh it saw, its
FSDP units and the reduced gradient norm of every step; the leader writes the ledger.
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
from torch.utils.data import DataLoader  # noqa: E402

from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402

from examples.model import GPT, SIZES, ByteDataset, read_corpus  # noqa: E402


class UserShardedGPT(GPT):
    """Shards itself in ``configure_model``, as a ModelParallelStrategy user would."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh
        assert mesh is not None, "configure_model ran without a device mesh"
        self.mesh_seen = {"size": mesh.size(), "names": list(mesh.mesh_dim_names or ()), "by_name": mesh["data_parallel"].size()}
        for block in self.blocks:
            fully_shard(block.mlp, mesh=mesh)
        fully_shard(self, mesh=mesh)


class GradNorms(L.Callback):
    """The norm of the reduced gradient each optimizer step applies (full tensors, every shard rank)."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        total = torch.zeros((), dtype=torch.float64)
        for p in pl_module.parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                total += g.double().pow(2).sum()
        self.norms.append(float(total.sqrt()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--user-shard", action="store_true")
    args = ap.parse_args()
    out = Path(os.environ["LR_TEST_OUT"])
    from torch.distributed.fsdp import FSDPModule

    L.seed_everything(args.seed, verbose=False)
    cls = UserShardedGPT if args.user_shard else GPT
    model = cls(**SIZES["tiny"], dropout=0.0, warmup_steps=2)
    data = ByteDataset(read_corpus(max_bytes=200_000), SIZES["tiny"]["block_size"])
    strategy = ReCoVerHSDPStrategy(shards=args.shards, grad_accum=2, seed=args.seed, ledger_path=out / "ledger.jsonl")
    norms = GradNorms()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, callbacks=[norms], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=2))
    comm = strategy.comm
    assert comm is not None
    result = {
        "rank": comm.rank,
        "mesh_seen": getattr(model, "mesh_seen", None),
        "strategy_mesh_size": strategy.device_mesh.size(),
        "units": sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule)),
        "grad_norms": norms.norms,
        "global_step": trainer.global_step,
    }
    (out / f"rank{comm.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
