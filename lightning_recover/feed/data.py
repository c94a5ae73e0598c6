"""Exactly-once data for the step engine: step tickets in, planned microbatches out.

Lightning's train loop iterates a loader; under the recovery protocol one iteration is one
*optimizer step*, and which samples a replica computes depends on the policy's plan and on
failures inside the step. So the strategy swaps the user's train DataLoader for a
:class:`TicketLoader` yielding one :class:`StepTicket` per step, and identifies each
planned microbatch by its global id through :class:`MicrobatchSource`: the
:class:`~lightning_recover.workload.planner.MicrobatchPlanner` maps (step, step-local id) to a
global id, and the global id to this shard's samples and RNG seed. Any replica computing
id m therefore gets the same samples and the same random numbers. The microbatches are
loaded through the user's DataLoader settings (workers, pinning) by
:class:`~lightning_recover.feed.loading.MicrobatchFeed`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from lightning_recover.config import ConfigurationError
from lightning_recover.feed.loading import Delivered, KeyedCollate, PlannedIndices, SeededDataset
from lightning_recover.workload.planner import MicrobatchPlanner


@dataclass
class StepTicket:
    """What the train loader yields: a placeholder for one optimizer step's microbatches.

    Not frozen: Lightning's loop passes every batch through the precision plugin's
    ``convert_input`` (``apply_to_collection``), which refuses a frozen dataclass, so
    ``precision="bf16-true"`` would fail at the first step."""

    index: int


class TicketLoader:
    """Stands in for the train DataLoader: one ticket per optimizer step of a data epoch.

    ``on_epoch`` runs when Lightning starts iterating an epoch (the feed starts loading
    that epoch's microbatches ahead, see :class:`~lightning_recover.feed.loading.MicrobatchFeed`).
    """

    def __init__(self, steps_per_epoch: int, on_epoch: Callable[[], None] | None = None) -> None:
        self.steps_per_epoch = steps_per_epoch
        self.on_epoch = on_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[StepTicket]:
        if self.on_epoch is not None:
            self.on_epoch()
        return (StepTicket(i) for i in range(self.steps_per_epoch))


class MicrobatchSource:
    """Fetches step-local microbatches of the user's map-style dataset by global id."""

    def __init__(self, dataloader: Any, B: int, shards: int, shard: int, seed: int) -> None:
        dataset = getattr(dataloader, "dataset", None)
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if dataset is None or iterable or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ConfigurationError(
                f"the train dataloader's dataset ({type(dataset).__name__}) is not map-style; lightning-recover fetches "
                "microbatches by id, so the dataset needs __len__ and __getitem__ (an IterableDataset cannot be replayed)"
            )
        batch_size = getattr(dataloader, "batch_size", None)
        if not batch_size:
            raise ConfigurationError("the train DataLoader needs a batch_size (the per-rank microbatch size)")
        self.dataset = dataset
        self.collate: Callable[[list[Any]], Any] = getattr(dataloader, "collate_fn", None) or torch.utils.data.default_collate
        #: What loads a planned microbatch, here or in a loader worker (:mod:`lightning_recover.feed.loading`).
        self.seeded = SeededDataset(dataset)
        self.keyed_collate = KeyedCollate(self.collate)
        self.shard = shard
        self.planner = MicrobatchPlanner(len(dataset), B, batch_size, shards=shards, seed=seed)

    def steps_per_epoch(self) -> int:
        """Optimizer steps in one pass over the dataset (at least one)."""
        p = self.planner
        return max(1, p.samples_per_epoch // (p.B * p.microbatch_size * p.shards))

    def seed_for(self, step: int, offset: int) -> int:
        """The RNG seed of step-local microbatch ``offset`` on this shard (the same on every replica)."""
        return self.planner.rng_seed(self.planner.global_id(step, offset), self.shard)

    def planned_indices(self, step: int, offset: int) -> PlannedIndices:
        """This shard's dataset indices of step-local microbatch ``offset``, tagged with its key and seed."""
        gid = self.planner.global_id(step, offset)
        return PlannedIndices(self.planner.sample_indices(gid, self.shard), (step, offset), self.seed_for(step, offset))

    def load(self, step: int, offset: int) -> Delivered:
        """Load microbatch ``offset`` of ``step`` in this process, exactly as a loader worker would."""
        return self.keyed_collate(self.seeded.__getitems__(self.planned_indices(step, offset)))
