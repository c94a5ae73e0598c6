"""Exactly-once evaluation: which samples each live rank validates, tests or predicts.

Stock DDP pads the evaluation set with duplicates so every rank runs the same number of
batches; here every sample is evaluated once. The samples are split into contiguous,
nearly equal ranges over the live replicas, and each replica's range over its S shard
ranks. FSDP's collectives inside a replica need its S ranks to run the same number of
forwards, so with S > 1 every shard rank of a replica gets the same number of batches
(batches then hold at most ``batch_size`` samples, never more, except with
``batch_size=1``, where a shard's part may need two per batch). Ranks of *different*
replicas may run different numbers of batches: nothing collective happens per batch.

When a replica is lost during evaluation, every sample it was responsible for (its first
share and whatever it took over since) is split the same way over the survivors
(:meth:`EvaluationPlan.lose`); every survivor computes the same plan. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_recover.config import ConfigurationError

Batches = list[list[int]]


def _ranges(items: Sequence[int], parts: int) -> list[list[int]]:
    """``items`` in ``parts`` contiguous pieces whose sizes differ by at most one (larger first)."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        size = q + (1 if i < r else 0)
        out.append(list(items[start : start + size]))
        start += size
    return out


def replica_batches(samples: Sequence[int], shards: int, batch_size: int) -> list[Batches]:
    """One replica's ``samples`` as batches per shard rank, every shard rank the same number of batches."""
    if batch_size < 1:
        raise ConfigurationError(f"the evaluation DataLoader's batch_size={batch_size} must be >= 1")
    if not samples:
        return [[] for _ in range(shards)]
    if shards == 1:
        return [[list(samples[i : i + batch_size]) for i in range(0, len(samples), batch_size)]]
    if len(samples) < shards:
        raise ConfigurationError(
            f"{len(samples)} evaluation sample(s) cannot be split over {shards} shard ranks of one replica (each needs "
            "at least one so their FSDP forwards pair up); use an evaluation set of at least recover.shards samples"
        )
    parts = _ranges(samples, shards)
    per_shard = -(-len(samples) // (shards * batch_size))
    per_shard = min(per_shard, min(len(p) for p in parts))
    return [_ranges(p, per_shard) for p in parts]


class EvaluationPlan:
    """Who evaluates what, over a run of one evaluation loop: the first split and the re-splits after losses."""

    def __init__(self, num_samples: int, replicas: Sequence[int], shards: int, batch_size: int) -> None:
        if not replicas:
            raise ValueError("an evaluation plan needs at least one live replica")
        self.shards = shards
        self.batch_size = batch_size
        #: Every sample each replica answers for (its first share plus what it took over).
        self.owned: dict[int, list[int]] = {}
        #: Per replica, the batches of each shard rank still to run (the latest assignment).
        self.todo: dict[int, list[Batches]] = {}
        self._assign(list(range(num_samples)), list(replicas))

    def batches(self, replica: int, shard: int) -> Batches:
        """What ``(replica, shard)`` runs now: its first share, or after :meth:`lose` what it took over."""
        per_shard = self.todo.get(replica)
        return per_shard[shard] if per_shard is not None else []

    def lose(self, lost_replicas: Sequence[int], alive: Sequence[int]) -> None:
        """Hand every sample the lost replicas answered for to the survivors ``alive``."""
        orphaned = sorted(i for r in lost_replicas for i in self.owned.pop(r, []))
        self.todo = {r: [[] for _ in range(self.shards)] for r in alive}
        if orphaned:
            self._assign(orphaned, list(alive))

    def _assign(self, samples: list[int], replicas: list[int]) -> None:
        replicas = sorted(replicas)
        # With S > 1 a replica needs at least S samples (see module docstring): use fewer replicas then.
        receivers = replicas if self.shards == 1 else replicas[: max(1, min(len(replicas), len(samples) // self.shards))]
        for r, part in zip(receivers, _ranges(samples, len(receivers))):
            self.owned.setdefault(r, []).extend(part)
            self.todo[r] = replica_batches(part, self.shards, self.batch_size)
        for r in replicas[len(receivers):]:
            self.owned.setdefault(r, [])
            self.todo[r] = [[] for _ in range(self.shards)]
