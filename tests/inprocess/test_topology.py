"""Properties of RankLayout: world rank <-> (replica, shard) for W replicas x S shards."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_recover.topology import RankLayout


@st.composite
def layouts(draw, max_replicas: int = 12, max_shards: int = 8) -> RankLayout:
    replicas = draw(st.integers(1, max_replicas))
    shards = draw(st.integers(1, max_shards))
    return RankLayout(replicas * shards, shards)


@st.composite
def layout_and_rank(draw):
    layout = draw(layouts())
    return layout, draw(st.integers(0, layout.world_size - 1))


@settings(deadline=None)
@given(layouts())
def test_replicas_times_shards_is_world(layout: RankLayout) -> None:
    assert layout.replicas * layout.shards == layout.world_size


@settings(deadline=None)
@given(layout_and_rank())
def test_rank_round_trip(lr) -> None:
    layout, rank = lr
    replica, shard = layout.replica_of(rank), layout.shard_of(rank)
    assert 0 <= replica < layout.replicas
    assert 0 <= shard < layout.shards
    assert layout.rank_of(replica, shard) == rank


@settings(deadline=None)
@given(layouts(), st.data())
def test_coordinate_round_trip(layout: RankLayout, data) -> None:
    replica = data.draw(st.integers(0, layout.replicas - 1))
    shard = data.draw(st.integers(0, layout.shards - 1))
    rank = layout.rank_of(replica, shard)
    assert (layout.replica_of(rank), layout.shard_of(rank)) == (replica, shard)


@settings(deadline=None)
@given(layouts())
def test_replicas_partition_the_world(layout: RankLayout) -> None:
    seen: list[int] = []
    for p in range(layout.replicas):
        ranks = layout.ranks_of_replica(p)
        assert len(ranks) == layout.shards
        assert list(ranks) == sorted(ranks)  # shard order
        assert [layout.shard_of(r) for r in ranks] == list(range(layout.shards))
        assert {layout.replica_of(r) for r in ranks} == {p}
        seen += ranks
    assert sorted(seen) == list(range(layout.world_size))


@settings(deadline=None)
@given(layouts(), st.data())
def test_complete_replicas_are_exactly_the_untouched_ones(layout: RankLayout, data) -> None:
    present = data.draw(st.sets(st.integers(0, layout.world_size - 1)))
    dead = set(range(layout.world_size)) - present
    complete = layout.complete_replicas(present)
    assert complete == sorted(complete)
    assert set(complete) == set(range(layout.replicas)) - layout.replicas_touched(dead)
    for p in complete:
        assert set(layout.ranks_of_replica(p)) <= present


@settings(deadline=None)
@given(layouts())
def test_complete_replicas_edge_cases(layout: RankLayout) -> None:
    everyone = range(layout.world_size)
    assert layout.complete_replicas(everyone) == list(range(layout.replicas))
    assert layout.complete_replicas(iter(everyone)) == list(range(layout.replicas))  # any iterable
    assert layout.complete_replicas([]) == []
    assert layout.replicas_touched([]) == set()


@settings(deadline=None)
@given(layouts(), st.data())
def test_killing_one_rank_loses_exactly_its_replica(layout: RankLayout, data) -> None:
    victim = data.draw(st.integers(0, layout.world_size - 1))
    present = set(range(layout.world_size)) - {victim}
    lost = layout.replica_of(victim)
    assert layout.replicas_touched([victim]) == {lost}
    assert layout.complete_replicas(present) == [p for p in range(layout.replicas) if p != lost]


def test_default_is_one_shard_per_replica() -> None:
    layout = RankLayout(4)
    assert layout.shards == 1 and layout.replicas == 4
    assert [layout.replica_of(r) for r in range(4)] == [0, 1, 2, 3]
    assert all(layout.shard_of(r) == 0 for r in range(4))


def test_concrete_2x2_layout() -> None:
    layout = RankLayout(4, 2)
    assert [(layout.replica_of(r), layout.shard_of(r)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.ranks_of_replica(1) == (2, 3)
    assert layout.complete_replicas([0, 1, 3]) == [0]


def test_layout_is_hashable_and_frozen() -> None:
    layout = RankLayout(6, 3)
    assert layout == RankLayout(6, 3) and hash(layout) == hash(RankLayout(6, 3))
    with pytest.raises(AttributeError):
        layout.shards = 2  # type: ignore[misc]


# ------------------------------------------------------------------------------ errors
@settings(deadline=None)
@given(st.integers(max_value=0), st.integers(1, 8))
def test_bad_shards_named(shards: int, world: int) -> None:
    with pytest.raises(ValueError, match=rf"shards must be >= 1, got {shards}\b"):
        RankLayout(world, shards)


@settings(deadline=None)
@given(st.integers(max_value=0))
def test_bad_world_size_named(world: int) -> None:
    with pytest.raises(ValueError, match=rf"world size must be >= 1, got {world}\b"):
        RankLayout(world, 1)


@settings(deadline=None)
@given(st.integers(2, 8), st.data())
def test_indivisible_world_named(shards: int, data) -> None:
    world = data.draw(st.integers(1, 64).filter(lambda w: w % shards))
    with pytest.raises(ValueError, match=rf"world size {world} is not divisible by shards={shards}"):
        RankLayout(world, shards)


@settings(deadline=None)
@given(layouts(), st.one_of(st.integers(max_value=-1), st.integers(min_value=10**6)))
def test_out_of_range_rank_named(layout: RankLayout, rank: int) -> None:
    for fn in (layout.replica_of, layout.shard_of):
        with pytest.raises(ValueError, match=rf"rank {rank} out of range 0..{layout.world_size - 1}"):
            fn(rank)


@settings(deadline=None)
@given(layouts(), st.integers(0, 3))
def test_rank_just_past_the_end_named(layout: RankLayout, extra: int) -> None:
    rank = layout.world_size + extra
    with pytest.raises(ValueError, match=rf"rank {rank} out of range"):
        layout.replica_of(rank)
    with pytest.raises(ValueError, match=rf"rank {rank} out of range"):
        layout.replicas_touched([rank])


@settings(deadline=None)
@given(layouts(), st.integers(0, 3))
def test_bad_coordinates_named(layout: RankLayout, extra: int) -> None:
    bad_replica = layout.replicas + extra
    with pytest.raises(ValueError, match=rf"replica {bad_replica} out of range 0..{layout.replicas - 1}"):
        layout.rank_of(bad_replica, 0)
    with pytest.raises(ValueError, match=rf"replica -{extra + 1} out of range"):
        layout.rank_of(-1 - extra, 0)
    bad_shard = layout.shards + extra
    with pytest.raises(ValueError, match=rf"shard {bad_shard} out of range 0..{layout.shards - 1}"):
        layout.rank_of(0, bad_shard)
    with pytest.raises(ValueError, match=rf"replica {bad_replica} out of range"):
        layout.ranks_of_replica(bad_replica)
