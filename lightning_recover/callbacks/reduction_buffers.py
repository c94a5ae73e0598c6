"""Where a step's cross-replica sums land, and what a replica sends.

The reduction is out-of-place: each replica's accumulated (pre-reduction) gradient stays
untouched in ``param.grad`` while the sums land in buffers owned here. A bucket reduced
under a stale world epoch is therefore rolled back for free -- its input was never
overwritten -- and restoring costs nothing at a boundary step, so it overlaps trivially
with the extra microbatches' compute. A spare that does not contribute sends zeros (its
shadow work stays in its accumulator, ready for a promotion). The engine copies the sums
into the gradients only at commit.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_recover.callbacks.base import RecoveryCallback
from lightning_recover.recovery.state import StepState


class ReductionBuffers(RecoveryCallback):
    """Owns the reduction outputs (and zero inputs for non-contributing spares), reused every step."""

    def __init__(self) -> None:
        self._out: list[torch.Tensor] = []
        self._zeros: list[torch.Tensor] = []

    @override
    def on_before_reduce(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        step.out = self._buffers(step.local)
        step.send = list(step.local) if step.mine.contributes else self._zero_inputs(step.local)

    def _buffers(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(self._out) != len(local) or any(o.shape != t.shape or o.dtype != t.dtype for o, t in zip(self._out, local)):
            self._out = [torch.empty_like(t, device="cpu") for t in local]
        return self._out

    def _zero_inputs(self, local: list[torch.Tensor]) -> list[torch.Tensor]:
        if len(self._zeros) != len(local) or any(z.shape != t.shape for z, t in zip(self._zeros, local)):
            self._zeros = [torch.zeros_like(t, device="cpu") for t in local]
        return self._zeros
