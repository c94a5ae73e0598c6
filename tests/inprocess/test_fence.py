"""The write fence (lightning_recover.fence): a newer world or launch locks older ones out."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_recover.fence import FENCE_NAME, WorldFence


def test_no_fence_allows_everyone(tmp_path: Path) -> None:
    fence = WorldFence(tmp_path)
    assert fence.allows("job", 0) and fence.holder() == "nobody"


def test_an_older_world_is_refused_and_a_newer_one_allowed(tmp_path: Path) -> None:
    fence = WorldFence(tmp_path)
    fence.advance("job", 3)
    assert not fence.allows("job", 2), "a world that was repaired away must not write"
    assert fence.allows("job", 3) and fence.allows("job", 4)
    fence.advance("job", 1)  # a late advance from an older world never moves it back
    assert fence.read().epoch == 3 and "world epoch 3" in fence.holder()


def test_a_new_launch_takes_the_fence_and_locks_out_the_old_one(tmp_path: Path) -> None:
    fence = WorldFence(tmp_path)
    fence.advance("first", 7)
    fence.advance("second", 0)
    assert fence.allows("second", 0)
    assert not fence.allows("first", 9), "a rank of an earlier launch must not write into the relaunched run"


def test_an_unreadable_fence_allows(tmp_path: Path) -> None:
    (tmp_path / FENCE_NAME).write_text("{not json")
    assert WorldFence(tmp_path).allows("job", 0)


def test_bad_epoch_names_the_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="got -1"):
        WorldFence(tmp_path).advance("job", -1)


def test_an_old_launch_repaired_later_never_takes_the_fence_back(tmp_path: Path) -> None:
    fence = WorldFence(tmp_path)
    fence.advance("first", 2)
    fence.advance("second", 0)
    fence.advance("first", 3)  # the old launch's zombie repaired its world
    assert fence.read().job == "second" and not fence.allows("first", 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 6)), min_size=1, max_size=12))
def test_fence_follows_its_rules(tmp_path_factory: pytest.TempPathFactory, moves: list[tuple[str, int]]) -> None:
    fence = WorldFence(tmp_path_factory.mktemp("fence"))
    held: tuple[str, int] | None = None
    for job, epoch in moves:
        fence.advance(job, epoch)
        if held is None or epoch == 0 and held[0] != job or held[0] == job and epoch > held[1]:
            held = (job, epoch)
        now = fence.read()
        assert now is not None and (now.job, now.epoch) == held
        for other in "abc":
            for e in range(8):
                assert fence.allows(other, e) == (other == held[0] and e >= held[1])
