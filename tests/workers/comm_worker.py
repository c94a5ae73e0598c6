"""MPI worker for the communicator fault tests: one scenario per run, one JSON result per rank."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

from lightning_recover.comm.communicator import FaultTolerantComm
from lightning_recover.comm.interface import PeerFailure
from lightning_recover.comm.topology import RankLayout
from lightning_recover.runtime import lifecycle

torch.set_num_threads(1)


def rank_data(rank: int, sizes: list[int], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    # Small integers: sums are exact in fp32, so "exactly the right sums" is checkable.
    return [torch.arange(n, dtype=torch.float64).remainder(97).add(rank + 1).mul(rank + 1).to(dtype) for n in sizes]


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def reduce_until_agreed(comm: FaultTolerantComm, tensors, out, kill_at_bucket=None, kill_before_agree=False, kill_in_repair=None):
    handle = comm.plan(tensors)
    events = []
    completed = []  # (bucket, its tag == the world epoch when after_bucket saw it, world epoch)

    def on_bucket(i: int) -> None:
        if kill_at_bucket is not None and i == kill_at_bucket:
            die()

    def after_bucket(i: int) -> None:
        completed.append([i, handle.buckets[i].world_epoch == comm.world_epoch, comm.world_epoch])

    while True:
        try:
            comm.allreduce(tensors, out, handle=handle, on_bucket=on_bucket, after_bucket=after_bucket)
            ok = True
        except PeerFailure as exc:
            ok = False
            events.append({"failure": list(exc.lost_ranks), "where": exc.where})
        if kill_before_agree:
            die()
        agreed = comm.agree(ok)
        events.append({"agree_in": ok, "agreed": agreed, "world_epoch": comm.world_epoch})
        if agreed:
            return handle, events, completed
        stale_before = handle.stale(comm.world_epoch + 1)
        if kill_in_repair:
            comm.fault_hook = lambda point: die() if point == "repair:shrunk" else None
        res = comm.repair()
        events.append(
            {
                "repair": {"world_epoch": res.world_epoch, "lost_ranks": list(res.lost_ranks), "lost_replicas": list(res.lost_replicas),
                           "alive": list(res.alive_replicas), "seconds": res.seconds, "rounds": res.rounds},
                "stale": stale_before,
                "stale_after_repair": handle.stale(comm.world_epoch),
            }
        )


def main() -> None:
    scenario = sys.argv[1]
    victims = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 and sys.argv[2] else []
    shards = int(os.environ.get("LR_SHARDS", "1"))
    # The strategy's start-up, in its order: MPI settings, the communicator, then the rank's lifecycle.
    lifecycle.prepare_mpi()
    from mpi4py import MPI

    layout = RankLayout(MPI.COMM_WORLD.Get_size(), shards)
    sizes = [1000, 37, 5000, 1, 2500]
    comm = FaultTolerantComm(layout, bucket_bytes=4 * 1024)  # 1024 fp32 per bucket -> 9 buckets
    lifecycle.start_rank(comm.rank, layout.world_size)
    rank = comm.rank
    result: dict = {"rank": rank, "replica": comm.replica, "shard": comm.shard}
    if scenario in {"fp16", "bf16"}:
        dtype = torch.bfloat16 if scenario == "bf16" else torch.float16
        gen = torch.Generator().manual_seed(1234)
        all_data = [torch.randn(4096, generator=gen, dtype=torch.float64) for _ in range(layout.world_size)]
        mine = all_data[rank].to(dtype)
        ref = sum(t.to(dtype).double() for t in all_data)
        out = torch.empty_like(mine)
        comm.allreduce([mine], [out], across="world")
        err = (out.double() - ref).abs()
        tol = torch.finfo(dtype).eps * ref.abs() + 1e-3
        result.update(max_err=float(err.max()), within=bool((err <= tol).all()), dtype=str(dtype))
    elif scenario == "lost_quorum_waiting_on_a_live_peer":
        # The victims die; each other rank waits for a message from a live peer that never sends it
        # (as a rank waits on a replacement no failure detector watches): no MPI call of theirs fails.
        comm.barrier()
        if rank in victims:
            die()
        peer = next(r for r in range(layout.world_size) if r not in victims and r != rank)
        request = comm.world.Irecv(bytearray(8), source=peer, tag=77)
        deadline = time.monotonic() + 120
        while not request.Test() and time.monotonic() < deadline:
            time.sleep(0.01)
        result["woke"] = True
    else:
        tensors = rank_data(rank, sizes)
        out = [torch.empty_like(t) for t in tensors]
        comm.barrier()
        kwargs = {}
        if rank in victims:
            if scenario == "kill_reduce":
                kwargs["kill_at_bucket"] = 3
            elif scenario == "kill_before_agree":
                kwargs["kill_before_agree"] = True
            elif scenario == "kill_in_repair":
                # First victim dies in the reduce; the second dies while the others repair.
                if rank == victims[0]:
                    kwargs["kill_at_bucket"] = 3
                else:
                    kwargs["kill_in_repair"] = True
        handle, events, completed = reduce_until_agreed(comm, tensors, out, **kwargs)
        members = comm.members
        alive_same_shard = [r for r in members if layout.shard_of(r) == comm.shard]
        expected = [sum(rank_data(r, sizes)[i] for r in alive_same_shard) for i in range(len(sizes))]
        result.update(
            exact=all(torch.equal(a, b) for a, b in zip(out, expected)),
            world_epoch=comm.world_epoch,
            members=list(members),
            alive_replicas=list(comm.alive_replicas),
            buckets=len(handle.buckets),
            bucket_world_epochs=[b.world_epoch for b in handle.buckets],
            events=events,
            completed=completed,
            local_unchanged=all(torch.equal(a, b) for a, b in zip(tensors, rank_data(rank, sizes))),
            leader=comm.is_leader,
        )
    with open(os.path.join(os.environ["LR_TEST_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    lifecycle.end_job(comm, exit_code=0)


if __name__ == "__main__":
    main()
