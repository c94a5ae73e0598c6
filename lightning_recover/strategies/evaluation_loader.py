"""The loader Lightning iterates for validation, test and predict: this rank's exactly-once share.

It yields this rank's batches of the :class:`~lightning_recover.feed.evaluation.EvaluationPlan`
through a DataLoader built from the user's (same dataset, collate_fn, workers, pinning),
then every live rank agrees that its share is done. If the agreement fails, a replica
died during the evaluation: the world is repaired (the engine accounts it like any
repair), every sample the lost replica answered for is re-split over the survivors, and
the loop goes on with those batches, so metrics cover every sample exactly once.

Limit, documented in docs/lightning.md: Lightning fetches one batch ahead, so the agreement runs
when a rank has *fetched* its last batch; a replica lost while computing that last batch,
or in the epoch-end metric sync, takes its share of the metrics with it (the strategy
prints a warning naming the replica then).

It has no ``__len__`` on purpose: Lightning stops an evaluation loop after ``len`` batches,
which would cut off the batches taken over from a lost replica.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.data import DataLoader

from lightning_recover.comm.interface import RepairResult
from lightning_recover.comm.topology import ReplicaGrid
from lightning_recover.feed.evaluation import Batches, EvaluationPlan


def splittable(dataloader: object) -> bool:
    """A DataLoader over a map-style dataset: evaluation can split it by sample index."""
    dataset = getattr(dataloader, "dataset", None)
    return (
        isinstance(dataloader, torch.utils.data.DataLoader)
        and not isinstance(dataset, torch.utils.data.IterableDataset)
        and hasattr(dataset, "__len__")
    )


class EvaluationLoader:
    """One evaluation loop's data for this rank; see the module docstring."""

    def __init__(
        self,
        dataloader: DataLoader,
        comm: Any,
        shards: int,
        repaired: Callable[[RepairResult], None],
        waiting: Callable[[], AbstractContextManager[None]],
        tensor_parallel: int = 1,
    ) -> None:
        self.dataloader = dataloader
        self.comm = comm
        # Samples are split over the data-parallel ranks only; the TP ranks of one index evaluate the same ones.
        self.grid = ReplicaGrid(shards, tensor_parallel)
        self.shards = self.grid.data_parallel
        self.repaired = repaired
        self.waiting = waiting
        self.dataset = dataloader.dataset
        self.batch_size = int(dataloader.batch_size or 1)
        #: The plan of the latest (or current) pass, for tests and for the warning after a late loss.
        self.plan: EvaluationPlan | None = None

    def _loader(self, batches: Batches) -> DataLoader:
        dl = self.dataloader
        return DataLoader(
            self.dataset,
            batch_sampler=batches,
            num_workers=dl.num_workers,
            collate_fn=dl.collate_fn,
            pin_memory=dl.pin_memory,
            timeout=dl.timeout,
            worker_init_fn=dl.worker_init_fn,
            multiprocessing_context=dl.multiprocessing_context,
            prefetch_factor=dl.prefetch_factor if dl.num_workers > 0 else None,
        )

    def __iter__(self) -> Iterator[Any]:
        comm = self.comm
        self.plan = plan = EvaluationPlan(len(self.dataset), comm.alive_replicas, self.shards, self.batch_size)  # type: ignore[arg-type]
        while True:
            batches = plan.batches(comm.replica, self.grid.data_index(comm.shard))
            if batches:
                yield from self._loader(batches)
            with self.waiting():
                done = comm.agree(True)
            if done:
                return
            with self.waiting():
                res = comm.repair()
            self.repaired(res)
            plan.lose(res.lost_replicas, comm.alive_replicas)


class EvaluationSteps:
    """The strategy's validation, test and predict steps: a fault point per batch, guarded, counted.

    ``probes()``: the job's probes (None before the job starts); ``guard(phase)``: the
    strategy's ``replica_guard``, so a replica-mate's death ends this replica through the gate."""

    def __init__(self, probes: Callable[[], Any], guard: Callable[[str], AbstractContextManager[None]]) -> None:
        self._probes = probes
        self._guard = guard
        self._batches = 0
        #: Inside an evaluation step: ranks evaluate different numbers of batches, so no lockstep collectives.
        self.active = False

    def start(self) -> None:
        """A validation, test or predict loop starts: its batches count from 0."""
        self._batches = 0

    def run(self, phase: str, trainer: Any, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One evaluation batch of this rank's share (:class:`EvaluationLoader`)."""
        probes = self._probes()
        if probes is not None and not trainer.sanity_checking:
            probes.fault_point(phase, step=trainer.global_step, microbatch=self._batches)
            probes.tick()
        self._batches += 1
        self.active = True
        try:
            with self._guard(phase):
                return step_fn(*args, **kwargs)
        finally:
            self.active = False
