"""Gradient buckets and their world-epoch tags: what ReCoVer's in-step recovery keeps of a reduction.

Part of the communicator contract (the collectives fill the buckets, in-step recovery judges them), so it lives
beside :mod:`lightning_recover.comm.interface`.

A step's cross-replica reduction is cut into buckets. Each bucket records the **world
epoch** (the membership generation, bumped by every repair; not a data epoch and not
Lightning's ``current_epoch``) it completed in. After a repair, a bucket tagged with an
older world epoch is *stale*: its sum includes a replica that is gone, so it is rolled back
to the local gradient and reduced again. A step commits only when every bucket carries the
current world epoch. Pure Python: no MPI, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Bucket:
    """Element ranges ``(tensor index, start, stop)`` reduced together, and the world epoch they completed in."""

    segments: list[tuple[int, int, int]]
    numel: int
    world_epoch: int | None = None


@dataclass
class ReduceHandle:
    """Progress of one bucketed reduction; pass it back to ``allreduce`` to resume after a repair.

    It holds no copy of the data: the reduction is out of place, its inputs stay intact.
    """

    buckets: list[Bucket]

    def stale(self, world_epoch: int) -> list[int]:
        """Indices of buckets that completed under a world epoch other than ``world_epoch``."""
        return [i for i, b in enumerate(self.buckets) if b.world_epoch is not None and b.world_epoch != world_epoch]

    def pending(self, world_epoch: int) -> list[int]:
        """Buckets still to (re)do in ``world_epoch``: never completed, or stale."""
        return [i for i, b in enumerate(self.buckets) if b.world_epoch != world_epoch]

    def complete(self, world_epoch: int) -> bool:
        return not self.pending(world_epoch)


def plan_buckets(sizes: Sequence[int], bucket_numel: int) -> list[Bucket]:
    """Split tensors of ``sizes`` elements into buckets of at most ``bucket_numel`` elements.

    Small tensors share a bucket; a tensor larger than a bucket is cut into chunks so a
    chunk can be reduced straight from the tensor's memory.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must hold at least one element, got {bucket_numel}")
    buckets: list[Bucket] = []
    cur: list[tuple[int, int, int]] = []
    cur_n = 0
    for idx, n in enumerate(sizes):
        start = 0
        while start < n:
            take = min(n - start, bucket_numel - cur_n)
            cur.append((idx, start, start + take))
            cur_n += take
            start += take
            if cur_n == bucket_numel:
                buckets.append(Bucket(cur, cur_n))
                cur, cur_n = [], 0
    if cur:
        buckets.append(Bucket(cur, cur_n))
    return buckets
