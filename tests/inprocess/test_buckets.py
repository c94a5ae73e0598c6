"""Bucket planning and per-bucket world-epoch bookkeeping of the communicator (no mpiexec).

The last group of tests builds a FaultTolerantComm in this very process: mpi4py starts
it as an MPI singleton (a world of one rank), where a SUM all-reduce is the identity. That
is enough to check the staging, widening, snapshot and rollback paths on real buffers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_recover.comm.buckets import Bucket, ReduceHandle, plan_buckets
from lightning_recover.comm.communicator import FaultTolerantComm
from lightning_recover.runtime import lifecycle

sizes_st = st.lists(st.integers(0, 300), max_size=12)
bucket_st = st.integers(1, 128)


def _covered(buckets: list[Bucket]) -> list[tuple[int, int]]:
    """Every (tensor index, element) pair, in bucket order."""
    return [(ti, k) for b in buckets for ti, s, e in b.segments for k in range(s, e)]


@settings(deadline=None)
@given(sizes_st, bucket_st)
def test_every_element_covered_exactly_once_in_order(sizes: list[int], bucket: int) -> None:
    buckets = plan_buckets(sizes, bucket)
    expected = [(ti, k) for ti, n in enumerate(sizes) for k in range(n)]
    # Exactly once AND in the original order (tensor by tensor, element by element).
    assert _covered(buckets) == expected


@settings(deadline=None)
@given(sizes_st, bucket_st)
def test_bucket_sizes(sizes: list[int], bucket: int) -> None:
    buckets = plan_buckets(sizes, bucket)
    for b in buckets:
        assert 0 < b.numel <= bucket
        assert b.numel == sum(e - s for _, s, e in b.segments)
        assert all(e > s for _, s, e in b.segments), "no empty segments"
        assert b.world_epoch is None, "a fresh plan has no completed bucket"
    # Greedy packing: every bucket but the last is full, so the count is minimal.
    assert all(b.numel == bucket for b in buckets[:-1])
    assert len(buckets) == -(-sum(sizes) // bucket)


@settings(deadline=None)
@given(sizes_st, bucket_st)
def test_segments_are_contiguous_runs(sizes: list[int], bucket: int) -> None:
    segs = [seg for b in plan_buckets(sizes, bucket) for seg in b.segments]
    # Consecutive segments of one tensor continue where the previous stopped; a tensor
    # appears in one run of segments (its chunks are never interleaved with another's).
    for (t0, _, e0), (t1, s1, _) in zip(segs, segs[1:]):
        assert t1 > t0 or (t1 == t0 and s1 == e0)
    assert [t for t, _, _ in segs] == sorted(t for t, _, _ in segs)


def test_small_tensors_share_and_large_ones_are_cut() -> None:
    buckets = plan_buckets([3, 2, 10, 1], 4)
    assert [b.segments for b in buckets] == [
        [(0, 0, 3), (1, 0, 1)],
        [(1, 1, 2), (2, 0, 3)],
        [(2, 3, 7)],
        [(2, 7, 10), (3, 0, 1)],
    ]
    # A tensor exactly one bucket long gets a single-segment (zero-copy) bucket.
    assert [b.segments for b in plan_buckets([4, 4], 4)] == [[(0, 0, 4)], [(1, 0, 4)]]


def test_empty_inputs() -> None:
    assert plan_buckets([], 8) == []
    assert plan_buckets([0, 0], 8) == []
    assert [b.segments for b in plan_buckets([0, 5, 0], 8)] == [[(1, 0, 5)]]


@pytest.mark.parametrize("bad", [0, -1, -100])
def test_bad_bucket_size_named(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"bucket size must hold at least one element, got {bad}\b"):
        plan_buckets([10], bad)


# ------------------------------------------------------------------------------ ReduceHandle
def _handle(world_epochs: list[int | None]) -> ReduceHandle:
    return ReduceHandle([Bucket([(0, i, i + 1)], 1, world_epoch=e) for i, e in enumerate(world_epochs)])


def test_stale_and_pending() -> None:
    h = _handle([0, 0, 1, None, 1])
    # In world epoch 1: buckets 0-1 completed under world epoch 0 (stale), 3 never completed.
    assert h.stale(1) == [0, 1]
    assert h.pending(1) == [0, 1, 3]
    assert not h.complete(1)
    # Seen from world epoch 0, the world-epoch-1 buckets are the "other" ones.
    assert h.stale(0) == [2, 4]
    assert h.pending(0) == [2, 3, 4]


def test_fresh_and_finished_handles() -> None:
    fresh = _handle([None, None])
    assert fresh.stale(0) == [] and fresh.pending(0) == [0, 1] and not fresh.complete(0)
    done = _handle([3, 3])
    assert done.stale(3) == [] and done.pending(3) == [] and done.complete(3)
    assert done.stale(4) == [0, 1] and not done.complete(4)
    assert _handle([]).complete(0)


@settings(deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 4)), max_size=20), st.integers(0, 4))
def test_stale_pending_properties(world_epochs: list[int | None], world_epoch: int) -> None:
    h = _handle(world_epochs)
    stale, pending = h.stale(world_epoch), h.pending(world_epoch)
    never = [i for i, e in enumerate(world_epochs) if e is None]
    assert set(stale) <= set(pending)
    assert sorted(set(stale) | set(never)) == pending  # pending = stale + never completed
    assert all(world_epochs[i] == world_epoch for i in range(len(world_epochs)) if i not in pending)
    assert h.complete(world_epoch) == (not pending)


# ------------------------------------------------------------------------------ singleton comm
@pytest.fixture(scope="module")
def comm():
    lifecycle.prepare_mpi()  # as the strategy does: no MPI_Finalize when pytest exits
    c = FaultTolerantComm(bucket_bytes=64)  # 16 fp32 elements per bucket
    yield c
    c.free()


def test_plan_uses_bucket_bytes_and_widened_itemsize(comm: FaultTolerantComm) -> None:
    assert [b.numel for b in comm.plan([torch.zeros(40)]).buckets] == [16, 16, 8]
    assert [b.numel for b in comm.plan([torch.zeros(40, dtype=torch.float64)]).buckets] == [8] * 5
    # 16-bit tensors are reduced in fp32, so a bucket holds bucket_bytes / 4 of them.
    assert [b.numel for b in comm.plan([torch.zeros(40, dtype=torch.bfloat16)]).buckets] == [16, 16, 8]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.float16])
def test_singleton_reduce_is_identity_out_of_place(comm: FaultTolerantComm, dtype: torch.dtype) -> None:
    tensors = [torch.arange(n).to(dtype) for n in (5, 40, 1, 17)]
    out = [torch.full_like(t, -7) for t in tensors]
    handle = comm.allreduce(tensors, out)
    assert all(torch.equal(a, b) for a, b in zip(tensors, out))
    assert handle.complete(comm.world_epoch) and all(b.world_epoch == comm.world_epoch for b in handle.buckets)


def test_resume_redoes_only_pending_buckets(comm: FaultTolerantComm) -> None:
    src = [torch.arange(48, dtype=torch.float32)]
    out = [torch.zeros(48)]
    handle = comm.plan(src)
    visited: list[int] = []
    comm.allreduce(src, out, handle=handle, on_bucket=visited.append)
    assert visited == [0, 1, 2]
    handle.buckets[1].world_epoch = None  # as if bucket 1 was interrupted
    visited.clear()
    comm.allreduce(src, out, handle=handle, on_bucket=visited.append)
    assert visited == [1]


def test_tensor_errors_are_named(comm: FaultTolerantComm) -> None:
    with pytest.raises(ValueError, match="got 2 input tensors but 1 outputs"):
        comm.allreduce([torch.zeros(2), torch.zeros(2)], [torch.zeros(2)])
    with pytest.raises(ValueError, match=r"tensor 1: output \(3,\)/torch.float32 does not match input \(2,\)/torch.float32"):
        comm.allreduce([torch.zeros(2), torch.zeros(2)], [torch.zeros(2), torch.zeros(3)])
    with pytest.raises(ValueError, match="tensor 0 is not contiguous"):
        comm.allreduce([torch.zeros(4, 4).t()], [torch.zeros(4, 4)])
    with pytest.raises(TypeError, match="tensor 0 has dtype torch.complex64, which cannot be summed over MPI"):
        comm.allreduce([torch.zeros(4, dtype=torch.complex64)], [torch.zeros(4, dtype=torch.complex64)])
    with pytest.raises(ValueError, match="across must be 'replicas' or 'world', got 'nodes'"):
        comm.allreduce([torch.zeros(4)], [torch.zeros(4)], across="nodes")


def test_after_bucket_sees_each_bucket_tagged_with_the_current_world_epoch(comm: FaultTolerantComm) -> None:
    src = [torch.arange(48, dtype=torch.float32)]
    out = [torch.zeros(48)]
    handle = comm.plan(src)
    order: list[tuple[str, int]] = []
    tags: list[int | None] = []

    def after(i: int) -> None:
        order.append(("after", i))
        tags.append(handle.buckets[i].world_epoch)

    comm.allreduce(src, out, handle=handle, on_bucket=lambda i: order.append(("before", i)), after_bucket=after)
    assert order == [("before", 0), ("after", 0), ("before", 1), ("after", 1), ("before", 2), ("after", 2)]
    assert tags == [comm.world_epoch] * 3
    assert torch.equal(out[0], src[0])
