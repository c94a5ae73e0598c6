"""The recruiter's per-boundary decision with salvage (no MPI): when orphans are seated, and whether
the seating may spawn the missing ranks, against a fake communicator."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from lightning_recover.comm.lobby import Lobby
from lightning_recover.comm.topology import RankLayout
from lightning_recover.membership.recruiter import COLD, NOTHING, SEAT_ORPHANS, START, Recruiter


@dataclass
class FakeComm:
    """What the decision reads of the communicator: the layout, the live replicas, the waiting orphans."""

    layout: RankLayout
    alive_replicas: tuple[int, ...]
    lobbies: list[Lobby] = field(default_factory=list)
    is_leader: bool = True

    def orphan_host(self, rank: int) -> str:
        return "h0"


def recruiter(comm: FakeComm, *, spawn: bool) -> Recruiter:
    return Recruiter(comm, hosts=None, attempts=3, backoff_s=5.0, timeout_s=60.0, argv=["train.py"], shards=comm.layout.shards,
                     spawn=spawn)  # type: ignore[arg-type]


def orphans(*ranks: int, epoch: int = 1) -> Lobby:
    return Lobby(comm=None, orphans=list(ranks), logical=tuple(ranks), world_epoch=epoch)


@pytest.mark.parametrize("spawn", [False, True])
def test_orphans_that_complete_each_other_are_seated_alone_with_or_without_rejoin(spawn: bool) -> None:
    # 3 x 2: replica 1 lost shard 0 (orphan 3 holds shard 1), replica 2 lost shard 1 (orphan 4 holds shard 0).
    comm = FakeComm(RankLayout(6, 2), (0,), [orphans(3), orphans(4, epoch=2)])
    r = recruiter(comm, spawn=spawn)
    assert r.active()
    assert r._decide(can_admit=True) == (SEAT_ORPHANS, int(spawn))
    assert r._reformation(spawn=False) is not None and r._reformation(spawn=False).spawned_shards == ()


def test_with_rejoin_a_lone_orphan_is_seated_with_its_missing_rank_spawned() -> None:
    comm = FakeComm(RankLayout(4, 2), (0,), [orphans(2)])
    r = recruiter(comm, spawn=True)
    assert r._decide(can_admit=True) == (SEAT_ORPHANS, 1)
    plan = r._reformation(spawn=True)
    assert plan is not None and plan.replica == 1 and plan.spawned_shards == (1,)
    assert [m.rank for m in plan.orphans] == [2]


def test_without_rejoin_a_lone_orphan_waits() -> None:
    comm = FakeComm(RankLayout(4, 2), (0,), [orphans(2)])
    r = recruiter(comm, spawn=False)
    assert not r.active() and r._decide(can_admit=True) == (NOTHING, COLD)


def test_during_backoff_nothing_is_spawned_not_even_to_complete_orphans() -> None:
    comm = FakeComm(RankLayout(4, 2), (0,), [orphans(2)])
    r = recruiter(comm, spawn=True)
    r._next_try = time.monotonic() + 60.0  # a failed attempt's backoff
    assert r._decide(can_admit=True) == (NOTHING, COLD)
    r._next_try = 0.0
    r.failures_in_a_row = r.attempts  # re-join gave up: orphans alone only, and these cannot form a replica
    assert not r.active(), "no decision at the boundary"


def test_a_lost_replica_with_no_orphan_is_spawned_whole() -> None:
    comm = FakeComm(RankLayout(4, 2), (0,))
    assert recruiter(comm, spawn=True)._decide(can_admit=True) == (START, COLD)


def test_a_steady_boundary_does_not_list_the_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every replica live: the answer comes from a count, never from a pass over the layout's replicas.
    comm = FakeComm(RankLayout(20_000, 2), tuple(range(10_000)))
    r = recruiter(comm, spawn=True)

    def listing(self: Recruiter) -> tuple[int, ...]:
        raise AssertionError("missing was listed on a steady boundary")

    monkeypatch.setattr(Recruiter, "missing", property(listing))
    assert not r.active()
