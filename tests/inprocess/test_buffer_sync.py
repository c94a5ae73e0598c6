"""BufferSync without MPI: what reaches the wire, what a follower ends with, and what costs nothing.

A stand-in communicator plays the broadcast: the leader's packed message is recorded,
a follower receives it (or garbage first, in a round that did not agree). The launched
tests (test_buffers_mpi.py) run the same code over ULFM with real deaths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from lightning_recover.callbacks import BufferSync, broadcast_buffers
from lightning_recover.recovery.hooks import StepCollectives


class Recorder:
    """The leader's side: the broadcast leaves the tensors as they are; remembers the bytes sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[torch.Tensor, str]] = []

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], root: int = 0, across: str = "replicas") -> None:
        assert root == 0
        self.sent += [(t.clone(), across) for t in tensors]


class Follower:
    """A follower's side: each broadcast writes the next scripted message into the tensors."""

    def __init__(self, messages: list[torch.Tensor]) -> None:
        self.messages = list(messages)

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], root: int = 0, across: str = "replicas") -> None:
        for t in tensors:
            t.copy_(self.messages.pop(0))


def once(fn: Callable[[], Any]) -> Any:
    return fn()


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.BatchNorm1d(6, momentum=None))
    m.register_buffer("bf16", torch.randn(3, 5).to(torch.bfloat16))
    m.register_buffer("f64", torch.randn(7, dtype=torch.float64))
    m.register_buffer("flags", torch.rand(5) > 0.5)
    m.register_buffer("strided", torch.randn(4, 6).t())  # not contiguous
    m.register_buffer("table", torch.arange(3, dtype=torch.int32) + seed, persistent=False)
    m.train()
    m(torch.randn(8, 4) * (seed + 1) + seed)  # running statistics and counts of this rank's data
    return m


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes: equal means bitwise equal."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def buffers(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.named_buffers()}


def test_follower_ends_bitwise_equal_to_the_leader_in_every_dtype() -> None:
    leader, follower = model(0), model(1)
    before = buffers(leader)
    assert any(not torch.equal(before[k], v) for k, v in buffers(follower).items())
    wire = Recorder()
    sent = broadcast_buffers(leader, wire, once)
    assert buffers(leader).keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in buffers(leader).items()), "the leader's buffers must not change"
    assert [across for _, across in wire.sent] == ["world"], "every buffer goes in one message across the world"
    assert sent == wire.sent[0][0].numel()
    broadcast_buffers(follower, Follower([wire.sent[0][0]]), once)
    after = buffers(follower)
    for k, v in before.items():
        assert after[k].dtype == v.dtype and after[k].shape == v.shape
        assert torch.equal(raw(after[k]), raw(v)), k


def test_only_the_agreed_round_is_kept() -> None:
    # A peer died during the first round: the follower holds garbage from it, the
    # engine repairs and runs the broadcast again; only the second round may land.
    leader, follower = model(0), model(1)
    wire = Recorder()
    broadcast_buffers(leader, wire, once)
    message = wire.sent[0][0]
    garbage = torch.full_like(message, 0xAB)
    rounds: list[int] = []

    def twice(fn: Callable[[], Any]) -> Any:
        fn()
        rounds.append(1)
        return fn()

    broadcast_buffers(follower, Follower([garbage, message]), twice)
    assert rounds == [1]
    for k, v in buffers(leader).items():
        assert torch.equal(buffers(follower)[k], v), k


def test_a_model_without_buffers_pays_nothing() -> None:
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    params = {k: v.clone() for k, v in m.state_dict().items()}
    rng = torch.get_rng_state()
    calls: list[int] = []

    def must_not_run(fn: Callable[[], Any]) -> Any:
        calls.append(1)
        return fn()

    assert broadcast_buffers(m, Recorder(), must_not_run) == 0
    assert calls == []
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(params[k], v) for k, v in m.state_dict().items())


class _Engine:
    """The engine's side of a hook's collectives: counts the collectives run through it."""

    def __init__(self) -> None:
        self.collectives = 0

    def run_collective(self, fn: Callable[[], Any]) -> Any:
        self.collectives += 1
        return fn()


class _Strategy:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


class _Trainer:
    def __init__(self, strategy: _Strategy) -> None:
        self.strategy = strategy


def collectives(engine: _Engine) -> StepCollectives:
    """What the engine hands a hook: the communicator (here the leader's recorder) and its run_collective."""
    return StepCollectives(Recorder(), engine.run_collective)  # type: ignore[arg-type]


@pytest.mark.parametrize(("enabled", "world_size", "expect"), [(True, 4, 1), (False, 4, 0), (True, 1, 0)])
def test_callback_syncs_unless_disabled_or_alone(enabled: bool, world_size: int, expect: int) -> None:
    engine = _Engine()
    cb = BufferSync(enabled=enabled)
    cb.on_step_committed(_Trainer(_Strategy(world_size)), model(0), {"step": 0}, collectives(engine))
    assert engine.collectives == expect
    assert (cb.last_bytes > 0) == bool(expect)


def test_sharded_dtensor_buffers_go_across_replicas_only() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        m = nn.Module()
        m.register_buffer("plain", torch.ones(3))
        m.register_buffer("copied", DTensor.from_local(torch.full((2,), 2.0), mesh, [Replicate()]))
        m.register_buffer("split", DTensor.from_local(torch.full((4,), 3.0), mesh, [Shard(0)]))
        wire = Recorder()
        broadcast_buffers(m, wire, once)
        assert [across for _, across in wire.sent] == ["world", "replicas"]
        world, replicas = (t for t, _ in wire.sent)
        assert world.view(torch.float32)[:3].tolist() == [1.0, 1.0, 1.0]
        assert world.view(torch.float32)[4:6].tolist() == [2.0, 2.0]  # second buffer at a 16-byte offset
        assert replicas.view(torch.float32).tolist() == [3.0, 3.0, 3.0, 3.0]
        follower = Follower([torch.zeros_like(world), torch.zeros_like(replicas)])
        broadcast_buffers(m, follower, once)
        assert m.split.to_local().tolist() == [0.0] * 4 and m.plain.tolist() == [0.0] * 3
    finally:
        dist.destroy_process_group()


def test_unchanged_buffers_cost_no_collective_unless_some_rank_voted_for_one() -> None:
    from types import SimpleNamespace

    from lightning_recover.recovery.state import StepRequests

    engine = _Engine()
    trainer, m, cb, coll = _Trainer(_Strategy(4)), model(0), BufferSync(), collectives(engine)

    def step(others_changed: float) -> float:
        st = SimpleNamespace(requests=StepRequests())
        cb.on_before_reduce(trainer, m, st, coll)  # type: ignore[arg-type]
        mine = st.requests.votes["buffers_changed"]
        st.requests.vote_totals = {"buffers_changed": mine + others_changed}  # the step's head reduction sums the votes
        cb.on_before_commit(trainer, m, st)  # type: ignore[arg-type]
        cb.on_step_committed(trainer, m, {"step": 0}, coll)
        return mine

    assert step(0.0) == 1.0 and engine.collectives == 1  # never synced yet: sync
    assert step(0.0) == 0.0 and engine.collectives == 1 and cb.last_bytes == 0  # nobody changed anything
    assert step(2.0) == 0.0 and engine.collectives == 2  # two other ranks' buffers moved: everyone syncs
    next(iter(m.buffers())).add_(1)
    assert step(0.0) == 1.0 and engine.collectives == 3  # this rank's moved
    assert step(0.0) == 0.0 and engine.collectives == 3
