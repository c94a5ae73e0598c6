"""Step time with the user's DataLoader workers vs none, for an I/O-bound dataset (issue 11, point 8).

The dataset's ``__getitem__`` sleeps (``--sleep-ms`` per sample, standing in for storage or
network reads) and the model is small, so without workers every step waits for
``grad_accum * mbs`` sample reads; with ``--workers`` the planner-driven batch sampler lets
the workers load the planned microbatches while the model computes.

One process (``python -m benchmarks.dataloader_workers``; the strategy runs as a single
replica, and says so on stderr) trains one fresh model per configuration. The
configurations run ALTERNATELY, the order reversed every other round, so a drift of a
shared machine hits both alike. Step time: wall time between consecutive optimizer-step
ends (``on_train_batch_end``), the first ``--warmup`` steps of each fit skipped (worker
start-up), median over the rounds' pooled steps.

The last line printed is the headline ``step time 4 workers / 0 workers: 0.31x``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402


class SlowReads(Dataset):
    """``n`` random feature vectors, each read taking ``sleep_s`` (I/O, not CPU)."""

    def __init__(self, n: int, dim: int, sleep_s: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


class Regressor(L.LightningModule):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim, dim), torch.nn.ReLU(), torch.nn.Linear(dim, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepClock(L.Callback):
    """Wall time between consecutive optimizer-step ends."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    def step_times(self, warmup: int) -> list[float]:
        return [b - a for a, b in zip(self.ends[warmup:], self.ends[warmup + 1 :])]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4, help="num_workers of the compared loader")
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps per fit")
    ap.add_argument("--warmup", type=int, default=3, help="first steps of each fit not timed")
    ap.add_argument("--rounds", type=int, default=2, help="fits per configuration, alternating")
    ap.add_argument("--sleep-ms", type=float, default=5.0, help="read time of one sample")
    ap.add_argument("--mbs", type=int, default=4, help="microbatch size (DataLoader batch_size)")
    ap.add_argument("--grad-accum", type=int, default=4, help="microbatches per optimizer step")
    ap.add_argument("--dim", type=int, default=256, help="feature width of the model")
    ap.add_argument("--json", type=Path, default=None, help="also write the measurements here")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.steps < args.warmup + 2 or args.rounds < 1:
        ap.error("need --workers >= 1, --steps >= --warmup + 2 and --rounds >= 1")
    return args


def fit(args: argparse.Namespace, workers: int) -> list[float]:
    """One fit with ``num_workers=workers``; its steady-state step times."""
    dataset = SlowReads((args.steps + 1) * args.grad_accum * args.mbs, args.dim, args.sleep_ms / 1000)
    loader = DataLoader(dataset, batch_size=args.mbs, num_workers=workers, persistent_workers=workers > 0)
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=ReCoVerHSDPStrategy(grad_accum=args.grad_accum), max_steps=args.steps,
        callbacks=[clock], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(Regressor(args.dim), loader)
    if torch.distributed.is_initialized():
        # The next fit's strategy sets up its own replica group (one process, several fits).
        torch.distributed.destroy_process_group()
    return clock.step_times(args.warmup)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(does not have many workers|worker processes in total).*")
    times: dict[int, list[float]] = {0: [], args.workers: []}
    for r in range(args.rounds):
        order = [0, args.workers] if r % 2 == 0 else [args.workers, 0]
        for workers in order:
            steps = fit(args, workers)
            times[workers].extend(steps)
            print(f"round {r} num_workers={workers}: median step {1000 * statistics.median(steps):.1f} ms", flush=True)
    med = {w: statistics.median(t) for w, t in times.items()}
    read_ms = args.grad_accum * args.mbs * args.sleep_ms
    print(f"reads per step without workers: {read_ms:.0f} ms ({args.grad_accum} x {args.mbs} samples x {args.sleep_ms} ms)")
    for w, m in med.items():
        print(f"num_workers={w}: median step time {1000 * m:.1f} ms over {len(times[w])} steps")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "step_times_s": times}))
    print(f"step time {args.workers} workers / 0 workers: {med[args.workers] / med[0]:.2f}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
