"""The loader Lightning iterates for training: one step ticket per optimizer step.

Lightning's fit loop iterates a :class:`~lightning_recover.feed.data.TicketLoader` instead of
the user's train DataLoader; the microbatches themselves are identified by global id
(:class:`~lightning_recover.feed.data.MicrobatchSource`, whose planner fixes the sample order)
and loaded ahead with the user's loader settings (workers, pinning) as the step engine's
plan drives them (:class:`~lightning_recover.feed.loading.MicrobatchFeed`). A resume or a
re-join continues the sample order from the job's protocol state.
"""

from __future__ import annotations

from typing import Any

from lightning_recover.comm.topology import ReplicaGrid
from lightning_recover.feed.data import MicrobatchSource, TicketLoader
from lightning_recover.feed.loading import EnginePlan, MicrobatchFeed
from lightning_recover.recovery.job import RecoveryJob

__all__ = ["ticket_loader"]


def ticket_loader(
    dataloader: Any, job: RecoveryJob, previous: MicrobatchFeed | None, max_steps: int | None
) -> tuple[MicrobatchSource, MicrobatchFeed, TicketLoader]:
    """The training data of ``dataloader`` for ``job``: its microbatch source, the feed loading ahead
    (``previous``, the last fit's, is closed) and the tickets Lightning iterates, up to ``max_steps``."""
    assert job.policy is not None and job.comm is not None and job.engine is not None
    c = job.config
    # Only the data-parallel index picks samples: the TP ranks of one index compute the same ones.
    grid = ReplicaGrid(c.shards, c.tensor_parallel)
    data = MicrobatchSource(dataloader, job.policy.B, grid.data_parallel, grid.data_index(job.comm.shard), c.seed)
    if job.resumed is not None:
        data.planner.load_state_dict(job.resumed["planner"])
    if previous is not None:
        previous.close()
    # The user's loader settings (workers, pinning) load the planned microbatches ahead.
    feed = MicrobatchFeed(data, dataloader, EnginePlan(job.engine, lambda: data.planner.next_step))
    steps = data.steps_per_epoch()

    def start_epoch() -> None:
        first = data.planner.next_step
        end = first + steps if max_steps is None or max_steps < 0 else min(first + steps, max_steps)
        feed.start_epoch(first, end)

    return data, feed, TicketLoader(steps, on_epoch=start_epoch)
