"""Tests of the exactly-once microbatch planner (lightning_recover.workload.planner)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_recover.workload.planner import MicrobatchPlanner
from lightning_recover.workload.static_world import StaticWorld


def microbatch(planner: MicrobatchPlanner, mb_id: int) -> list[int]:
    return [i for s in range(planner.shards) for i in planner.sample_indices(mb_id, s)]


def test_ids():
    p = MicrobatchPlanner(dataset_len=100, B=4, microbatch_size=2, shards=3)
    assert p.global_id(5, 3) == 23
    assert p.step_ids(5) == range(20, 24)
    with pytest.raises(ValueError, match="offset must be < B=4, got 4"):
        p.global_id(0, 4)


def test_determinism_across_instances():
    a = MicrobatchPlanner(1000, B=8, microbatch_size=4, shards=2, seed=7)
    b = MicrobatchPlanner(1000, B=8, microbatch_size=4, shards=2, seed=7)
    for m in [0, 1, 17, 500, 12345]:
        for s in range(2):
            assert a.sample_indices(m, s) == b.sample_indices(m, s)
            assert a.rng_seed(m, s) == b.rng_seed(m, s)
    c = MicrobatchPlanner(1000, B=8, microbatch_size=4, shards=2, seed=8)
    assert microbatch(a, 0) != microbatch(c, 0)
    assert a.rng_seed(0) != c.rng_seed(0)


def test_rng_seeds_are_63_bit_and_distinct():
    p = MicrobatchPlanner(64, B=2, microbatch_size=1, shards=2, seed=3)
    seeds = {p.rng_seed(m, s) for m in range(2000) for s in range(2)}
    assert len(seeds) == 4000
    assert all(0 <= x < 2**63 for x in seeds)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    B=st.integers(1, 6),
    mbs=st.integers(1, 5),
    shards=st.integers(1, 4),
    seed=st.integers(0, 2**32),
)
def test_exactly_once_within_each_epoch(n, B, mbs, shards, seed):
    if n < B * mbs * shards:
        with pytest.raises(ValueError, match="one step needs"):
            MicrobatchPlanner(n, B, mbs, shards, seed)
        return
    p = MicrobatchPlanner(n, B, mbs, shards, seed)
    per_epoch = p.microbatches_per_epoch
    assert per_epoch == n // (mbs * shards)
    for epoch in range(3):
        seen: list[int] = []
        for m in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            assert p.data_epoch(m) == epoch
            slices = [p.sample_indices(m, s) for s in range(shards)]
            assert all(len(x) == mbs for x in slices)
            flat = [i for x in slices for i in x]
            assert len(set(flat)) == len(flat), "shard slices must be disjoint"
            seen.extend(flat)
        assert len(seen) == len(set(seen)), "a sample index repeats within an epoch"
        assert all(0 <= i < n for i in seen)
        # Only the dropped tail (less than one microbatch) is left out.
        assert n - len(seen) < mbs * shards


def test_epochs_use_different_permutations():
    p = MicrobatchPlanner(60, B=2, microbatch_size=3, shards=2, seed=1)
    per_epoch = p.microbatches_per_epoch  # 10
    e0 = [microbatch(p, m) for m in range(per_epoch)]
    e1 = [microbatch(p, m) for m in range(per_epoch, 2 * per_epoch)]
    assert e0 != e1
    assert sorted(i for mb in e0 for i in mb) == sorted(i for mb in e1 for i in mb)


def test_permutation_cache_is_bounded():
    p = MicrobatchPlanner(50, B=1, microbatch_size=5)
    for m in range(0, 100, 3):
        p.sample_indices(m, 0)
    assert len(p._perms) <= p.CACHE_EPOCHS
    fresh = MicrobatchPlanner(50, B=1, microbatch_size=5)
    assert p.sample_indices(1, 0) == fresh.sample_indices(1, 0)


def test_same_ids_same_samples_whatever_the_replica_count():
    """Who computes a microbatch (replica count, roles, replay) never changes its samples."""
    B = 12
    planner = MicrobatchPlanner(500, B=B, microbatch_size=2, shards=2, seed=5)

    def samples_of_step(W: int, lose: list[int]) -> dict[int, list[int]]:
        pol = StaticWorld(W_init=W, G_init=B // min(W, 4), T=min(W, 4))
        assert pol.B == B
        pol.begin_step(3, range(W))
        plan = pol.fail(lose) if lose else pol.current_plan
        out: dict[int, list[int]] = {}
        for r in plan.contributors:
            # Each replica builds its own planner: no shared state between replicas.
            mine = MicrobatchPlanner(500, B=B, microbatch_size=2, shards=2, seed=5)
            for off in plan.plans[r].ids:
                mb = mine.global_id(3, off)
                assert mb not in out
                out[mb] = microbatch(mine, mb)
        return out

    reference = {m: microbatch(planner, m) for m in planner.step_ids(3)}
    assert samples_of_step(4, []) == reference
    assert samples_of_step(6, [0, 5]) == reference
    assert samples_of_step(4, [1, 2]) == reference


def test_state_round_trip():
    p = MicrobatchPlanner(1000, B=8, microbatch_size=4, shards=2, seed=11)
    p.advance(0)
    p.advance(40)
    state = json.loads(json.dumps(p.state_dict()))
    assert state["next_id"] == 41 * 8 and state["data_epoch"] == p.data_epoch(41 * 8)
    assert set(state) >= {"seed", "B", "microbatch_size", "shards", "dataset_len", "next_id"}
    q = MicrobatchPlanner(1000, B=8, microbatch_size=4, shards=2, seed=11)
    q.load_state_dict(state)
    assert q.next_id == p.next_id and q.next_step == 41
    assert q.sample_indices(q.next_id, 1) == p.sample_indices(p.next_id, 1)
    # Same samples per microbatch, different shard layout: allowed.
    r = MicrobatchPlanner(1000, B=8, microbatch_size=8, shards=1, seed=11)
    r.load_state_dict(state)
    assert sorted(microbatch(r, 400)) == sorted(microbatch(p, 400))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seed=12), "seed=11 but this run has seed=12"),
        (dict(B=4), "B=8 but this run has B=4"),
        (dict(dataset_len=999), "dataset_len=1000 but this run has dataset_len=999"),
        (dict(microbatch_size=2), "samples per microbatch"),
    ],
)
def test_load_rejects_incompatible_state(kwargs, match):
    p = MicrobatchPlanner(1000, B=8, microbatch_size=4, shards=2, seed=11)
    args = dict(dataset_len=1000, B=8, microbatch_size=4, shards=2, seed=11) | kwargs
    q = MicrobatchPlanner(**args)
    with pytest.raises(ValueError, match=match):
        q.load_state_dict(p.state_dict())


def test_advance_never_goes_back():
    p = MicrobatchPlanner(100, B=4, microbatch_size=1)
    p.advance(3)
    p.advance(3)  # idempotent
    assert p.next_id == 16
    with pytest.raises(ValueError, match="move next_id back from 16 to 8"):
        p.advance(1)


def test_too_small_dataset_names_sizes_and_fix():
    with pytest.raises(ValueError) as err:
        MicrobatchPlanner(dataset_len=100, B=8, microbatch_size=4, shards=4)
    msg = str(err.value)
    assert "100 samples" in msg and "8*4*4 = 128" in msg and "larger dataset" in msg


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(B=0), "B must be >= 1, got 0"),
        (dict(microbatch_size=0), "microbatch_size must be >= 1, got 0"),
        (dict(shards=0), "shards must be >= 1, got 0"),
        (dict(seed=-1), "seed must be >= 0, got -1"),
    ],
)
def test_bad_args(kwargs, match):
    args = dict(dataset_len=100, B=2, microbatch_size=2, shards=1, seed=0) | kwargs
    with pytest.raises(ValueError, match=match):
        MicrobatchPlanner(**args)


def test_bad_shard():
    p = MicrobatchPlanner(100, B=2, microbatch_size=2, shards=2)
    with pytest.raises(ValueError, match="shard must be < shards=2, got 2"):
        p.sample_indices(0, 2)


class _KeyedPlanner(MicrobatchPlanner):
    """Orders every dataset with the keyed bijection (normally only those above IN_MEMORY_LIMIT)."""

    IN_MEMORY_LIMIT = 0


@given(D=st.integers(1, 3000), mbs=st.integers(1, 4), shards=st.integers(1, 3), seed=st.integers(0, 5))
@settings(max_examples=60, deadline=None)
def test_a_large_dataset_is_ordered_by_a_bijection_per_epoch(D: int, mbs: int, shards: int, seed: int) -> None:
    per_mb = mbs * shards
    if D < per_mb:
        return
    p = _KeyedPlanner(D, 1, mbs, shards=shards, seed=seed)
    orders = []
    for epoch in range(2):
        seen = [i for m in range(p.microbatches_per_epoch) for s in range(shards)
                for i in p.sample_indices(epoch * p.microbatches_per_epoch + m, s)]
        # Every sample of the epoch's whole microbatches once, never one outside the dataset.
        assert len(seen) == len(set(seen)) == p.samples_per_epoch and all(0 <= i < D for i in seen)
        orders.append(seen)
    if p.samples_per_epoch > 8:
        assert orders[0] != orders[1], "each epoch draws its own order"


def test_the_keyed_order_is_the_same_on_every_rank_and_after_a_resume() -> None:
    a, b = _KeyedPlanner(10_000, 4, 2, seed=3), _KeyedPlanner(10_000, 4, 2, seed=3)
    b.load_state_dict(a.state_dict())
    assert [a.sample_indices(m, 0) for m in range(40)] == [b.sample_indices(m, 0) for m in range(40)]
    assert MicrobatchPlanner(10**9, 1024, 8)._keyed and not MicrobatchPlanner(1 << 24, 1024, 8)._keyed
