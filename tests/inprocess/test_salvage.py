"""The salvage planner (membership/salvage.py): which orphans re-form which lost replicas, exhaustively."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_recover.membership.salvage import Orphan, plan_reformations

HOSTS = ("a", "b", "c")


@st.composite
def situations(draw: st.DrawFn) -> tuple[list[Orphan], list[int], int]:
    shards = draw(st.integers(1, 4))
    replicas = draw(st.integers(1, 8))
    ranks = draw(st.sets(st.integers(0, replicas * shards - 1), max_size=replicas * shards))
    orphans = [Orphan(draw(st.integers(0, 5)), r, r % shards, draw(st.sampled_from(HOSTS))) for r in sorted(ranks)]
    missing = sorted(draw(st.sets(st.integers(0, replicas - 1))))
    return orphans, missing, shards


@settings(max_examples=500, deadline=None)
@given(situations(), st.booleans(), st.randoms(use_true_random=False))
def test_a_plan_seats_lost_replicas_lowest_first_with_each_orphan_once(situation, spawn: bool, rnd: random.Random) -> None:
    orphans, missing, shards = situation
    plans = plan_reformations(orphans, missing, shards, spawn=spawn)
    assert [p.replica for p in plans] == sorted(missing)[: len(plans)], "the lowest seats, each once, in order"
    used = [o for p in plans for o in p.orphans]
    assert len(used) == len(set(used)) and set(used) <= set(orphans)
    for p in plans:
        assert len(p.members) == shards and p.orphans, "every re-formation holds S ranks, at least one an orphan"
        assert all(m is None or m.shard == s for s, m in enumerate(p.members)), "rank of shard s from an orphan of shard s"
    # The order of the inputs does not matter: every survivor computes the same plan.
    shuffled = orphans[:]
    rnd.shuffle(shuffled)
    assert plan_reformations(shuffled, reversed(missing), shards, spawn=spawn) == plans


@settings(max_examples=300, deadline=None)
@given(situations(), st.booleans(), st.data())
def test_the_first_plans_orphans_do_not_depend_on_the_seats_offered(situation, spawn: bool, data: st.DataObject) -> None:
    # The recruiter relies on it: the leader plans over the lost replicas no standby serves and broadcasts
    # only the seat; every other survivor plans over that one seat and must seat the same orphans.
    orphans, missing, shards = situation
    if not missing:
        return
    offered = data.draw(st.lists(st.sampled_from(missing), min_size=1, unique=True))
    first = plan_reformations(orphans, offered, shards, spawn=spawn)
    alone = plan_reformations(orphans, [missing[0]], shards, spawn=spawn)
    assert [p.members for p in first[:1]] == [p.members for p in alone]
    assert all(p.replica == min(offered) for p in first[:1])


@settings(max_examples=500, deadline=None)
@given(situations())
def test_orphans_alone_form_as_many_whole_replicas_as_their_shards_allow_one_host_first(situation) -> None:
    orphans, missing, shards = situation
    plans = plan_reformations(orphans, missing, shards)
    assert all(not p.spawned_shards for p in plans), "nothing is spawned with re-join off"
    per_shard = Counter(o.shard for o in orphans)
    assert len(plans) == min(len(missing), min(per_shard[s] for s in range(shards)))
    # One host before several: as many single-host replicas as the hosts' own orphans allow.
    on_one_host = sum(min(sum(o.host == h and o.shard == s for o in orphans) for s in range(shards)) for h in HOSTS)
    assert sum(len(p.hosts) == 1 for p in plans) == min(len(missing), on_one_host)
    single = [p for p in plans if len(p.hosts) == 1]
    assert plans[: len(single)] == single, "single-host re-formations take the first seats"


@settings(max_examples=500, deadline=None)
@given(situations())
def test_with_rejoin_every_seat_some_orphan_can_help_is_completed_by_spawning_only_the_missing_ranks(situation) -> None:
    orphans, missing, shards = situation
    alone = plan_reformations(orphans, missing, shards)
    plans = plan_reformations(orphans, missing, shards, spawn=True)
    assert plans[: len(alone)] == alone, "whole replicas from orphans come before spawned completions"
    used = {o for p in plans for o in p.orphans}
    assert len(plans) == len(missing) or used == set(orphans), "a seat is left only when no orphan is left"
    for p in plans[len(alone):]:
        assert len(p.hosts) == 1, "a completed replica takes its orphans from one host"
        assert len(p.spawned_shards) == shards - len(p.orphans)


def test_the_issue_example_two_broken_replicas_make_one_whole_replica() -> None:
    # 3 replicas x 2 shards: replica 1 lost shard 0 (rank 2), replica 2 lost shard 1 (rank 5).
    orphans = [Orphan(1, 3, 1, "a"), Orphan(2, 4, 0, "a")]
    (plan,) = plan_reformations(orphans, [1, 2], 2)
    assert plan.replica == 1 and plan.members == (orphans[1], orphans[0]) and plan.spawned_shards == ()
    # With re-join on and one kill in a 2 x 2 job: one process is spawned, not two.
    (plan,) = plan_reformations([Orphan(1, 3, 1, "a")], [1], 2, spawn=True)
    assert plan.replica == 1 and plan.spawned_shards == (0,) and plan.orphans == (Orphan(1, 3, 1, "a"),)


def test_the_longest_waiting_orphans_go_first() -> None:
    old, new = Orphan(1, 5, 1, "a"), Orphan(4, 3, 1, "a")
    (plan,) = plan_reformations([new, Orphan(2, 4, 0, "a"), old], [0], 2)
    assert plan.members[1] == old


def test_bad_inputs_name_the_value() -> None:
    with pytest.raises(ValueError, match="shard 2, outside 0..1"):
        plan_reformations([Orphan(0, 2, 2, "a")], [0], 2)
    with pytest.raises(ValueError, match="shards must be >= 1, got 0"):
        plan_reformations([], [0], 0)
    with pytest.raises(ValueError, match="appears twice"):
        plan_reformations([Orphan(0, 1, 1, "a"), Orphan(1, 1, 1, "a")], [0], 2)


def test_the_salvage_settings_are_off_by_default_and_refuse_bad_values_by_name() -> None:
    from lightning_recover.config import ConfigurationError, RecoverConfig

    assert RecoverConfig().salvage is False and RecoverConfig().salvage_wait_s == 300.0
    assert RecoverConfig(salvage=True, salvage_wait_s=5).salvage_wait_s == 5.0
    with pytest.raises(ConfigurationError, match=r"salvage.*true or false.*set recover.salvage=true"):
        RecoverConfig(salvage="yes")
    for bad in (0, -1, float("inf"), "soon"):
        with pytest.raises(ConfigurationError, match=r"salvage_wait_s.*set recover.salvage_wait_s"):
            RecoverConfig(salvage_wait_s=bad)


def test_salvage_acts_only_where_a_replica_has_mates_to_orphan() -> None:
    from lightning_recover.config import RecoverConfig

    assert RecoverConfig(salvage=True, shards=2).salvaging
    assert not RecoverConfig(salvage=True, shards=1).salvaging, "one rank per replica: no mate to keep, no recruiter"
    assert not RecoverConfig(salvage=False, shards=2).salvaging


@settings(max_examples=200, deadline=None)
@given(rank=st.integers(-1, 64), members=st.lists(st.integers(0, 64), max_size=8), port=st.text(max_size=40),
       args=st.lists(st.text(max_size=20), max_size=6), count=st.integers(0, 8),
       info=st.lists(st.tuples(st.text(min_size=1, max_size=10), st.text(max_size=20)), max_size=4))
def test_an_orphan_seat_reads_back_what_the_leader_sent(rank: int, members: list[int], port: str, args: list[str], count: int,
                                                        info: list[tuple[str, str]]) -> None:
    from lightning_recover.comm.orphans import LEAVE, OrphanSeat

    seat = OrphanSeat(rank, tuple(members), port, '{"ranks": [2]}', tuple(args), count, tuple(info))
    assert OrphanSeat.from_bytes(seat.to_bytes()) == seat
    # A seat from a leader without the spawn fields (orphans alone) still reads, with nothing to spawn.
    plain = OrphanSeat.from_bytes(b'{"rank": 3, "members": [4, 3], "port": "p", "seat": ""}')
    assert plain.spawn_count == 0 and plain.spawn_args == () and plain.spawn_info == () and plain.rank != LEAVE
