"""Salvage, pure: which orphans re-form which lost replicas, and what must be spawned to complete them.

An *orphan* is a live rank whose replica lost a mate: the replica-consistency gate takes it
out of the world (the survivors still only ever see whole replicas), but its process stays,
fenced, and waits with its shard index. At a step boundary the leader plans, from the orphans
waiting and the replicas the job lacks, the *re-formations*: each seats one lost replica from
orphans whose shard indices complete one another, plus -- when re-join is on -- spawned
ranks for the shard indices no orphan holds. Every survivor can compute the same plan from
the same agreed inputs; nothing here talks to MPI.

The rule (docs/salvage.md):

1. A re-formed replica takes the seat of the lowest lost replica still missing; its rank of
   shard ``s`` becomes that seat's logical rank of shard ``s``.
2. Whole replicas from orphans alone come first, **one host before several**: a set of orphans
   on one host that holds every shard index forms a replica there (its in-replica traffic --
   the FSDP all-gathers and reduce-scatters, tensor parallel -- stays on that host's links);
   only then do orphans of different hosts form replicas that span hosts. Within either,
   the orphans that waited longest go first (their wait timers run out first).
3. With re-join on, each replica still missing that some orphans can partly fill is completed
   with spawned ranks: the host holding the most distinct shard indices among its orphans gives
   them, and only the missing shard indices are spawned (1 process, not S, for one lost GPU).
   A lost replica no orphan can help is left to an ordinary whole-replica spawn.
4. An orphan that no re-formation uses waits on (until its timer ends it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Orphan", "Reformation", "plan_reformations"]


@dataclass(frozen=True, order=True)
class Orphan:
    """A waiting rank of a broken replica: ``since`` (the world epoch it was orphaned at) sorts first,
    so that the orphans that waited longest are taken first; ``rank`` is the logical rank it held."""

    since: int
    rank: int
    shard: int
    host: str


@dataclass(frozen=True)
class Reformation:
    """One lost replica seated again: by shard index, the orphan that takes that rank, or ``None`` for a
    rank to spawn."""

    replica: int
    members: tuple[Orphan | None, ...]

    @property
    def spawned_shards(self) -> tuple[int, ...]:
        """The shard indices no orphan fills: processes to spawn (empty: orphans alone)."""
        return tuple(s for s, m in enumerate(self.members) if m is None)

    @property
    def orphans(self) -> tuple[Orphan, ...]:
        return tuple(m for m in self.members if m is not None)

    @property
    def hosts(self) -> tuple[str, ...]:
        """The hosts its orphans run on (sorted, distinct): one host, or a replica that spans hosts."""
        return tuple(sorted({m.host for m in self.orphans}))


def plan_reformations(
    orphans: Iterable[Orphan], missing: Iterable[int], shards: int, *, spawn: bool = False
) -> list[Reformation]:
    """The re-formations for this boundary (the module's rule), in the order of the seats they take.

    ``orphans``: the orphans waiting; ``missing``: the lost replicas the job may seat again;
    ``shards``: S, the ranks of a replica; ``spawn``: whether re-join may spawn ranks to complete
    a replica. The result does not depend on the order of the inputs.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    pool = sorted(set(orphans))
    for o in pool:
        if not 0 <= o.shard < shards:
            raise ValueError(f"orphan of rank {o.rank} has shard {o.shard}, outside 0..{shards - 1}")
    if len({o.rank for o in pool}) != len(pool):
        raise ValueError(f"an orphan appears twice with different details: {pool}")
    seats = sorted(set(missing))
    plans: list[Reformation] = []

    def seat(members: Sequence[Orphan | None]) -> None:
        plans.append(Reformation(seats.pop(0), tuple(members)))
        for m in members:
            if m is not None:
                pool.remove(m)

    # Rule 2: whole replicas on one host, then across hosts.
    for host in sorted({o.host for o in pool}):
        while seats and (found := _complete([o for o in pool if o.host == host], shards)) is not None:
            seat(found)
    while seats and (found := _complete(pool, shards)) is not None:
        seat(found)
    # Rule 3: complete a replica with spawned ranks, from the host whose orphans cover the most shards.
    while spawn and seats and pool:
        host = max(sorted({o.host for o in pool}), key=lambda h: len({o.shard for o in pool if o.host == h}))
        seat(_partial([o for o in pool if o.host == host], shards))
    return plans


def _complete(pool: Sequence[Orphan], shards: int) -> list[Orphan | None] | None:
    """The longest-waiting orphan of every shard index, or None when some index has none."""
    by_shard = _first_by_shard(pool)
    if len(by_shard) < shards:
        return None
    return [by_shard[s] for s in range(shards)]


def _partial(pool: Sequence[Orphan], shards: int) -> list[Orphan | None]:
    by_shard = _first_by_shard(pool)
    return [by_shard.get(s) for s in range(shards)]


def _first_by_shard(pool: Sequence[Orphan]) -> dict[int, Orphan]:
    found: dict[int, Orphan] = {}
    for o in sorted(pool):
        found.setdefault(o.shard, o)
    return found
