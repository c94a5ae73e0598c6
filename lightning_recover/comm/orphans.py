"""Salvage over ULFM: a broken replica's live ranks wait as orphans and are seated again as a whole replica.

The repair (:meth:`~lightning_recover.comm.communicator.FaultTolerantComm.repair`) shrinks the
world to its live ranks and keeps only whole replicas. With salvage on, a live rank of a broken
replica does not leave through the gate: it keeps the shrunk communicator as its *lobby* and
raises :class:`~lightning_recover.comm.lobby.Orphaned`. The survivors keep the same lobby with its orphans' ranks
(``FaultTolerantComm.lobbies``). Later, at a step boundary, the survivors seat a re-formed
replica (:func:`lightning_recover.membership.salvage.plan_reformations`)::

    SEAT     the leader opens a port and sends each orphan of the re-formation its seat on its
             lobby (JSON: its new logical rank, the launch ranks of the re-formation's members
             by shard, the port): :func:`send_seat` (the recruiter decides when)
    GROUP    the orphans build one communicator of their own with MPI_Comm_create_from_group
             (MPI_Comm_create_group on MPI_COMM_WORLD fails once a rank of the world died)
    SPAWN    only when re-join completes the replica (some shard index has no orphan): the
             orphans spawn the missing ranks themselves and merge with them (orphans first),
             so the replica's ranks reach the survivors as one group; each spawned rank then
             connects to the port with them (:mod:`lightning_recover.cli.joiner`)
    MERGE    the survivors Accept on the port, the orphans Connect; both Merge (survivors
             first) and grow the world (:meth:`~FaultTolerantComm.grow`): the replica is whole again

An orphan only names its mates through the launch's world group, so only ranks of the
launch's own processes become orphans (``FaultTolerantComm.launch_rank``; a seated orphan
is one, and may be orphaned again); a spawned replacement whose replica breaks leaves
through the gate as before. Nothing here imports torch.
"""

from __future__ import annotations

import json
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_recover.comm.lobby import Lobby
from lightning_recover.comm.ulfm import failure_classes, mpi

__all__ = ["LEAVE", "OrphanSeat", "await_seat", "connect_orphans", "dismiss", "send_seat", "survivors_gone"]

#: The leader's seat message to an orphan, on its lobby.
TAG_ORPHAN_SEAT = 7310
#: How often a waiting orphan looks at its lobby (it sleeps in between: no core taken).
ORPHAN_POLL_S = 0.01
#: The ``rank`` of a seat that tells an orphan to leave (training ended, or it was given up).
LEAVE = -1


@dataclass(frozen=True)
class OrphanSeat:
    """What the leader tells an orphan: the logical rank it takes, its mates' launch ranks by shard, the port,
    (seated by the recruiter) the replica's seat as a replacement's JSON, and -- when re-join completes
    the replica -- the arguments of the python that the orphans spawn for the missing ranks and
    where it goes (MPI_Info keys)."""

    rank: int
    members: tuple[int, ...]
    port: str
    seat: str = ""
    #: The arguments of ``python`` that each spawned rank runs, and how many ranks to spawn (0: none).
    spawn_args: tuple[str, ...] = ()
    spawn_count: int = 0
    spawn_info: tuple[tuple[str, str], ...] = ()

    def to_bytes(self) -> bytes:
        return json.dumps({"rank": self.rank, "members": list(self.members), "port": self.port, "seat": self.seat,
                           "spawn_args": list(self.spawn_args), "spawn_count": self.spawn_count,
                           "spawn_info": [list(kv) for kv in self.spawn_info]}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> OrphanSeat:
        msg = json.loads(data.decode())
        return cls(int(msg["rank"]), tuple(int(m) for m in msg["members"]), str(msg["port"]), str(msg.get("seat", "")),
                   tuple(str(a) for a in msg.get("spawn_args", [])), int(msg.get("spawn_count", 0)),
                   tuple((str(k), str(v)) for k, v in msg.get("spawn_info", [])))


def send_seat(lobby: Lobby, orphan: int, seat: OrphanSeat) -> None:
    """The leader: tell ``orphan`` (a logical rank waiting on ``lobby``) its seat."""
    MPI = mpi()
    data = np.frombuffer(seat.to_bytes(), dtype=np.uint8).copy()
    lobby.comm.Send([data, MPI.BYTE], dest=lobby.lobby_rank(orphan), tag=TAG_ORPHAN_SEAT)


def dismiss(lobby: Lobby, orphan: int, reason: str) -> None:
    """The leader: tell ``orphan`` to leave now, ``reason`` in its seat's place (its wait would end it later)."""
    try:
        send_seat(lobby, orphan, OrphanSeat(LEAVE, (), "", reason))
    except mpi().Exception:
        pass  # it died while it waited: nothing to tell


def await_seat(lobby: Lobby, timeout_s: float) -> OrphanSeat | None:
    """The orphan: sleep until a survivor sends a seat on the lobby, at most ``timeout_s``; None: no seat came."""
    MPI = mpi()
    status = MPI.Status()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if lobby.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_ORPHAN_SEAT, status=status):
                data = bytearray(status.Get_count(MPI.BYTE))
                lobby.comm.Recv([data, MPI.BYTE], source=status.Get_source(), tag=TAG_ORPHAN_SEAT)
                return OrphanSeat.from_bytes(bytes(data))
        except MPI.Exception as exc:
            if exc.Get_error_class() not in failure_classes():
                raise
            # A member of the lobby died since: acknowledge it, so that ANY_SOURCE is served again.
            lobby.comm.Ack_failed()
            if survivors_gone(lobby):
                # Nobody is left to seat it or tell it to leave (they lost quorum, or died): waiting out
                # salvage_wait_s would only hold mpiexec, and a supervisor's relaunch, open that long.
                return OrphanSeat(LEAVE, (), "", "every survivor of its lobby is gone")
        time.sleep(ORPHAN_POLL_S)
    return None


def survivors_gone(lobby: Lobby) -> bool:
    """Whether every rank of ``lobby`` that is no orphan is known dead (ULFM's ``Get_failed``)."""
    MPI = mpi()
    failed = lobby.comm.Get_failed()
    try:
        dead = set(MPI.Group.Translate_ranks(failed, list(range(failed.Get_size())), lobby.comm.Get_group()))
    finally:
        failed.Free()
    return all(r in dead for r, logical in enumerate(lobby.logical) if logical not in lobby.orphans)


def connect_orphans(seat: OrphanSeat) -> tuple[Any, Any] | None:
    """The orphans of one re-formation, seated: the re-formed replica's own communicator (the orphans in the
    order of ``members``, then the ranks they spawned), and the survivors' merged with it (survivors
    first). None when a mate, a spawned rank or the survivors failed meanwhile."""
    MPI = mpi()
    group = MPI.COMM_WORLD.Get_group().Incl(list(seat.members))
    tag = f"lightning-recover-orphans-{zlib.crc32(seat.port.encode()):08x}"
    try:
        team = mates = MPI.Intracomm.Create_from_group(group, tag)
        mates.Set_errhandler(MPI.ERRORS_RETURN)
        if seat.spawn_count:
            info = MPI.Info.Create()
            for key, value in seat.spawn_info:
                info.Set(key, value)
            children = mates.Spawn(sys.executable, args=list(seat.spawn_args), maxprocs=seat.spawn_count, info=info, root=0)
            info.Free()
            team = children.Merge(high=False)
            team.Set_errhandler(MPI.ERRORS_RETURN)
        merged = team.Connect(seat.port, root=0).Merge(high=True)
    except MPI.Exception:
        return None
    finally:
        group.Free()
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    return team, merged
