"""torchmetrics states updated inside a step: their increments summed exactly once per microbatch, at the commit.

A ``Metric`` updated in ``training_step`` (a ``MeanMetric`` of the loss, a ``Perplexity``)
accumulates on each rank what that rank computed. Under the recovery protocol that is not
the fault-free run's epoch: a lost replica takes its share of the epoch with it, survivors
replay its microbatches of the step it died in, spares shadow contributors. So, like the
values logged with ``sync_dist=True`` (:mod:`.synced_logs`), each microbatch's increment of
every state the metric sums across ranks (``dist_reduce_fx="sum"`` or ``"mean"``, a tensor)
is recorded for the commit's reduction (:mod:`lightning_recover.recovery.step_values`),
which adds up the step's B owned microbatches exactly once each over every live rank. At
the commit every rank learns the epoch's running total of each state; the world's rank 0
holds it and every other rank zero (a "mean" state: every rank the total), so the sync
Lightning runs when it computes the metric at the epoch's end (over the live replicas,
:func:`~.metrics.route_metric_sync`) gives the fault-free total whatever was lost and when.
After a change of world the new rank 0 takes the totals over (:meth:`StepMetrics.rehome`); a
replacement that joins mid-epoch receives them with the live state (:meth:`StepMetrics.take_over`).

States kept any other way (``"cat"`` lists, ``"min"``/``"max"``, a custom reduction) cannot
be summed like this: such a metric is left as torchmetrics keeps it, and a warning says its
epoch value may differ from a fault-free run's after a loss. A metric updated only outside
training steps (in ``validation_step``) never has an increment here and is left alone.

Reads two private members of torchmetrics' ``Metric`` through :mod:`lightning_recover._lightning`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_recover import _lightning
from lightning_recover.recovery.step_values import Values

__all__ = ["PREFIX", "StepMetrics"]

#: The logged-key prefix of a metric state's elements in the commit's reduction.
PREFIX = "\x00torchmetrics:"
#: Elements per module above which metric states are left alone (the reduction carries 4 numbers per element).
MAX_ELEMENTS = 4096
_SUMMED = ("sum", "mean")


@dataclass
class _State:
    key: str  # "<module path>.<state>"
    metric: Any
    name: str
    mean: bool  # dist_reduce_fx="mean": every rank holds the total (else rank 0 holds it, the others zero)


class StepMetrics:
    """The commit-time bookkeeping of the torchmetrics states of one LightningModule; see the module docstring."""

    def __init__(self) -> None:
        self._states: list[_State] | None = None
        self._module: Any = None
        self._before: dict[str, Tensor] = {}
        self._bases: dict[str, Tensor | None] = {}
        #: The running totals (float64) of the states written at the last commit, and the tensors written.
        self._totals: dict[str, Tensor] = {}
        self._written: dict[str, Tensor] = {}

    def _tracked(self, module: Any) -> list[_State]:
        if self._states is not None and module is self._module:
            return self._states
        from torchmetrics import Metric

        self._module, states, left, elements = module, [], [], 0
        for path, m in module.named_modules() if module is not None else ():
            if not isinstance(m, Metric):
                continue
            reductions = _lightning.metric_reductions(m)
            names = list(m.metric_state)
            summed = all(
                isinstance(getattr(m, n), Tensor) and _fx_name(reductions.get(n)) in _SUMMED for n in names
            )
            size = sum(getattr(m, n).numel() for n in names if isinstance(getattr(m, n), Tensor))
            if not summed or elements + size > MAX_ELEMENTS:
                left.append(path or type(m).__name__)
                continue
            elements += size
            states += [_State(f"{path}.{n}", m, n, _fx_name(reductions.get(n)) == "mean") for n in names]
        if left:
            rank_zero_warn(
                f"torchmetrics {', '.join(left)}: a state kept as a list, a min/max or a custom reduction (or more than "
                f"{MAX_ELEMENTS} summed elements) is not recovered after a lost replica; if updated in training_step, its "
                "epoch value may then differ from a fault-free run's (lightning-recover: docs/lightning.md#metrics)"
            )
        self._states = states
        return states

    def begin_step(self, module: Any) -> None:
        """A step begins: a state this bookkeeping wrote restarts from zero (its total is kept), for exact increments."""
        self._bases = {}
        for st in self._tracked(module):
            now = getattr(st.metric, st.name)
            if self._written.get(st.key) is now:
                self._bases[st.key] = self._totals[st.key]
                setattr(st.metric, st.name, torch.zeros_like(now))
            else:
                self._bases[st.key] = None  # new, or reset by Lightning at an epoch's end: nothing carried

    def start(self, module: Any) -> None:
        """A microbatch begins: remember every state as it stands."""
        self._before = {st.key: getattr(st.metric, st.name).detach().clone() for st in self._tracked(module)}

    def capture(self, module: Any) -> dict[str, Values]:
        """What the microbatch since :meth:`start` added to every state, one key per element."""
        out: dict[str, Values] = {}
        for st in self._tracked(module):
            now = getattr(st.metric, st.name).detach()
            before = self._before.get(st.key)
            delta = (now.double() - before.double()) if before is not None else torch.zeros(now.shape, dtype=torch.float64)
            for i, d in enumerate(delta.reshape(-1).tolist()):
                out[f"{PREFIX}{st.key}[{i}]"] = (0.0, 0.0, d, 0.0)
        return out

    def apply(self, module: Any, totals: dict[str, Values], leader: bool) -> None:
        """The step committed: every state becomes the epoch's total so far (rank 0 holds it), on every rank alike."""
        for st in self._tracked(module):
            now = getattr(st.metric, st.name)
            step = torch.tensor(
                [totals.get(f"{PREFIX}{st.key}[{i}]", (0.0, 0.0, 0.0, 0.0))[2] for i in range(now.numel())], dtype=torch.float64
            ).reshape(now.shape)
            base = self._bases.get(st.key)
            if base is None and not bool(step.any()):
                continue  # not updated in training steps (a validation metric): leave it as torchmetrics keeps it
            self._totals[st.key] = step if base is None else base + step
            self._write(st, leader)

    def rehome(self, module: Any, leader: bool) -> None:
        """The world changed: the new rank 0 holds the totals, every other rank zero."""
        for st in self._tracked(module):
            if self._written.get(st.key) is getattr(st.metric, st.name):
                self._write(st, leader)

    def totals(self, module: Any) -> dict[str, list[float]]:
        """The epoch's committed totals of every state still as written, for a replacement (:meth:`take_over`)."""
        return {
            st.key: self._totals[st.key].reshape(-1).tolist()
            for st in self._tracked(module) if self._written.get(st.key) is getattr(st.metric, st.name)
        }

    def take_over(self, module: Any, totals: dict[str, list[float]], leader: bool) -> None:
        """A replacement joins mid-epoch: it holds the survivors' totals (as rank 0 would, should it become it)."""
        for st in self._tracked(module):
            if st.key in totals:
                now = getattr(st.metric, st.name)
                self._totals[st.key] = torch.tensor(totals[st.key], dtype=torch.float64).reshape(now.shape)
                self._write(st, leader)

    def _write(self, st: _State, leader: bool) -> None:
        now = getattr(st.metric, st.name)
        total = self._totals[st.key]
        value = total if (leader or st.mean) else torch.zeros_like(total)
        tensor = value.to(dtype=now.dtype, device=now.device)
        setattr(st.metric, st.name, tensor)
        self._written[st.key] = tensor
        _lightning.forget_computed(st.metric)


def _fx_name(fx: Any) -> str | None:
    """torchmetrics keeps "sum"/"mean"/"cat"/"min"/"max" as its dim_zero_* functions, None or a callable."""
    name = getattr(fx, "__name__", None)
    if name is None:
        return None
    return {"dim_zero_sum": "sum", "dim_zero_mean": "mean"}.get(name, name)
