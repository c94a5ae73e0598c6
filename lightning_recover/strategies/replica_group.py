"""torch's default process group, made replica-local.

Lightning runs hidden collectives on torch's default group (e.g. a SIGTERM check every
batch). Making that group *this replica's S ranks* keeps them inside one replica, so a
dead replica can never wedge them; the cross-replica traffic goes over the ULFM
communicator instead. A communication error inside the group therefore means a
replica-mate died, which the replica-consistency gate turns into a clean exit.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_recover.comm import netaddr
from lightning_recover.comm.communicator import FaultTolerantComm
from lightning_recover.comm.replica_plane import ReplicaPlaneError
from lightning_recover.runtime import lifecycle


def init_replica_group(
    comm: FaultTolerantComm, shards: int, timeout_s: float, backend: str, gather: Callable[[Any], list[Any]]
) -> None:
    """``init_process_group`` over this replica's ranks, on a TCPStore hosted by its shard 0.

    ``gather`` collects one value from each rank of this replica, by shard (e.g. the
    ``allgather`` of the replica's MPI communicator).

    A replica on one host meets on the loopback. One that spans hosts meets at shard 0's
    address on its route to a mate's host (:func:`lightning_recover.comm.netaddr.reachable_address`;
    not what its own name resolves to, ``127.0.1.1`` on Debian), and every rank points gloo at
    its interface towards the mates (:func:`lightning_recover.comm.netaddr.prepare_gloo`)."""
    hosts = gather(socket.gethostname())
    addr = netaddr.reachable_address(hosts)
    if backend == "gloo":
        netaddr.prepare_gloo(hosts)
    timeout = timedelta(seconds=timeout_s)
    store = None
    if comm.shard == 0:
        # Port 0: the OS picks a free port at bind time, so no other process can take it
        # between choosing and binding; the port actually bound is then shared.
        store = dist.TCPStore(addr, 0, shards, is_master=True, timeout=timeout, wait_for_workers=False)
    master_addr, master_port = gather((addr, store.port if store is not None else 0))[0]
    if store is None:
        store = dist.TCPStore(master_addr, int(master_port), shards, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=comm.shard, world_size=shards, timeout=timeout)


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from a replica-local collective whose peer is gone."""
    if isinstance(exc, (ReplicaPlaneError, getattr(dist, "DistError", ()))):
        return True
    text = str(exc).lower()
    return any(k in text for k in ("gloo", "connection closed", "connection reset", "broken pipe", "nccl"))


@contextmanager
def replica_guard(where: str, comm: Callable[[], FaultTolerantComm | None], shards: int) -> Iterator[None]:
    """A communication error inside the replica means a replica-mate died: leave via the gate.

    ``comm()``: this rank's communicator (None before the job started: nothing to guard)."""
    try:
        yield
    except Exception as exc:
        rank_comm = comm()
        if shards > 1 and rank_comm is not None and is_comm_error(exc):
            if rank_comm.may_be_orphaned:
                # Salvage: the other replicas must repair with this rank in it, where it becomes an orphan
                # (the repair raises Orphaned here); revoking the world sends them there.
                rank_comm.peer_failure(where)
                rank_comm.agree(False)
                rank_comm.repair()
            lifecycle.gate_exit(rank_comm.rank, f"replica-local collective failed during {where}: {exc}")
        raise
