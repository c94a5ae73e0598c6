"""Where a step's cross-replica sums land, and what a replica sends.

The reduction is out-of-place for a contributor: its accumulated (pre-reduction)
gradient stays untouched in ``param.grad`` while the sums land in buffers owned here. A
bucket reduced under a stale world epoch is therefore rolled back for free -- its input
was never overwritten -- and restoring costs nothing at a boundary step, so it overlaps
trivially with the extra microbatches' compute. That one gradient-sized buffer is the
protocol's whole memory cost over stock HSDP: the rollback copy.

A spare that does not contribute sends zeros without a buffer of zeros: its output buffer
is zeroed and reduced in place (after a repair every bucket is redone, so each round starts
from zeros again). Its shadow work stays in its accumulator, ready for a promotion. The
engine copies the sums into the gradients only at commit.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_recover.callbacks.base import RecoveryCallback
from lightning_recover.recovery.hooks import StepCollectives
from lightning_recover.recovery.state import StepState


class ReductionBuffers(RecoveryCallback):
    """Owns the reduction outputs, reused every step."""

    def __init__(self) -> None:
        self._out: list[torch.Tensor] = []

    @override
    def on_before_reduce(self, trainer: Any, pl_module: Any, step: StepState, collectives: StepCollectives) -> None:
        step.reduction.out = self._buffers(step.reduction.local)
        if step.mine.contributes:
            step.reduction.send = list(step.reduction.local)
        else:
            for o in step.reduction.out:
                o.zero_()
            step.reduction.send = step.reduction.out

    def _buffers(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(self._out) != len(local) or any(o.shape != t.shape or o.dtype != t.dtype for o, t in zip(self._out, local)):
            self._out = [torch.empty_like(t, device="cpu") for t in local]
        return self._out
