"""Rollback copies of gradient buckets.

The reduction is out-of-place: each replica's accumulated (pre-reduction) gradient stays
untouched in ``param.grad`` while the sums land in buffers owned here. A bucket reduced
under a stale epoch is therefore rolled back for free -- its input was never overwritten
-- and restoring costs nothing at a boundary step, so it overlaps trivially with the extra
microbatches' compute. Only at commit are the sums copied into the gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from lightning.pytorch.callbacks import Callback


class GradientSnapshot(Callback):
    """Owns the reduction outputs (and zero inputs for non-contributing spares)."""

    def __init__(self) -> None:
        self._out: list[torch.Tensor] = []
        self._zeros: list[torch.Tensor] = []

    def buffers(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Output buffers matching ``local`` (allocated once, reused every step)."""
        if len(self._out) != len(local) or any(o.shape != t.shape or o.dtype != t.dtype for o, t in zip(self._out, local)):
            self._out = [torch.empty_like(t, device="cpu") for t in local]
        return self._out

    def inputs(self, local: Sequence[torch.Tensor], contributes: bool) -> list[torch.Tensor]:
        """What this replica sends: its accumulated gradient, or zeros when it is a spare."""
        if contributes:
            return list(local)
        if len(self._zeros) != len(local) or any(z.shape != t.shape for z, t in zip(self._zeros, local)):
            self._zeros = [torch.zeros_like(t, device="cpu") for t in local]
        return self._zeros

    def commit(self, local: Sequence[torch.Tensor], divisor: float) -> None:
        """Replace the local gradients by the reduced sums divided by the constant ``divisor``."""
        for t, o in zip(local, self._out):
            t.copy_(o).div_(divisor)
