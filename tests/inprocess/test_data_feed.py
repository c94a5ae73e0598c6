"""The planner-driven prefetch stream (lightning_recover.feed.loading), in one process, no MPI.

A scripted engine drives a real StaticWorld policy step by step (begin, the replica's
planned microbatches, a failure -> fail() -> the boundary schedule BoundaryScheduler
would set, commit) and asks the feed for every microbatch. Each delivered batch and the RNG
state the forward starts from must be bitwise what a direct fetch after
``torch.manual_seed(seed_for(step, offset))`` gives -- whichever path delivered it -- and
after a failure the stream must serve every microbatch again from the next step on.
"""

from __future__ import annotations

import collections
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, get_worker_info

from lightning_recover.feed.data import MicrobatchSource
from lightning_recover.feed.loading import (
    Delivered,
    KeyedCollate,
    MicrobatchFeed,
    PlannedBatchSampler,
    SeededDataset,
)
from lightning_recover.workload.factory import make_policy


class NoisyDataset(Dataset):
    """Samples with random augmentation (torch RNG), recording which process loaded them."""

    def __init__(self, n: int = 400) -> None:
        self.n = n
        self.loaded_by: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = get_worker_info()
        return {"x": torch.full((3,), float(i)) + torch.rand(3), "pid": os.getpid(), "worker": -1 if info is None else info.id}


def reference(source: MicrobatchSource, step: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the strategy did before the feed: seed, load in the main process, then the forward's first draw."""
    torch.manual_seed(source.seed_for(step, offset))
    gid = source.planner.global_id(step, offset)
    batch = source.collate([source.dataset[i] for i in source.planner.sample_indices(gid, source.shard)])
    return batch["x"], torch.rand(4)


class PrefetchingLoader:
    """Stands in for a multi-worker DataLoader: ``depth`` index batches requested ahead (at iter() and after
    each delivery, as DataLoader does), delivered in order; loading happens in this process."""

    def __init__(self, dataset: SeededDataset, sampler: PlannedBatchSampler, collate: KeyedCollate, depth: int) -> None:
        self.dataset, self.sampler, self.collate, self.depth = dataset, sampler, collate, depth

    def __iter__(self) -> Iterator[Delivered]:
        return _PrefetchIter(self)


class _PrefetchIter:
    def __init__(self, loader: PrefetchingLoader) -> None:
        self.loader = loader
        self.indices = iter(loader.sampler)
        self.pending: collections.deque[Any] = collections.deque()
        for _ in range(loader.depth):
            self._pull()

    def _pull(self) -> None:
        nxt = next(self.indices, None)
        if nxt is not None:
            self.pending.append(nxt)

    def __iter__(self) -> _PrefetchIter:
        return self

    def __next__(self) -> Delivered:
        if not self.pending:
            raise StopIteration
        out = self.loader.collate(self.loader.dataset.__getitems__(self.pending.popleft()))
        self._pull()
        return out


@dataclass
class ScriptedEngine:
    """A PlanView driven like StepEngine drives the policy; faults: step -> (after how many microbatches, lost)."""

    W: int
    G: int
    replica: int
    faults: dict[int, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    between: dict[int, tuple[int, ...]] = field(default_factory=dict)  # lost before the step begins

    def __post_init__(self) -> None:
        self.policy = make_policy("static", self.W, self.G)
        self.live = list(range(self.W))
        self.open: int | None = None
        self.next = 0
        self.plan: Any = None

    def current_step(self) -> int:
        return self.open if self.open is not None else self.next

    def ids(self, step: int) -> tuple[int, ...]:
        if self.open == step:
            return self.plan.for_replica(self.replica).ids
        return tuple(self.policy.steady_ids(self.live, self.replica))

    def run(self, feed: MicrobatchFeed, source: MicrobatchSource, steps: int) -> list[tuple[int, int]]:
        """Train ``steps`` steps, checking every microbatch against the reference; returns what was asked."""
        asked: list[tuple[int, int]] = []

        def compute(step: int, offset: int) -> None:
            batch = feed.get(step, offset)
            draw = torch.rand(4)
            want_x, want_draw = reference(source, step, offset)
            assert torch.equal(batch["x"], want_x), f"microbatch {(step, offset)}: wrong samples"
            assert torch.equal(draw, want_draw), f"microbatch {(step, offset)}: forward RNG differs from a direct fetch"
            asked.append((step, offset))

        for step in range(steps):
            if step in self.between:
                self.live = [r for r in self.live if r not in self.between[step]]
            self.plan = self.policy.begin_step(step, self.live)
            self.open = step
            computed: list[int] = []
            after, lost = self.faults.get(step, (-1, ()))
            for i, offset in enumerate(self.plan.for_replica(self.replica).ids):
                if i == after:
                    break
                compute(step, offset)
                computed.append(offset)
            if lost:
                self.live = [r for r in self.live if r not in lost]
                self.plan = self.policy.fail(lost)
                want = set(self.plan.for_replica(self.replica).ids)
                # BoundaryScheduler: a spare turned replayer drops its shadow work.
                run = sorted(want) if not set(computed) <= want else sorted(want - set(computed))
                for offset in run:
                    compute(step, offset)
            else:
                for offset in self.plan.for_replica(self.replica).ids[len(computed):]:
                    compute(step, offset)
            self.policy.commit()
            self.open, self.next = None, step + 1
        return asked


def make_feed(engine: ScriptedEngine, depth: int, shards: int = 1) -> tuple[MicrobatchFeed, MicrobatchSource]:
    dataset = NoisyDataset()
    source = MicrobatchSource(DataLoader(dataset, batch_size=2), engine.policy.B, shards, 0, seed=3)
    feed = MicrobatchFeed(
        source, None, engine, loader_factory=lambda d, s, c: PrefetchingLoader(d, s, c, depth)
    )
    load = source.load
    source.direct_keys = []  # type: ignore[attr-defined]

    def recording_load(step: int, offset: int) -> Delivered:
        source.direct_keys.append((step, offset))  # type: ignore[attr-defined]
        return load(step, offset)

    source.load = recording_load  # type: ignore[method-assign]
    return feed, source


def test_fault_free_stream_serves_every_microbatch() -> None:
    engine = ScriptedEngine(W=3, G=2, replica=1)
    feed, source = make_feed(engine, depth=4)
    feed.start_epoch(0, 6)
    asked = engine.run(feed, source, 6)
    assert asked == [(s, o) for s in range(6) for o in (2, 3)]
    assert feed.stats.streamed == len(asked) and feed.stats.direct == 0 and feed.stats.dropped == 0


def test_boundary_step_fetches_replays_directly_and_resyncs_from_the_next_step() -> None:
    # 4 replicas, G=2; replica 2 is lost after this replica (0) computed one microbatch of step 2:
    # survivors replay ids 4, 5 and the quota grows to 3 from step 3 on (ids 0, 1, 2 for replica 0).
    engine = ScriptedEngine(W=4, G=2, replica=0, faults={2: (1, (2,))})
    feed, source = make_feed(engine, depth=5)
    feed.start_epoch(0, 7)
    asked = engine.run(feed, source, 7)
    after = [k for k in asked if k[0] >= 3]
    assert after == [(s, o) for s in range(3, 7) for o in (0, 1, 2)]
    stats = feed.stats
    assert stats.restarts == 1
    assert stats.streamed + stats.direct == len(asked)
    # Everything but the boundary step's replays came from the stream, the steps after it included.
    replays = [k for k in asked if k[0] == 2 and k[1] not in (0, 1)]
    assert replays and stats.direct == len(replays)


def test_spare_promotion_needs_no_direct_fetch() -> None:
    # 5 replicas, T=4: replica 4 shadows replica 0; losing 0 promotes 4 with the same ids in
    # step 1 (nothing extra to load), and from step 2 on the steady plan gives it ids 6, 7.
    engine = ScriptedEngine(W=5, G=2, replica=4, faults={1: (1, (0,))})
    engine.policy = make_policy("static", 5, 2, T=4)
    feed, source = make_feed(engine, depth=3)
    feed.start_epoch(0, 4)
    asked = engine.run(feed, source, 4)
    assert asked[-2:] == [(3, 6), (3, 7)]
    assert feed.stats.direct == 0 and feed.stats.restarts == 1


def test_loss_between_steps_restarts_at_the_step_itself() -> None:
    engine = ScriptedEngine(W=4, G=1, replica=3, between={2: (1,)})
    feed, source = make_feed(engine, depth=6)
    feed.start_epoch(0, 5)
    engine.run(feed, source, 5)
    assert feed.stats.restarts == 1 and feed.stats.direct == 0


def test_stream_skips_steps_the_engine_passed_and_stops_at_the_epoch_end() -> None:
    engine = ScriptedEngine(W=2, G=2, replica=0)
    feed, source = make_feed(engine, depth=3)
    feed.start_epoch(0, 2)
    engine.run(feed, source, 3)  # step 2 is past the epoch's end: fetched directly
    assert feed.stats.streamed == 4 and feed.stats.direct == 2


@st.composite
def scripts(draw: st.DrawFn) -> tuple[ScriptedEngine, int, int]:
    W = draw(st.integers(2, 5))
    G = draw(st.integers(1, 3))
    steps = draw(st.integers(2, 6))
    replica = draw(st.integers(0, W - 1))
    alive = [r for r in range(W) if r != replica]
    faults: dict[int, tuple[int, tuple[int, ...]]] = {}
    between: dict[int, tuple[int, ...]] = {}
    for step in range(steps):
        if alive and draw(st.booleans()):
            lost = tuple(draw(st.lists(st.sampled_from(alive), min_size=1, max_size=len(alive), unique=True)))
            alive = [r for r in alive if r not in lost]
            if draw(st.booleans()):
                between[step] = lost
            else:
                faults[step] = (draw(st.integers(0, G + 1)), lost)
    return ScriptedEngine(W, G, replica, faults, between), steps, draw(st.integers(1, 8))


@given(scripts())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_failure_script_delivers_exactly_the_planned_microbatches(script: tuple[ScriptedEngine, int, int]) -> None:
    engine, steps, depth = script
    feed, source = make_feed(engine, depth)
    feed.start_epoch(0, steps)
    asked = engine.run(feed, source, steps)  # checks every batch and RNG state against a direct fetch
    stats = feed.stats
    assert stats.streamed + stats.direct == len(asked)
    assert len(source.direct_keys) == stats.direct  # type: ignore[attr-defined]
    # From the step after the last failure on, the stream serves every microbatch.
    last = max([*engine.faults, *engine.between], default=-1)
    late = [k for k in source.direct_keys if k[0] > last]  # type: ignore[attr-defined]
    assert not late, f"{late} (after the last failure, step {last}) were fetched directly"


@pytest.mark.parametrize("persistent", [True, False])
def test_workers_load_with_the_users_settings(tmp_path: Any, persistent: bool) -> None:
    """Real DataLoader workers: the user's worker_init_fn ran, batches come from worker processes, and
    the batches and forward RNG equal a direct fetch, through a scripted failure."""
    marks = tmp_path / "init"
    marks.mkdir()
    engine = ScriptedEngine(W=3, G=2, replica=0, faults={1: (1, (1,))})
    dataset = NoisyDataset()
    user = DataLoader(
        dataset, batch_size=2, num_workers=2, prefetch_factor=2, persistent_workers=persistent,
        worker_init_fn=_WorkerMark(str(marks)),
    )
    source = MicrobatchSource(user, engine.policy.B, 1, 0, seed=3)
    feed = MicrobatchFeed(source, user, engine)
    assert feed.streams
    feed.start_epoch(0, 4)
    pids: set[int] = set()
    original = feed.get

    def spy(step: int, offset: int) -> Any:
        batch = original(step, offset)
        pids.update(int(p) for p in batch["pid"])
        return batch

    feed.get = spy  # type: ignore[method-assign]
    engine.run(feed, source, 4)
    feed.close()
    inits = {int(f.name.split("-")[1]) for f in marks.iterdir()}
    workers = pids - {os.getpid()}
    # The restart after the loss keeps persistent workers and starts new ones otherwise.
    assert len(workers) == (2 if persistent else 4), f"batches came from pids {pids}, main is {os.getpid()}"
    assert inits >= workers, "worker_init_fn did not run in every worker"
    assert feed.stats.streamed > feed.stats.direct > 0 and feed.stats.restarts == 1


class _WorkerMark:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, worker_id: int) -> None:
        open(os.path.join(self.directory, f"{worker_id}-{os.getpid()}"), "w").close()


def test_no_workers_fetches_directly_when_asked() -> None:
    engine = ScriptedEngine(W=2, G=2, replica=1)
    user = DataLoader(NoisyDataset(), batch_size=2)
    source = MicrobatchSource(user, engine.policy.B, 1, 0, seed=3)
    feed = MicrobatchFeed(source, user, engine)
    assert not feed.streams
    feed.start_epoch(0, 3)
    engine.run(feed, source, 3)
    assert feed.stats.direct == 6 and feed.stats.streamed == 0


def test_seeded_dataset_forwards_attributes_to_the_users_dataset() -> None:
    inner = NoisyDataset(10)
    seeded = SeededDataset(inner)
    seeded.handle = "opened in worker_init_fn"  # type: ignore[attr-defined]
    assert inner.handle == "opened in worker_init_fn"  # type: ignore[attr-defined]
    assert seeded.n == 10 and len(seeded) == 10
    copy = pickle.loads(pickle.dumps(seeded))  # what a spawn/forkserver worker receives
    assert copy.n == 10 and copy.handle == "opened in worker_init_fn"


def test_a_loader_delivering_out_of_order_is_refused() -> None:
    engine = ScriptedEngine(W=2, G=2, replica=0)

    class Swapped(PrefetchingLoader):
        def __iter__(self) -> Iterator[Delivered]:
            it = _PrefetchIter(self)
            first, second = next(it), next(it)
            return iter([second, first, *it])

    dataset = NoisyDataset()
    source = MicrobatchSource(DataLoader(dataset, batch_size=2), engine.policy.B, 1, 0, seed=3)
    feed = MicrobatchFeed(source, None, engine, loader_factory=lambda d, s, c: Swapped(d, s, c, 4))
    feed.start_epoch(0, 2)
    with pytest.raises(RuntimeError, match=r"delivered microbatch \(0, 1\) where \(0, 0\) was due"):
        engine.run(feed, source, 1)
