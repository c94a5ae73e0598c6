"""The recruiter's per-boundary decision with salvage (no MPI): when orphans are seated, and whether
the seating may spawn the missing ranks, against a fake communicator."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from lightning_recover.comm.lobby import Lobby
from lightning_recover.comm.topology import RankLayout
from lightning_recover.membership.recruiter import COLD, NOTHING, SEAT_ORPHANS, START, Recruiter
from lightning_recover.membership.standby import Standby


@dataclass
class FakeComm:
    """What the decision reads of the communicator: the layout, the live replicas, the waiting orphans."""

    layout: RankLayout
    alive_replicas: tuple[int, ...]
    lobbies: list[Lobby] = field(default_factory=list)
    is_leader: bool = True

    def orphan_host(self, rank: int) -> str:
        return "h0"


def recruiter(comm: FakeComm, *, spawn: bool, standbys: int = 0) -> Recruiter:
    return Recruiter(comm, hosts=None, attempts=3, backoff_s=5.0, timeout_s=60.0, argv=["train.py"], shards=comm.layout.shards,
                     spawn=spawn, standbys=standbys)  # type: ignore[arg-type]


def warm_standby(number: int, shards: int) -> Standby:
    return Standby(number, warm=set(range(1, shards + 1)))


def orphans(*ranks: int, epoch: int = 1) -> Lobby:
    return Lobby(comm=None, orphans=list(ranks), logical=tuple(ranks), world_epoch=epoch)


@pytest.mark.parametrize("spawn", [False, True])
def test_orphans_that_complete_each_other_are_seated_alone_with_or_without_rejoin(spawn: bool) -> None:
    # 3 x 2: replica 1 lost shard 0 (orphan 3 holds shard 1), replica 2 lost shard 1 (orphan 4 holds shard 0).
    comm = FakeComm(RankLayout(6, 2), (0,), [orphans(3), orphans(4, epoch=2)])
    r = recruiter(comm, spawn=spawn)
    assert r.active()
    assert r._decide(can_admit=True) == (SEAT_ORPHANS, 1, int(spawn))
    plan = r._reformation(spawn=False, seats=(1,))
    assert plan is not None and plan.spawned_shards == () and [m.rank for m in plan.orphans] == [4, 3]


def test_with_rejoin_a_lone_orphan_is_seated_with_its_missing_rank_spawned() -> None:
    comm = FakeComm(RankLayout(4, 2), (0,), [orphans(2)])
    r = recruiter(comm, spawn=True)
    assert r._decide(can_admit=True) == (SEAT_ORPHANS, 1, 1)
    plan = r._reformation(spawn=True, seats=(1,))
    assert plan is not None and plan.replica == 1 and plan.spawned_shards == (1,)
    assert [m.rank for m in plan.orphans] == [2]


def test_without_rejoin_a_lone_orphan_waits() -> None:
    comm = FakeComm(RankLayout(4, 2), (0,), [orphans(2)])
    r = recruiter(comm, spawn=False)
    assert not r.active() and r._decide(can_admit=True) == (NOTHING, COLD, 0)


def test_during_backoff_nothing_is_spawned_not_even_to_complete_orphans() -> None:
    comm = FakeComm(RankLayout(4, 2), (0,), [orphans(2)])
    r = recruiter(comm, spawn=True)
    r._next_try = time.monotonic() + 60.0  # a failed attempt's backoff
    assert r._decide(can_admit=True) == (NOTHING, COLD, 0)
    r._next_try = 0.0
    r.failures_in_a_row = r.attempts  # re-join gave up: orphans alone only, and these cannot form a replica
    assert not r.active(), "no decision at the boundary"


def test_a_lost_replica_with_no_orphan_is_spawned_whole() -> None:
    comm = FakeComm(RankLayout(4, 2), (0,))
    assert recruiter(comm, spawn=True)._decide(can_admit=True) == (START, COLD, 0)


def test_a_steady_boundary_does_not_list_the_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every replica live: the answer comes from a count, never from a pass over the layout's replicas.
    comm = FakeComm(RankLayout(20_000, 2), tuple(range(10_000)))
    r = recruiter(comm, spawn=True)

    def listing(self: Recruiter) -> tuple[int, ...]:
        raise AssertionError("missing was listed on a steady boundary")

    monkeypatch.setattr(Recruiter, "missing", property(listing))
    assert not r.active()


def test_salvage_without_rejoin_after_a_whole_replica_lost_does_not_list_the_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    # Salvage on, re-join off: replica 3 lost whole, no orphan waits. Every later step asks the recruiter;
    # with nothing to plan, the answer must not cost a pass over the replicas.
    comm = FakeComm(RankLayout(20_000, 2), tuple(r for r in range(10_000) if r != 3))
    r = recruiter(comm, spawn=False)

    def listing(self: Recruiter) -> tuple[int, ...]:
        raise AssertionError("missing was listed with no orphan waiting")

    monkeypatch.setattr(Recruiter, "missing", property(listing))
    assert not r.active()


def test_orphans_take_a_seat_no_standby_serves_and_every_survivor_seats_the_same_orphans() -> None:
    # 3 x 2: replica 1 lost whole (a standby is seated on it), replica 2 lost shard 1 (orphan 4 holds shard 0).
    comm = FakeComm(RankLayout(6, 2), (0,), [orphans(4)])
    leader = recruiter(comm, spawn=True, standbys=1)
    sb = warm_standby(1, 2)
    sb.replica = 1
    leader.seated.append(sb)
    code, seat, spawn = leader._decide(can_admit=True)
    assert (code, seat, spawn) == (SEAT_ORPHANS, 2, 1), "the standby's seat is not given to the orphans"
    # Another survivor has no standbys: from the broadcast seat alone it plans the same re-formation.
    other = recruiter(FakeComm(RankLayout(6, 2), (0,), [orphans(4)], is_leader=False), spawn=True)
    plan = other._reformation(spawn=bool(spawn), seats=(seat,))
    assert plan is not None and plan.replica == 2 and [m.rank for m in plan.orphans] == [4] and plan.spawned_shards == (1,)


def test_a_warm_standby_is_seated_on_a_replica_lost_whole_not_on_one_orphans_re_form(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 x 2: replica 1 lost shard 1 (orphan 2 waits), replica 2 lost whole; two warm standbys idle.
    comm = FakeComm(RankLayout(6, 2), (0,), [orphans(2)])
    leader = recruiter(comm, spawn=True, standbys=2)
    leader.pool = [warm_standby(1, 2), warm_standby(2, 2)]
    seated: list[tuple[int, int]] = []
    monkeypatch.setattr(leader, "_seat", lambda sb, replica: seated.append((sb.number, replica)))
    assert leader.orphans_will_seat() == {1}
    leader._seat_idle_standbys()
    assert seated == [(1, 2)], "orphan 2 and a spawned rank re-form replica 1; the standby serves replica 2"
    assert leader._decide(can_admit=True) == (SEAT_ORPHANS, 1, 1)


def test_a_steady_boundary_seats_no_standby_without_listing_the_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    comm = FakeComm(RankLayout(20_000, 2), tuple(range(10_000)))
    leader = recruiter(comm, spawn=True, standbys=1)
    leader.pool = [warm_standby(1, 2)]

    def listing(self: Recruiter) -> tuple[int, ...]:
        raise AssertionError("missing was listed on a steady boundary")

    monkeypatch.setattr(Recruiter, "missing", property(listing))
    leader._seat_idle_standbys()
