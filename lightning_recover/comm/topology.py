"""Rank layout of an HSDP job: W replicas x S shard ranks.

A *replica* (the S ranks that together hold one full model copy) is the unit that
fails and recovers. Everything in the recovery protocol speaks in ORIGINAL world ranks
and ORIGINAL replica indices, which never change when the world shrinks; this module is
the one place that maps between them. Pure arithmetic: no MPI, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    """World rank ``r`` is shard ``r % shards`` of replica ``r // shards``."""

    world_size: int
    shards: int = 1

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}; set recover.shards to a positive integer")
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.world_size % self.shards:
            raise ValueError(
                f"world size {self.world_size} is not divisible by shards={self.shards}; "
                f"launch a multiple of {self.shards} ranks or change recover.shards"
            )

    @property
    def replicas(self) -> int:
        return self.world_size // self.shards

    def replica_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.shards

    def shard_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.shards

    def rank_of(self, replica: int, shard: int) -> int:
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica} out of range 0..{self.replicas - 1}")
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} out of range 0..{self.shards - 1}")
        return replica * self.shards + shard

    def ranks_of_replica(self, replica: int) -> tuple[int, ...]:
        return tuple(self.rank_of(replica, s) for s in range(self.shards))

    def replicas_touched(self, ranks: Iterable[int]) -> set[int]:
        """Replicas that contain any of ``ranks`` (a replica with one dead rank is lost whole)."""
        return {self.replica_of(r) for r in ranks}

    def complete_replicas(self, ranks: Iterable[int]) -> list[int]:
        """Replicas all of whose shard ranks are in ``ranks``, ascending."""
        present = set(ranks)
        return [p for p in range(self.replicas) if all(r in present for r in self.ranks_of_replica(p))]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
