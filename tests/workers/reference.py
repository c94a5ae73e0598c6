"""Single-process reference: accumulate the same B microbatches per step, no MPI, no Lightning loop.

This is the trajectory every fault-tolerant run must reproduce: same model init, same
samples per step (from the planner), same per-microbatch RNG seeds, loss / B summed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_worker import build, parse  # noqa: E402

from lightning_recover.planner import MicrobatchPlanner  # noqa: E402


def reference_run(argv: list[str], replicas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    args = parse(argv)
    torch.set_num_threads(1)
    model, data = build(args)
    T = args.target or replicas
    B = T * args.grad_accum
    planner = MicrobatchPlanner(len(data), B, args.mbs, shards=args.shards, seed=args.seed)
    opt_cfg = model.configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    model.log = lambda *a, **k: None  # type: ignore[method-assign]
    model.train()
    losses = []
    for step in range(args.steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for offset in range(B):
            gid = planner.global_id(step, offset)
            torch.manual_seed(planner.rng_seed(gid, 0))
            idx = [i for s in range(args.shards) for i in planner.sample_indices(gid, s)]
            x = torch.stack([data[i][0] for i in idx])
            y = torch.stack([data[i][1] for i in idx])
            loss = model.training_step((x, y), 0)
            (loss / B).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(total / B)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
