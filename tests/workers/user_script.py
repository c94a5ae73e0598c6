"""A user's plain Lightning script under ReCoVerHSDPStrategy: tiny model, a few steps, then the end of file.

What it does is chosen on the command line, so one file covers the ways a script ends:
``--raise-in-step N`` raises ``ValueError("user bug 42")`` from ``training_step`` at step N,
``--kill-in-step N`` SIGKILLs the rank there instead (a replica that dies, not a bug),
``--target`` and ``--devices`` feed the strategy and the Trainer as a user would (to
provoke their errors), ``--end shutdown`` calls ``strategy.shutdown()`` at the end, the
default just lets the script end. ``--report-ranks`` prints, per rank, what Lightning made of
the launch during the first step (its ranks, world size and cluster environment, and
whether Lightning's own SLURMEnvironment would detect Slurm): under Slurm, ranks started by
mpiexec inherit ``SLURM_PROCID=0`` and must not be read as Slurm ranks. No output files: the tests read what the user sees
(stdout, stderr, the exit status).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402

STARTED = time.monotonic()


class Tiny(L.LightningModule):
    def __init__(self, raise_at: int | None, kill_at: int | None) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)])
        self.raise_at = raise_at
        self.kill_at = kill_at
        self.seen: str | None = None  # what Lightning made of the launch, from the first step

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.raise_at is not None and self.trainer.global_step >= self.raise_at:
            raise ValueError("user bug 42")
        if self.kill_at is not None and self.trainer.global_step >= self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.seen is None:
            from lightning.fabric.plugins.environments import SLURMEnvironment

            t = self.trainer
            env = t.strategy.cluster_environment
            self.seen = (
                f"global_rank={t.global_rank} world_size={t.world_size} local_rank={t.local_rank} node_rank={t.node_rank} "
                f"cluster_environment={type(env).__name__} slurm_detect={SLURMEnvironment.detect()} "
                f"SLURM_PROCID={os.environ.get('SLURM_PROCID')} SLURM_NTASKS={os.environ.get('SLURM_NTASKS')}"
            )
        x, y = batch
        return torch.nn.functional.mse_loss(self.layers[1](torch.relu(self.layers[0](x))), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--target", type=int, default=None)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--raise-in-step", type=int, default=None)
    ap.add_argument("--kill-in-step", type=int, default=None)
    ap.add_argument("--end", choices=["none", "shutdown"], default="none")
    ap.add_argument("--report-ranks", action="store_true")
    args = ap.parse_args()

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    strategy = ReCoVerHSDPStrategy(shards=args.shards, grad_accum=1, target_replicas=args.target, bucket_mb=0.01)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    model = Tiny(args.raise_in_step, args.kill_in_step)
    trainer.fit(model, DataLoader(data, batch_size=2))
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    if args.report_ranks:
        print(f"user_script: rank {rank} ranks: {model.seen}", flush=True)
    print(f"user_script: rank {rank} finished fit at step {trainer.global_step} after {time.monotonic() - STARTED:.1f}s (clock {time.time():.2f})", flush=True)
    if args.end == "shutdown":
        strategy.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
