"""Single-process reference for the strategy tests: the chaos campaign's reference_run
(``benchmarks/chaos.py``, the project's one reference trajectory) for train_worker's arguments."""

from __future__ import annotations


import torch

# The reference lives with the chaos campaign's job (benchmarks/ is scripts, not an installed package).
from benchmarks.chaos import reference_run as _reference_run  # noqa: E402
from train_worker import parse  # noqa: E402


def reference_run(argv: list[str], replicas: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The trajectory a launched train_worker run with ``argv`` on ``replicas`` replicas must match."""
    args = parse(argv)
    B = (args.target or replicas) * args.grad_accum
    return _reference_run(B, args.steps, args.seed, samples_per_microbatch=args.mbs * args.shards)
