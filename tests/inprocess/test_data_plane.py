"""The data plane's contract, in one process (no mpiexec).

The gloo plane runs for real: each "rank" is a thread with its own plane, connected
through a TCPStore the "leader" hosts, as ranks are across processes. The control plane
is a stand-in whose failure detector a test switches on, which is how a real
FaultTolerantComm behaves once ULFM has noticed a death. The last tests build a
FaultTolerantComm in this process (an MPI singleton) with the gloo plane, and the last one
builds one on the MPI plane in a fresh process, to show layer 1 runs without torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_recover.comm.buckets import Bucket
from lightning_recover.comm.data_plane import DataPlaneError, FailedPlane, check_data_plane
from lightning_recover.comm.interface import PeerFailure
from lightning_recover.comm.torch_plane import TorchDistDataPlane, host_store
from lightning_recover.config import ConfigurationError


class FakeControl:
    """A control plane whose failure detector the test switches on; it records every revoke."""

    def __init__(self) -> None:
        self.failed = threading.Event()
        self.revoked: list[str] = []

    def failure_noticed(self) -> bool:
        return self.failed.is_set()

    def peer_failure(self, where: str, error_class: int | None = None) -> PeerFailure:
        self.revoked.append(where)
        return PeerFailure([2] if self.failed.is_set() else [], where, error_class)


def gloo_planes(n: int, world_epoch: int = 0, timeout_s: float = 20.0, store: Any = None) -> tuple[list[TorchDistDataPlane], list[FakeControl]]:
    """``n`` members' planes of one world epoch; member 0 hosts the store (a fresh one unless given)."""
    address = ("127.0.0.1", store.port) if store is not None else None
    if store is None:
        store, address = host_store(["this-host"], timeout_s)
    controls = [FakeControl() for _ in range(n)]
    planes = [
        TorchDistDataPlane("gloo", controls[r], world_epoch=world_epoch, shard=0, rank=r, size=n, address=address,
                           store=store if r == 0 else None, timeout_s=timeout_s)
        for r in range(n)
    ]
    return planes, controls


def on_threads(fns: Sequence[Callable[[], Any]], timeout: float = 30.0) -> list[Any]:
    """Run each function on its own thread (the planes' callers are not the main thread); results or exceptions."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a data plane call hung"
    return out


def local_grads(r: int) -> list[torch.Tensor]:
    return [
        # Exactly representable values, so any summation order gives the same bits.
        torch.arange(7, dtype=torch.float32) * (r + 1) + 0.5,
        (torch.arange(5, dtype=torch.float32) / 4 + r + 100).to(torch.bfloat16),
        torch.arange(4, dtype=torch.int64) * r,
    ]


# One bucket across three dtypes: segments of each are summed in their own staging dtype.
BUCKET = Bucket([(0, 2, 7), (1, 0, 5), (2, 0, 4)], 14)


def test_gloo_plane_sums_a_mixed_bucket_identically_on_every_member_without_touching_the_inputs() -> None:
    planes, _ = gloo_planes(3)
    srcs = [local_grads(r) for r in range(3)]
    before = [[t.clone() for t in s] for s in srcs]
    dsts = [[torch.full_like(t, -1) for t in s] for s in srcs]
    results = on_threads([lambda r=r: planes[r].reduce(BUCKET, srcs[r], dsts[r], "bucket 0") for r in range(3)])
    assert results == [None, None, None]
    expect_f32 = sum(s[0] for s in srcs)
    # bf16 is summed in fp32, then rounded once (the sums, >= 300, are not bf16-exact).
    expect_bf16 = sum(s[1].float() for s in srcs).to(torch.bfloat16)
    for r in range(3):
        assert torch.equal(dsts[r][0][2:], expect_f32[2:]) and torch.equal(dsts[r][0][:2], torch.full((2,), -1.0))
        assert torch.equal(dsts[r][1], expect_bf16)
        assert torch.equal(dsts[r][2], torch.arange(4) * 3)
        assert all(torch.equal(a, b) for a, b in zip(srcs[r], before[r])), "the inputs are the rollback copy"
        assert all(torch.equal(a, b) for a, b in zip(dsts[r], dsts[0])), "every member holds the same bits"
        assert planes[r].reductions == 1
    # In place (src is dst) gives the same sums.
    again = [[t.clone() for t in s] for s in srcs]
    on_threads([lambda r=r: planes[r].reduce(BUCKET, again[r], again[r], "bucket 0") for r in range(3)])
    assert torch.equal(again[1][0][2:], expect_f32[2:]) and torch.equal(again[1][0][:2], srcs[1][0][:2])
    for p in planes:
        p.close()


def test_a_plane_per_world_epoch_keyed_by_epoch_and_shard_and_a_closed_one_is_never_used_again() -> None:
    epoch0, controls0 = gloo_planes(3, world_epoch=0)
    srcs = [local_grads(r) for r in range(3)]
    on_threads([lambda r=r: epoch0[r].reduce(BUCKET, srcs[r], [t.clone() for t in srcs[r]], "b") for r in range(3)])
    for p in epoch0:
        p.close()
    # Member 0 "died": the next epoch's leader hosts a new store; two members, new ranks.
    epoch1, _ = gloo_planes(2, world_epoch=1)
    assert epoch1[0].prefix == "lightning_recover/data_plane/epoch1/shard0/" != epoch0[0].prefix
    survivors = srcs[1:]
    dsts = [[torch.zeros_like(t) for t in s] for s in survivors]
    assert on_threads([lambda r=r: epoch1[r].reduce(BUCKET, survivors[r], dsts[r], "b") for r in range(2)]) == [None, None]
    assert torch.equal(dsts[0][2], torch.arange(4) * 3) and torch.equal(dsts[1][0][2:], (survivors[0][0] + survivors[1][0])[2:])
    # A plane of an ended epoch refuses work the way every failure is reported: PeerFailure, after a revoke.
    with pytest.raises(PeerFailure, match="data plane of world epoch 0 was aborted"):
        epoch0[1].reduce(BUCKET, srcs[1], srcs[1], "late bucket")
    assert controls0[1].revoked == ["late bucket (the gloo data plane of world epoch 0 was aborted)"]
    for p in epoch1:
        p.close()


def test_a_noticed_failure_aborts_a_blocked_collective_fast_and_its_late_completion_never_reaches_the_gradients() -> None:
    planes, controls = gloo_planes(3, timeout_s=30.0)
    srcs = [local_grads(r) for r in range(3)]
    on_threads([lambda r=r: planes[r].reduce(BUCKET, srcs[r], [t.clone() for t in srcs[r]], "b") for r in range(3)])  # connect
    dsts = [[torch.zeros_like(t) for t in s] for s in srcs]
    fp32 = Bucket([(0, 2, 7)], 5)  # one collective, so the late member below can complete it alone
    # Member 2 is hung: it never enters the collective; ULFM notices 0.3 s later.
    timer = threading.Timer(0.3, lambda: [c.failed.set() for c in controls[:2]])
    timer.start()
    started = time.monotonic()
    results = on_threads([lambda r=r: planes[r].reduce(fp32, srcs[r], dsts[r], "reduce of bucket 3/9") for r in range(2)])
    waited = time.monotonic() - started
    assert all(isinstance(e, PeerFailure) and e.lost_ranks == (2,) for e in results), results
    assert waited < 5, f"took {waited:.1f}s: the abort must not wait for the 30 s group timeout"
    assert controls[0].revoked == controls[1].revoked == ["reduce of bucket 3/9"]
    # The hung member wakes up and completes its side: the abandoned collectives finish into
    # the planes' own buffers, never into the gradients.
    late = [t.clone() for t in srcs[2]]
    assert on_threads([lambda: planes[2].reduce(fp32, srcs[2], late, "b")]) == [None]
    assert torch.equal(late[0][2:], sum(s[0] for s in srcs)[2:]), "the abandoned collectives did complete"
    time.sleep(0.2)
    assert all(torch.equal(t, torch.zeros_like(t)) for d in dsts[:2] for t in d)
    with pytest.raises(PeerFailure):
        planes[0].reduce(BUCKET, srcs[0], dsts[0], "after the abort")
    planes[2].close()


def test_a_member_that_never_connects_is_left_behind_when_the_failure_is_noticed() -> None:
    planes, controls = gloo_planes(3, timeout_s=30.0)
    srcs = [local_grads(r) for r in range(2)]
    threading.Timer(0.3, lambda: [c.failed.set() for c in controls[:2]]).start()
    started = time.monotonic()
    results = on_threads([lambda r=r: planes[r].reduce(BUCKET, srcs[r], srcs[r], "reduce of bucket 0/9") for r in range(2)])
    assert time.monotonic() - started < 5
    assert all(isinstance(e, PeerFailure) for e in results), results
    assert controls[0].revoked == ["reduce of bucket 0/9: connecting the gloo data plane"]


def test_a_transport_error_is_a_peer_failure_only_once_the_control_plane_confirms_one() -> None:
    planes, controls = gloo_planes(2, timeout_s=1.0)
    srcs = [local_grads(r) for r in range(2)]
    on_threads([lambda r=r: planes[r].reduce(BUCKET, srcs[r], [t.clone() for t in srcs[r]], "b") for r in range(2)])
    planes[1].close()  # its connections close: member 0 sees a reset connection, and ULFM saw nothing
    with pytest.raises(DataPlaneError) as refused:
        planes[0].reduce(BUCKET, srcs[0], [t.clone() for t in srcs[0]], "reduce of bucket 1/9")
    message = str(refused.value)
    assert "the gloo data plane failed during reduce of bucket 1/9 (world epoch 0) and MPI saw no peer fail within 1 s" in message
    assert "raise recover.timeout_s, or set recover.data_plane=mpi" in message

    planes, controls = gloo_planes(2, timeout_s=20.0)
    on_threads([lambda r=r: planes[r].reduce(BUCKET, srcs[r], [t.clone() for t in srcs[r]], "b") for r in range(2)])
    planes[1].close()
    threading.Timer(0.2, controls[0].failed.set).start()  # the transport was faster than ULFM
    with pytest.raises(PeerFailure, match="reduce of bucket 1/9"):
        planes[0].reduce(BUCKET, srcs[0], [t.clone() for t in srcs[0]], "reduce of bucket 1/9")
    assert controls[0].revoked == ["reduce of bucket 1/9"]


def test_a_single_member_copies_without_connecting_and_a_failed_setup_raises_at_the_first_bucket() -> None:
    control = FakeControl()
    # Nobody listens at this address: a single member must not try to reach it.
    alone = TorchDistDataPlane("gloo", control, world_epoch=3, shard=1, rank=0, size=1, address=("127.0.0.1", 1), timeout_s=1.0)
    src = local_grads(1)
    dst = [torch.zeros_like(t) for t in src]
    alone.reduce(BUCKET, src, dst, "b")
    assert torch.equal(dst[0][2:], src[0][2:]) and torch.equal(dst[1], src[1]) and torch.equal(dst[0][:2], torch.zeros(2))
    failed = FailedPlane("gloo", control, 4, 2, "peer failure during broadcast")
    with pytest.raises(PeerFailure, match="the gloo data plane of world epoch 4 was not set up: peer failure during broadcast"):
        failed.reduce(BUCKET, src, dst, "reduce of bucket 0/9")
    assert control.revoked == ["reduce of bucket 0/9 (the gloo data plane of world epoch 4 was not set up: peer failure during broadcast)"]


def test_unusable_data_planes_are_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"recover.data_plane=nccl needs the gradients on CUDA.*recover.data_plane=gloo or mpi"):
        check_data_plane("nccl", "cpu")
    with pytest.raises(ConfigurationError, match=r"data_plane must be one of mpi, gloo, nccl, got 'ucx' \(recover.data_plane='ucx'\)"):
        check_data_plane("ucx", "cpu")
    check_data_plane("gloo", "cpu")
    check_data_plane("mpi", "cpu")
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl', got 'mpi'"):
        TorchDistDataPlane("mpi", FakeControl(), world_epoch=0, shard=0, rank=0, size=1, address=("127.0.0.1", 1))


# ------------------------------------------------------------------------------ a real (singleton) communicator
@pytest.fixture(scope="module")
def gloo_comm():  # type: ignore[no-untyped-def]
    from lightning_recover.comm.communicator import FaultTolerantComm
    from lightning_recover.runtime import lifecycle

    lifecycle.prepare_mpi()  # as the strategy does: no MPI_Finalize when pytest exits
    c = FaultTolerantComm(bucket_bytes=64, data_plane="gloo", plane_timeout_s=10.0)
    yield c
    c.free()


def test_the_communicator_builds_a_gloo_plane_per_world_epoch_and_keeps_world_reductions_on_mpi(gloo_comm: Any) -> None:
    from lightning_recover.comm.data_plane import MPIDataPlane

    comm = gloo_comm
    first = comm.data_plane
    assert isinstance(first, TorchDistDataPlane) and first.kind == "gloo" and first.world_epoch == comm.world_epoch == 0
    assert not comm.failure_noticed()
    tensors = [torch.arange(n).to(dtype) for n, dtype in ((5, torch.float32), (40, torch.bfloat16), (17, torch.int64))]
    out = [torch.full_like(t, -7) for t in tensors]
    handle = comm.allreduce(tensors, out)
    assert all(torch.equal(a, b) for a, b in zip(tensors, out)) and handle.complete(0)
    assert first.reductions == len(handle.buckets)
    head = [torch.ones(3, dtype=torch.float64)]
    comm.allreduce(head, [torch.empty(3, dtype=torch.float64)], across="world")
    assert first.reductions == len(handle.buckets), "the world reduction went over MPI"
    assert isinstance(comm._world_plane, MPIDataPlane)

    result = comm.repair()  # nobody died: still a new world epoch, so a new plane
    assert result.world_epoch == comm.world_epoch == 1
    second = comm.data_plane
    assert isinstance(second, TorchDistDataPlane) and second is not first and second.world_epoch == 1
    with pytest.raises(PeerFailure, match="world epoch 0 was aborted"):
        first.reduce(handle.buckets[0], tensors, out, "stale")
    # The handle's buckets are stale in the new epoch and are reduced again over the new plane.
    assert handle.stale(1) == list(range(len(handle.buckets)))
    comm.allreduce(tensors, out, handle=handle)
    assert handle.complete(1) and second.reductions == len(handle.buckets)


def test_the_communicator_refuses_an_unknown_data_plane() -> None:
    from lightning_recover.comm.communicator import FaultTolerantComm

    with pytest.raises(ValueError, match="data_plane must be one of mpi, gloo, nccl, got 'tcp'"):
        FaultTolerantComm(data_plane="tcp")


def test_the_communicator_imports_builds_and_repairs_without_torch() -> None:
    """Issue 23: benchmarks/scaling_rank.py's ranks run layer 1 alone. Importing the communicator,
    building it on the MPI plane, agreeing, broadcasting codes and repairing load no torch (a fresh
    process: this one has torch already); only tensors or a gloo/NCCL plane bring it in."""
    code = (
        "import sys\n"
        "import lightning_recover.comm.communicator as c\n"
        "assert 'torch' not in sys.modules, 'importing the communicator loaded torch'\n"
        "from lightning_recover.runtime import lifecycle\n"
        "lifecycle.prepare_mpi()\n"
        "comm = c.FaultTolerantComm(bucket_bytes=64)\n"
        "assert 'torch' not in sys.modules, 'building the communicator on the MPI plane loaded torch'\n"
        "print(comm.agree(True), comm.broadcast_codes([7]), comm.repair().world_epoch)\n"
        "assert 'torch' not in sys.modules, 'agreeing, broadcasting codes or repairing loaded torch'\n"
        "comm.free()\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, env=env, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "[7]", "1"], out.stdout
