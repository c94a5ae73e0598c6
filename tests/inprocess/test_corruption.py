"""The pure layer of the silent-data-corruption check: fingerprints and arbitration (no MPI)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_recover.callbacks import FaultInjection
from lightning_recover.config import ConfigurationError, RecoverConfig
from lightning_recover.corruption import arbitrate, fingerprint

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


def tensors(seed: int, sizes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) if dtype.is_floating_point else torch.randint(-99, 99, (n,), generator=g) for n in sizes]


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**31), sizes=st.lists(st.integers(1, 300), min_size=1, max_size=4),
    dtype=st.sampled_from(DTYPES), which=st.integers(0, 10**6), bit=st.integers(0, 63),
)
def test_any_single_bit_flip_changes_the_print_and_equal_bits_give_equal_prints(
    seed: int, sizes: list[int], dtype: torch.dtype, which: int, bit: int
) -> None:
    ts = tensors(seed, sizes, dtype)
    fp = fingerprint(ts)
    assert fingerprint([t.clone() for t in ts]) == fp
    flipped = [t.clone() for t in ts]
    t = flipped[which % len(flipped)]
    raw = t.view(-1).view(torch.uint8)
    byte = which % raw.numel()
    raw[byte] ^= 1 << (bit % 8)
    assert fingerprint(flipped) != fp


def test_two_flips_that_cancel_in_the_plain_sum_still_show() -> None:
    t = torch.zeros(4, dtype=torch.int64)
    moved = t.clone()
    moved[0], moved[1] = 1, -1  # the plain wrapping sum stays 0
    assert fingerprint([moved]) != fingerprint([t])
    a, b = torch.ones(3), torch.full((3,), 2.0)
    assert fingerprint([a, b]) != fingerprint([b, a])


prints = st.tuples(st.integers(0, 3), st.integers(0, 3))


@settings(max_examples=300, deadline=None)
@given(by_shard=st.lists(st.dictionaries(st.integers(0, 6), prints, min_size=1, max_size=7), min_size=1, max_size=3))
def test_arbitration_names_exactly_the_replicas_outside_a_strict_majority(by_shard: list[dict[int, tuple[int, int]]]) -> None:
    verdict = arbitrate(dict(enumerate(by_shard)))
    odd: set[int] = set()
    undecidable = []
    for shard, by_replica in enumerate(by_shard):
        values = list(by_replica.values())
        top = max(set(values), key=values.count)
        if len(set(values)) == 1:
            continue
        if 2 * values.count(top) > len(values):
            odd |= {r for r, v in by_replica.items() if v != top}
        else:
            undecidable.append(shard)
    everyone = {r for by_replica in by_shard for r in by_replica}
    assert verdict.odd == tuple(sorted(odd)) and verdict.undecidable == tuple(undecidable)
    assert verdict.healthy == (() if undecidable else tuple(sorted(everyone - odd)))
    assert verdict.clean == (not odd and not undecidable)


def test_two_replicas_that_differ_are_undecidable_three_have_a_majority() -> None:
    assert arbitrate({0: {0: (1, 1), 1: (2, 2)}}).undecidable == (0,)
    v = arbitrate({0: {0: (1, 1), 1: (1, 1), 2: (9, 9)}, 1: {0: (5, 5), 1: (5, 5), 2: (5, 5)}})
    assert v.odd == (2,) and v.healthy == (0, 1) and not v.undecidable


def test_corrupt_fault_spec_and_sdc_settings_are_checked_with_the_fix_in_the_message() -> None:
    spec = FaultInjection([{"step": 3, "rank": 2, "phase": "optimizer", "kind": "corrupt"}]).schedule[0]
    assert spec.target == "params"
    with pytest.raises(ValueError, match=r"target='weights' is not one of \('params', 'grads', 'optimizer'\)"):
        FaultInjection([{"step": 3, "rank": 2, "phase": "optimizer", "kind": "corrupt", "target": "weights"}])
    with pytest.raises(ValueError, match="applies only to kind=corrupt"):
        FaultInjection([{"step": 3, "rank": 2, "phase": "optimizer", "kind": "kill", "target": "params"}])
    with pytest.raises(ConfigurationError, match=r"sdc.action must be 'repair' or 'evict', got 'fix' \(recover.sdc.action='fix'\)"):
        RecoverConfig.from_arguments(sdc_action="fix")
    with pytest.raises(ConfigurationError, match="recover.sdc.every_n_steps"):
        RecoverConfig.from_mapping({"sdc": {"every_n_steps": -1}})
    assert RecoverConfig.from_mapping({"sdc": {"every_n_steps": 5, "action": "evict"}}).sdc.enabled
