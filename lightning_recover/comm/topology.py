"""Rank layout of an HSDP job: W replicas x S shard ranks (a replica: data parallel x tensor parallel).

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


@dataclass(frozen=True)
class ReplicaGrid:
    """A replica's ``shards`` ranks as a 2-D grid: ``shards // tensor_parallel`` data-parallel x ``tensor_parallel``.

    Shard ``s`` (the rank inside the replica) sits at data-parallel index ``s // tensor_parallel``
    and tensor-parallel index ``s % tensor_parallel``: the row-major order in which
    ``init_device_mesh(..., (dp, tp))`` lays out the replica's ranks, so the TP ranks of one
    data-parallel index are neighbours (one host's GPUs). Only the data-parallel index picks
    samples; the TP ranks of one index see the same ones.
    """

    shards: int
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.shards % self.tensor_parallel:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} does not divide shards={self.shards}; "
                "set recover.tensor_parallel to a divisor of recover.shards"
            )

    @property
    def data_parallel(self) -> int:
        return self.shards // self.tensor_parallel

    def data_index(self, shard: int) -> int:
        """The data-parallel index of ``shard``: which slice of a microbatch it computes."""
        self._check(shard)
        return shard // self.tensor_parallel

    def tensor_index(self, shard: int) -> int:
        """The tensor-parallel index of ``shard``: which part of each parallelized layer it holds."""
        self._check(shard)
        return shard % self.tensor_parallel

    def _check(self, shard: int) -> None:
        if not 0 <= shard < self.shards:
            raise ValueError(f"shard {shard} out of range 0..{self.shards - 1}")
