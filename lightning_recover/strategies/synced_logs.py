"""``self.log(..., sync_dist=True)`` inside a step: logged per microbatch, synchronised once, at the commit.

Lightning syncs an ``on_step`` value inside ``self.log`` (one collective per call) and an
``on_epoch`` value when the epoch's metrics are computed. Inside a step of the recovery
protocol ranks compute different numbers of microbatches (spares shadow, survivors replay
a lost replica's ids), so a collective per call would pair different calls across ranks.
Instead, between the step's start and its agreed reduction the strategy's ``reduce``
returns the local value, and :class:`SyncedLogs`:

1. notes what each microbatch added to every synced tensor value (:meth:`capture`), which
   the step engine sums over the step's B microbatches, exactly once each, in the commit's
   reduction (:mod:`lightning_recover.recovery.step_values`);
2. writes the results back (:meth:`apply`): the ``on_step`` value becomes the mean (or sum)
   over the step's microbatches, and the epoch accumulators the running totals over every
   committed microbatch of the epoch, the same on every rank. A replica lost later takes
   nothing of the epoch with it, and Lightning's own epoch-end sync then only has to
   average identical values (or add shares, for ``reduce_fx="sum"``).

This reads and writes Lightning's result collection (``trainer._results``, a result's
``_forward_cache``): no public API exposes per-call logged values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_recover.config import ConfigurationError
from lightning_recover.recovery.step_values import Values


@dataclass
class _Before:
    forward_cache: Any
    value: float
    weight: float


@dataclass
class _Written:
    """What :meth:`SyncedLogs.apply` last stored in one result: Lightning replaces the tensor when it resets."""

    tensor: Tensor
    value: float
    weight: float
    #: The tensor holds this rank's share of a sum (``value / world size``), which a change of world re-spreads;
    #: a mean's accumulators hold the whole total on every rank and stay.
    share: bool


def _synced(result: Any) -> bool:
    return bool(result.is_tensor and result.meta.sync.should and not result.meta.sync.rank_zero_only)


class SyncedLogs:
    """Per-microbatch capture and commit-time write-back of synced logged values; see the module docstring."""

    def __init__(self) -> None:
        self._before: dict[str, _Before] = {}
        self._written: dict[str, _Written] = {}
        self._handed: dict[str, tuple[float, float]] = {}  # totals a replacement received, until their key is logged
        self._world_size = 1

    def start(self, results: Any) -> None:
        """A microbatch begins: remember every synced value as it stands."""
        self._before = {key: self._state(r) for key, r in self._results(results)}

    def capture(self, results: Any) -> dict[str, Values]:
        """What the microbatch since :meth:`start` logged, per synced key (zeros for keys it left alone)."""
        out: dict[str, Values] = {}
        for key, r in self._results(results):
            before = self._before.get(key)
            now = self._state(r)
            step_sum = step_count = 0.0
            if r.meta.on_step and now.forward_cache is not None and (before is None or now.forward_cache is not before.forward_cache):
                step_sum, step_count = float(now.forward_cache), 1.0
            value = weight = 0.0
            if r.meta.on_epoch:
                # A result created in this microbatch started from Lightning's default, 0.
                value = now.value - (before.value if before is not None else 0.0)
                weight = now.weight - (before.weight if before is not None else 0.0)
            out[key] = (step_sum, step_count, value, weight)
        return out

    def begin_step(self, results: Any) -> dict[str, tuple[float, float]]:
        """The epoch totals each synced key starts the step from (0 after Lightning reset the epoch).

        The accumulators restart from zero for the step, so a microbatch's increments are
        exact (float32 increments on top of a large running total would round)."""
        bases = {}
        for key, r in self._results(results):
            bases[key] = self._base(key, r)
            if r.meta.on_epoch:
                r.value = torch.zeros_like(r.value)
                if r.meta.is_mean_reduction:
                    r.cumulated_batch_size = torch.zeros_like(r.cumulated_batch_size)
        return bases

    def apply(self, results: Any, totals: dict[str, Values], bases: dict[str, tuple[float, float]], world_size: int) -> None:
        """Write the step's reduced values back into Lightning's results, on every rank alike."""
        self._world_size = world_size
        for key, (step_sum, step_count, value, weight) in totals.items():
            r = results.get(key) if results is not None else None
            if r is None:
                continue
            if r.meta.on_step and step_count > 0:
                step_value = step_sum / step_count if r.meta.is_mean_reduction else step_sum
                r._forward_cache = torch.tensor(step_value, dtype=r.value.dtype, device=r.value.device)
                if not r.meta.on_epoch:
                    r.value = r._forward_cache
            if r.meta.on_epoch:
                # A key first logged in this step starts from zero, or from the survivors' totals on a replacement.
                base_value, base_weight = bases[key] if key in bases else self._handed.pop(key, (0.0, 0.0))
                self._write(key, r, base_value + value, base_weight + weight)

    def rescale(self, world_size: int) -> None:
        """The world changed between commits: a summed epoch total is again spread over every rank.

        Only sums are shares: a mean's accumulators hold the epoch's whole total on every rank
        (Lightning's epoch-end sync averages identical values), and dividing them left
        ``train_loss_epoch`` divided by the live ranks after a loss in the epoch's last
        validation (issue 34)."""
        self._world_size = world_size
        for w in self._written.values():
            if w.share:
                w.tensor.fill_(w.value / world_size)

    def totals(self, results: Any) -> dict[str, tuple[float, float]]:
        """The epoch's committed totals (value, weight) of every synced key, for a replacement (:meth:`take_over`)."""
        current = dict(self._results(results))
        return {key: (w.value, w.weight) for key, w in self._written.items() if key in current and current[key].value is w.tensor}

    def take_over(self, totals: dict[str, tuple[float, float]]) -> None:
        """A replacement joins mid-epoch: its first commit of each key continues the survivors' totals, not zero
        (a mean's accumulators hold the whole total on every rank, and Lightning averages them over the ranks)."""
        self._handed = dict(totals)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _results(results: Any) -> list[tuple[str, Any]]:
        if results is None:
            return []
        found = [(key, r) for key, r in results.items() if _synced(r)]
        for key, r in found:
            if r.meta.is_max_reduction or r.meta.is_min_reduction:
                raise ConfigurationError(
                    f"self.log({r.meta.name!r}, ..., sync_dist=True, reduce_fx={r.meta.reduce_fx.__name__}) in a training "
                    "step: ReCoVerHSDPStrategy syncs step values as sums over the step's microbatches; use "
                    "reduce_fx='mean' or 'sum', or log a torchmetrics MaxMetric/MinMetric instead"
                )
        return found

    @staticmethod
    def _state(r: Any) -> _Before:
        weight = float(r.cumulated_batch_size) if r.meta.is_mean_reduction else 0.0
        return _Before(r._forward_cache, float(r.value), weight)

    def _base(self, key: str, r: Any) -> tuple[float, float]:
        written = self._written.get(key)
        if written is not None and r.value is written.tensor:
            return written.value, written.weight
        if key in self._handed:
            return self._handed.pop(key)
        # Lightning reset the result (a new epoch) or it is new: start from what it holds.
        return float(r.value), float(r.cumulated_batch_size) if r.meta.is_mean_reduction else 0.0

    def _write(self, key: str, r: Any, value: float, weight: float) -> None:
        # A sum is summed again over the ranks by Lightning's epoch-end sync: store a share.
        stored = value / self._world_size if r.meta.is_sum_reduction else value
        tensor = torch.tensor(stored, dtype=r.value.dtype, device=r.value.device)
        r.value = tensor
        if r.meta.is_mean_reduction:
            r.cumulated_batch_size = torch.tensor(weight, dtype=r.cumulated_batch_size.dtype, device=r.value.device)
        self._written[key] = _Written(tensor, value, weight, share=bool(r.meta.is_sum_reduction))
