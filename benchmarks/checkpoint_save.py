"""How long a checkpoint save blocks the step loop: synchronous vs asynchronous, side by side.

One process trains an MLP with AdamW (``--width`` x ``--layers``; the defaults give ~100 MB
of model and optimizer state) and saves every ``--every`` steps through the strategy's
:class:`~lightning_recover.strategies.checkpoint_io.CheckpointWriter` -- the same DCP write,
consolidation and publication the leader replica runs -- once with ``async_save=False``
and once with ``async_save=True``. Blocking time is what the step loop spends inside
``save`` (for async: waiting for the previous write, then staging into CPU memory).

    python -m benchmarks.checkpoint_save [--width 1024 --layers 8 --steps 12 --every 4]

The last line is the headline: ``async/sync blocking time: <ratio>x``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from pathlib import Path

import torch

from lightning_recover.strategies.checkpoint_io import STATE_KEY, CheckpointWriter


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace, async_save: bool, directory: Path) -> dict[str, float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    writer = CheckpointWriter(0, 1, async_save=async_save, pointer_dir=directory)
    x = torch.randn(args.batch, args.width)
    blocked, saves, started = 0.0, 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step % args.every == 0:
            checkpoint = {"global_step": step, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], STATE_KEY: {"step": step}}
            writer.save(checkpoint, directory / f"step-{step:08d}.ckpt", step=step)
            blocked += writer.last_blocking_s
            saves += 1
    loop = time.perf_counter() - started
    t = time.perf_counter()
    writer.close()  # end of fit: the last write completes
    return {"blocked_s": blocked, "saves": saves, "loop_s": loop, "drain_s": time.perf_counter() - t}


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state_mb = args.layers * (args.width * args.width + args.width) * 4 * 3 / 2**20  # weights + AdamW's two moments
    print(f"model+optimizer state: {state_mb:.1f} MB, a save every {args.every} of {args.steps} steps")
    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for mode in ("sync", "async"):
            r = results[mode] = run(args, mode == "async", Path(tmp) / mode)
            print(
                f"{mode:>5}: step loop blocked {r['blocked_s'] * 1e3 / r['saves']:8.1f} ms per save "
                f"({r['saves']} saves), loop {r['loop_s']:.2f} s, last write drained in {r['drain_s']:.2f} s"
            )
    ratio = results["async"]["blocked_s"] / results["sync"]["blocked_s"]
    print(f"async/sync blocking time: {ratio:.2f}x")
    return ratio


if __name__ == "__main__":
    main()
