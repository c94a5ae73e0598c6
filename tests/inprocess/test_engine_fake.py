"""FakeWorld keeps the communicator contract with ULFM's semantics (what test_engine.py relies on).

The same behaviours test_communicator_mpi.py checks on real ULFM processes: sums, world
epoch tags, PeerFailure releasing every blocked peer, uniform agreement, repair to whole
replicas with one more round per death inside it, and the replica-consistency gate; plus
the fake's own guarantees: a protocol that would hang fails fast with "deadlock in
FakeWorld", and ranks that call different collectives are caught.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from lightning_recover.comm.interface import PeerFailure, RepairResult
from lightning_recover.testing.fake import FakeComm, FakeWorld
from lightning_recover.testing.fake_faults import Died, Kill, RankDeath


def values(comm: FakeComm, n: int = 7, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return (torch.arange(n) + 10 * comm.rank).to(dtype)


def reduce_agree_repair(comm: FakeComm) -> tuple[bool, RepairResult | None, torch.Tensor, list[int]]:
    """One round as the engine runs it; after a repair, the stale buckets are reduced again."""
    t = values(comm)
    out = torch.empty_like(t)
    handle = comm.plan([t])
    try:
        comm.allreduce([t], [out], handle=handle)
        ok = True
    except PeerFailure:
        ok = False
    if comm.agree(ok):
        return True, None, out, []
    res = comm.repair()
    stale = handle.stale(res.world_epoch)
    comm.allreduce([t], [out], handle=handle)
    assert handle.complete(comm.world_epoch)
    return False, res, out, stale


def test_allreduce_sums_tags_buckets_and_calls_back_in_order() -> None:
    world = FakeWorld(3, bucket_numel=3)
    seen: dict[int, list[tuple[str, int]]] = {}

    def fn(comm: FakeComm) -> tuple[torch.Tensor, torch.Tensor, list[int | None]]:
        t = values(comm)
        out = torch.empty_like(t)
        calls = seen.setdefault(comm.rank, [])
        h = comm.allreduce(
            [t], [out], on_bucket=lambda i: calls.append(("before", i)), after_bucket=lambda i: calls.append(("after", i))
        )
        return t, out, [b.world_epoch for b in h.buckets]

    results = world.run(fn)
    total = sum(values(world.comm(r)) for r in range(3))
    for r, (t, out, epochs) in results.items():  # type: ignore[misc]
        assert torch.equal(out, total) and torch.equal(t, values(world.comm(r)))  # out of place: input intact
        assert epochs == [0, 0, 0]
        assert seen[r] == [("before", 0), ("after", 0), ("before", 1), ("after", 1), ("before", 2), ("after", 2)]


def test_stale_buckets_are_reduced_again_from_the_local_values() -> None:
    world = FakeWorld(3, bucket_numel=2, kills=[Kill(1, "bucket", bucket=2)])
    results = world.run(reduce_agree_repair)
    assert isinstance(results[1], Died) and results[1].how == "killed"
    survivors_sum = values(world.comm(0)) + values(world.comm(2))
    for r in (0, 2):
        committed, res, out, stale = results[r]  # type: ignore[misc]
        assert not committed and res is not None
        assert (res.world_epoch, res.lost_ranks, res.lost_replicas, res.alive_replicas, res.rounds) == (1, (1,), (1,), (0, 2), 1)
        assert stale == [0, 1]  # completed with rank 1 in them; bucket 2 never completed
        # The rank-1 share of buckets 0 and 1 is gone: the intact local values were reduced again.
        assert torch.equal(out, survivors_sum)


def test_a_death_in_the_middle_of_a_reduction_reaches_only_part_of_the_world() -> None:
    world = FakeWorld(3, bucket_numel=2, kills=[Kill(1, "bucket", bucket=1, mid=True)])
    results = world.run(reduce_agree_repair)
    # Rank 0 (below the victim) completed bucket 1 with rank 1's share in it; rank 2 did not.
    assert results[0][3] == [0, 1] and results[2][3] == [0]  # type: ignore[index]
    survivors_sum = values(world.comm(0)) + values(world.comm(2))
    assert all(torch.equal(results[r][2], survivors_sum) for r in (0, 2))  # type: ignore[index]
    with pytest.raises(ValueError, match="Kill.mid applies to a reduction"):
        Kill(0, "agree", mid=True)


def test_agree_is_the_and_of_the_flags_the_same_everywhere() -> None:
    world = FakeWorld(4)
    assert set(world.run(lambda c: c.agree(True)).values()) == {True}
    assert set(world.run(lambda c: c.agree(c.rank != 2)).values()) == {False}
    assert world.comm(0).world_epoch == 0  # a False flag is no failure: nothing to repair


def test_a_death_during_the_agreement_makes_it_false_for_every_survivor() -> None:
    world = FakeWorld(4, kills=[Kill(3, "agree", call=2)])

    def fn(comm: FakeComm) -> tuple[bool, bool, RepairResult | None]:
        first = comm.agree(True)
        second = comm.agree(True)
        return first, second, None if second else comm.repair()

    results = world.run(fn)
    assert results[3] == Died(3, "killed", results[3].where)  # type: ignore[union-attr]
    for r in (0, 1, 2):
        first, second, res = results[r]  # type: ignore[misc]
        assert first is True and second is False
        assert res is not None and res.lost_replicas == (3,) and res.world_epoch == 1


def test_peer_failure_releases_every_blocked_peer_and_the_gate_takes_the_partner() -> None:
    # 3 replicas x 2 shards; rank 2 (replica 1, shard 0) dies before bucket 1. Shard-0 peers
    # see PeerFailure; its partner rank 3 must leave; shard-1 peers are released by the revoke
    # (or fail in the world reduce): nobody hangs, everybody agrees False, replica 1 goes whole.
    world = FakeWorld(3, shards=2, bucket_numel=2, kills=[Kill(2, "bucket", bucket=1)])

    def fn(comm: FakeComm) -> tuple[bool, RepairResult | None]:
        t = values(comm)
        try:
            comm.allreduce([t], [torch.empty_like(t)])
            comm.allreduce([torch.ones(2)], [torch.empty(2)], across="world")
            ok = True
        except PeerFailure as exc:
            assert 2 in exc.lost_ranks or 3 in exc.lost_ranks
            ok = False
        agreed = comm.agree(ok)
        return agreed, None if agreed else comm.repair()

    results = world.run(fn)
    assert results[2].how == "killed" and results[3].how == "gate"  # type: ignore[union-attr]
    for r in (0, 1, 4, 5):
        agreed, res = results[r]  # type: ignore[misc]
        assert not agreed and res is not None
        assert (res.lost_ranks, res.lost_replicas, res.alive_replicas) == ((2, 3), (1,), (0, 2))
        assert world.comm(r).members == (0, 1, 4, 5)


def test_a_death_inside_the_repair_costs_another_round() -> None:
    world = FakeWorld(4, kills=[Kill(0, "agree"), Kill(2, "repair", round=1), Kill(3, "repair", round=2)])

    def fn(comm: FakeComm) -> RepairResult:
        assert not comm.agree(True)
        return comm.repair()

    results = world.run(fn)
    res = results[1]
    assert isinstance(res, RepairResult)
    assert (res.world_epoch, res.lost_ranks, res.alive_replicas, res.rounds) == (1, (0, 2, 3), (1,), 3)
    assert world.comm(1).is_leader and world.comm(1).members == (1,)
    assert not world.unfired


def test_a_rank_dies_from_its_own_code_and_never_acts_again() -> None:
    world = FakeWorld(2)

    def fn(comm: FakeComm) -> str:
        if comm.rank == 1:
            try:
                comm.die("a simulated SIGKILL")
            except Exception:  # noqa: BLE001 - the point: a death is not an Exception
                return "caught by except Exception"
            except RankDeath:
                pass
            comm.agree(True)  # a dead rank's communicator refuses: RankDeath again
            return "acted after its death"
        return "ok" if comm.agree(True) else "saw the death"

    assert world.run(fn) == {0: "saw the death", 1: Died(1, "killed", "a simulated SIGKILL")}


def test_a_crash_is_a_death_for_the_peers_and_an_error_for_the_test() -> None:
    def fn(comm: FakeComm) -> bool:
        if comm.rank == 1:
            raise ValueError("bug in rank code")
        return comm.agree(True)

    with pytest.raises(ValueError, match="bug in rank code") as info:
        FakeWorld(3).run(fn)
    assert any("simulated rank 1" in n for n in info.value.__notes__)
    results = FakeWorld(3).run(fn, raise_errors=False)
    assert results[0] is False and results[2] is False
    assert isinstance(results[1], Died) and results[1].how == "crashed" and isinstance(results[1].error, ValueError)


def test_a_protocol_that_would_hang_fails_fast() -> None:
    world = FakeWorld(2, timeout=0.3)
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"deadlock in FakeWorld: rank 0 waited .* for ranks \[1\]"):
        world.run(lambda c: c.agree(True) if c.rank == 0 else None)
    assert time.monotonic() - started < 5


def test_ranks_calling_different_collectives_are_caught() -> None:
    world = FakeWorld(2, bucket_numel=8)
    with pytest.raises(AssertionError, match="SPMD mismatch in FakeWorld"):
        world.run(lambda c: c.allreduce([torch.ones(3 + 2 * c.rank)], [torch.empty(3 + 2 * c.rank)]))


def test_sixteen_bit_tensors_are_summed_in_fp32() -> None:
    world = FakeWorld(2, bucket_numel=4)

    def fn(comm: FakeComm) -> torch.Tensor:
        t = torch.full((6,), 256.0 if comm.rank == 0 else 1.0, dtype=torch.bfloat16)
        out = torch.empty_like(t)
        comm.allreduce([t], [out])
        return out

    for out in world.run(fn).values():
        assert out.dtype == torch.bfloat16 and torch.equal(out, torch.full((6,), 257.0).to(torch.bfloat16))


def test_scripted_kills_are_checked_and_unfired_ones_are_listed() -> None:
    with pytest.raises(ValueError, match="Kill.at must be one of bucket, world, agree, repair"):
        Kill(0, "forward")
    with pytest.raises(ValueError, match="Kill.call counts from 1"):
        Kill(0, "agree", call=0)
    with pytest.raises(ValueError, match=r"Kill.rank 4 is not a rank of this world \(0..3\)"):
        FakeWorld(2, shards=2, kills=[Kill(4, "agree")])
    world = FakeWorld(2, kills=[Kill(1, "agree", call=5)])
    world.run(lambda c: c.agree(True))
    assert world.unfired == [Kill(1, "agree", call=5)] and world.dead == {}


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(ValueError, match="across must be 'replicas' or 'world', got 'shards'"):
        FakeWorld(1).comm(0).allreduce([torch.ones(1)], [torch.empty(1)], across="shards")
    with pytest.raises(ValueError, match="does not match input"):
        FakeWorld(1).comm(0).allreduce([torch.ones(2)], [torch.empty(3)])
    with pytest.raises(ValueError, match=r"rank 3 out of range 0..1"):
        FakeWorld(2).comm(3)


# ---------------------------------------------------------------------- hot re-join
def test_spawn_replaces_only_a_repaired_replica() -> None:
    world = FakeWorld(2)

    def fn(comm: FakeComm) -> tuple[int, ...]:
        if comm.rank == 0:
            with pytest.raises(ValueError, match=r"spawn\(1\): replica 1 is alive"):
                world.spawn(1, lambda c: None)
        comm.agree(True)
        if comm.rank == 1:
            comm.die()
        assert not comm.agree(True)  # rank 1 is dead, not yet repaired
        with pytest.raises(ValueError, match=r"still a member of world epoch 0; repair the world first"):
            world.spawn(1, lambda c: None)
        comm.repair()
        # Several survivors may ask for the same replacement: one starts.
        assert world.spawn(1, lambda c: c.join().joined, request="r1")
        assert not world.spawn(1, lambda c: None, request="r1") and not world.spawn(1, lambda c: None)
        return comm.merge(wait_for=[1]).joined

    assert world.run(fn) == {0: (1,), 1: (1,)}
    assert [(d.rank, d.life) for d in world.deaths] == [(1, 0)] and world.dead == {}
    assert world.comm(1).life == 1 and world.comm(1).world_epoch == world.comm(0).world_epoch == 2
    with pytest.raises(RuntimeError, match=r"spawn\(\) outside run\(\)"):
        world.spawn(1, lambda c: None)
    with pytest.raises(ValueError, match=r"Kill\(at='join'\) strikes a replacement: give life >= 1"):
        Kill(1, "join")


def test_merge_admits_ready_replicas_shard_by_shard_and_fails_alike_on_a_death() -> None:
    # 3 replicas x 2 shards. Replica 2 dies and is replaced; the first merge is broken by the
    # death of rank 1 (replica 0's shard 1, so replica 0 goes whole): nobody is admitted,
    # everyone sees PeerFailure. After the repair, the merge admits replica 2, and each of
    # its ranks receives the payload of the lowest survivor holding its shard.
    world = FakeWorld(3, shards=2, kills=[Kill(4, "agree"), Kill(1, "merge")])

    def joiner(comm: FakeComm) -> tuple[Any, int, tuple[int, ...]]:
        adm = comm.join()
        assert comm.agree(True)  # a member like any other from now on
        return adm.payload, adm.world_epoch, adm.alive_replicas

    def survivor(comm: FakeComm) -> tuple[str, Any, int]:
        assert not comm.agree(True)
        comm.repair()
        world.spawn(2, joiner, request="replica 2")
        try:
            comm.merge(f"state of rank {comm.rank}", wait_for=[2])
            first = "merged"
        except PeerFailure:
            first = "PeerFailure"
        comm.repair()
        merged = comm.merge(f"state of rank {comm.rank}", wait_for=[2])
        assert comm.agree(True)
        return first, merged.joined, merged.world_epoch

    results = world.run(survivor)
    assert results[2] == results[3] == ("PeerFailure", (2,), 3)
    assert results[4] == ("state of rank 2", 3, (1, 2)) and results[5] == ("state of rank 3", 3, (1, 2))
    assert world.comm(4).members == (2, 3, 4, 5) and not world.unfired
