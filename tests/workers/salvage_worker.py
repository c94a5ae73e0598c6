"""MPI worker for salvage at the communicator's level: 3 replicas x 2 shards, two kills, orphans re-formed.

Rank 2 (replica 1, shard 0) is SIGKILLed in step 1's reduction, rank 5 (replica 2, shard 1) in
step 3's. Their mates 3 and 4 become orphans (``recover.salvage``); at the boundary after the
second loss the survivors seat them as replica 1 (:func:`plan_reformations`), and every member
then reduces once more over the re-formed world (the survivors stop their steps there). One JSON result per rank that ends.
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch

from lightning_recover.comm.communicator import FaultTolerantComm
from lightning_recover.comm.interface import PeerFailure
from lightning_recover.comm.lobby import Orphaned
from lightning_recover.comm.orphans import OrphanSeat, await_seat, connect_orphans, send_seat
from lightning_recover.comm.topology import RankLayout
from lightning_recover.membership.salvage import Orphan, plan_reformations
from lightning_recover.runtime import lifecycle

torch.set_num_threads(1)
KILLS = {1: 2, 3: 5}  # step -> launch rank SIGKILLed in that step's reduction
STEPS = 6


def seat_orphans(comm: FaultTolerantComm, seats: list[int], replica: int, deadline: float) -> bool:
    """The survivors, without the recruiter: seat the orphans ``seats`` (logical ranks, by shard) as ``replica``."""
    from mpi4py import MPI

    members = tuple(comm.launch_rank_of(r) for r in seats)
    port = comm.world.bcast(MPI.Open_port() if comm.is_leader else "", root=0)
    if comm.is_leader:
        for shard, orphan in enumerate(seats):
            send_seat(comm.lobby_of(orphan), orphan, OrphanSeat(comm.layout.rank_of(replica, shard), members, port))
    try:
        merged = comm.duplicate_world().Accept(port, root=0).Merge(high=False)
    except MPI.Exception:
        merged = None
    if comm.is_leader:
        MPI.Close_port(port)
    comm.forget_orphans(seats)
    return comm.grow(merged, deadline=deadline)


def join_as_orphan(comm: FaultTolerantComm, seat: OrphanSeat) -> bool:
    """The orphan, seated: connect and grow the world as ``seat.rank``."""
    connected = connect_orphans(seat)
    if connected is None:
        return False
    comm.take_seat(seat.rank)
    return comm.grow(connected[1])


def reduce_once(comm: FaultTolerantComm, step: int) -> bool:
    """One step's reduction, repaired until agreed; True once it committed."""
    tensors = [torch.full((3000,), float(comm.rank + 1))]
    out = [torch.empty_like(tensors[0])]
    handle = comm.plan(tensors)
    victim = KILLS.get(step)

    def on_bucket(i: int) -> None:
        if comm.launch_rank == victim and i == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    while True:
        try:
            comm.allreduce(tensors, out, handle=handle, on_bucket=on_bucket)
            ok = True
        except PeerFailure:
            ok = False
        if comm.agree(ok):
            return True
        comm.repair()  # an orphan raises Orphaned here


def main() -> None:
    lifecycle.prepare_mpi()
    from mpi4py import MPI

    layout = RankLayout(MPI.COMM_WORLD.Get_size(), 2)
    comm = FaultTolerantComm(layout, bucket_bytes=4 * 1024)
    comm.salvage = True
    lifecycle.start_rank(comm.rank, layout.world_size)
    launch = comm.launch_rank
    result: dict = {"launch_rank": launch, "orphaned": False}
    try:
        for step in range(STEPS):
            if "reformed_at_step" in result:
                break  # the re-formed orphans go straight to the last reduction: meet them there
            reduce_once(comm, step)
            missing = [r for r in range(layout.replicas) if r not in comm.alive_replicas]
            orphans = [Orphan(lobby.world_epoch, r, layout.shard_of(r), comm.orphan_host(r))
                       for lobby in comm.lobbies for r in lobby.orphans]
            for plan in plan_reformations(orphans, missing, layout.shards):
                t0 = time.perf_counter()
                assert seat_orphans(comm, [m.rank for m in plan.orphans], plan.replica, time.monotonic() + 30)
                result["reformed_in_s"] = time.perf_counter() - t0
                result["reformed_at_step"] = step
    except Orphaned as exc:
        result.update(orphaned=True, orphan_lost=list(exc.lost))
        seat = await_seat(exc.lobby, timeout_s=60)
        assert seat is not None, "no seat came"
        assert join_as_orphan(comm, seat), "the orphan's merge failed"
        result["seated_as"] = comm.rank
    # Every member, survivors and re-formed orphans alike: one more reduction over the re-formed world.
    tensors = [torch.full((3000,), float(comm.rank + 1))]
    out = [torch.empty_like(tensors[0])]
    comm.allreduce(tensors, out)
    same_shard = [r for r in comm.members if layout.shard_of(r) == comm.shard]
    result.update(
        rank=comm.rank, members=list(comm.members), alive_replicas=list(comm.alive_replicas), world_epoch=comm.world_epoch,
        exact=bool(torch.equal(out[0], torch.full((3000,), float(sum(r + 1 for r in same_shard))))),
    )
    with open(os.path.join(os.environ["LR_TEST_OUT"], f"rank{launch}.json"), "w") as f:
        json.dump(result, f)
    lifecycle.end_job(comm, exit_code=0)


if __name__ == "__main__":
    main()
