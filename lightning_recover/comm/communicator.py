"""The fault-aware communicator over ULFM MPI: membership and its collectives (ReCoVer's fault-aware collectives).

It keeps the :class:`~lightning_recover.comm.interface.ReplicaComm` contract with real
processes. Collectives and membership only; how a rank starts and leaves (MPI settings,
crash hook, the gate's signal, killing a peer, status markers, end of job) is
:mod:`lightning_recover.runtime.lifecycle`. Importing this module neither imports ``mpi4py.MPI``
(which initializes MPI) nor changes any other process-wide state: MPI is first touched
when a :class:`FaultTolerantComm` is built.

* ``FaultTolerantComm(layout)`` duplicates ``MPI.COMM_WORLD`` with ``ERRORS_RETURN`` and
  derives one *shard communicator* per shard index (the ranks holding the same shard of
  every replica). Cross-replica gradient reduction runs on the shard communicator; the
  ``world`` communicator carries agreement and repair.
* ``allreduce(tensors)`` SUM-reduces a list of tensors in buckets, each tagged with the
  **world epoch** (the membership generation, bumped by every repair) it completed in, so
  that stale buckets are redone after a repair; it and the broadcasts and gathers are
  :mod:`lightning_recover.comm.collectives` (the base class :class:`Collectives`).
* The buckets of the cross-replica reduction travel over the **data plane**
  (:mod:`lightning_recover.comm.data_plane`): MPI on the shard communicator (the default), or a
  gloo/NCCL group among the same ranks. One is built per world epoch -- here, after each
  repair and after each ``grow`` -- and the previous one is closed. This communicator stays
  the control plane: the data plane asks it whether a failure was noticed
  (:meth:`FaultTolerantComm.failure_noticed`) and has it revoke and gate
  (:meth:`FaultTolerantComm.peer_failure`). ``across="world"`` reductions stay on MPI.
* A peer death anywhere surfaces as one exception type, :class:`PeerFailure`, carrying the
  original world ranks this rank knows to be dead. Before raising, the rank revokes its
  communicators so that every peer blocked in a collective is released too.
* ``agree(flag)`` is ULFM's fault-tolerant agreement: every survivor gets the same answer,
  and a failure noticed during the agreement makes it ``False`` for all of them.
* ``repair()`` revokes, shrinks, keeps only *complete* replicas, advances ``world_epoch``
  and re-derives the shard communicators. It loops until one attempt is agreed by every
  survivor, so a further death while repairing just costs another round. Before the new
  world is taken, the **quorum rule** (:mod:`lightning_recover.comm.quorum`) decides whether this
  side of the failure may continue at all: across hosts a "dead" rank may be alive behind
  a partition, and only one side may train; a side that may not leaves with
  :func:`lightning_recover.runtime.lifecycle.quorum_exit`. A repair that does not return within
  ``$LIGHTNING_RECOVER_REPAIR_TIMEOUT`` seconds (300) ends the rank the same way: an
  agreement that never returns must not hang the job, and a rank that already knows of
  deaths that leave its side without quorum leaves wherever it waits
  (:mod:`lightning_recover.comm.quorum_watch`). Ranks MPI declared dead are then
  fenced (:func:`lightning_recover.runtime.lifecycle.kill_process`): one that was only hung must
  never come back as a member.
* **Write fences** (:mod:`lightning_recover.audit.fence`): the leader advances them at start,
  after every repair and every join (:meth:`FaultTolerantComm.guard_writes`); a writer
  calls :meth:`FaultTolerantComm.check_fences` first, and a rank of an older world or
  launch leaves instead of writing.
* ``grow(merged)`` installs a world that replacement ranks were merged into (hot re-join,
  :mod:`lightning_recover.membership.recruiter`): a joiner takes the *logical* rank of a lost replica's
  rank, so ranks are named by logical rank everywhere (the original world rank until a
  replacement takes it over) and the layout never changes. The survivors keep their order
  (the leader stays) and the joiners come after them; every later repair keeps that order.
* **Replica-consistency gate**: a rank that learns a rank of its own replica died leaves
  at once through :func:`lightning_recover.runtime.lifecycle.gate_exit`, so other replicas only
  ever see whole replicas go.

Whether this MPI has ULFM and which errors mean a death is :mod:`lightning_recover.comm.ulfm`;
the bound on a repair is :mod:`lightning_recover.comm.repair_bound`.

Nothing here imports Lightning, and importing this module imports no torch (the collectives alone
runs without it: ``benchmarks/scaling_rank.py``): the collectives import it where tensors
are handled, and a gloo/NCCL plane's module (:mod:`lightning_recover.comm.torch_plane`) is
imported when such a plane is built.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from lightning_recover.audit.fence import WorldFence
from lightning_recover.comm import mpi_wait, netaddr, quorum
from lightning_recover.comm.collectives import Collectives
from lightning_recover.comm.data_plane import DATA_PLANES, DataPlane, FailedPlane, MPIDataPlane
from lightning_recover.comm.interface import PeerFailure, RepairResult
from lightning_recover.comm.lobby import Lobby, Orphaned
from lightning_recover.comm.orphans import dismiss
from lightning_recover.comm.quorum_watch import QuorumWatch
from lightning_recover.comm.repair_bound import RepairBound, repair_timeout
from lightning_recover.comm.topology import RankLayout
from lightning_recover.comm.ulfm import (
    FAILURE_CONFIRM_S,
    ULFMUnavailableError,
    failure_classes,
    mpi,
    ulfm_available,
    ulfm_unavailable_message,
    unblock_cid_allocation,
)
from lightning_recover.runtime import lifecycle

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_PLANE_TIMEOUT_S", "FaultTolerantComm"]

log = logging.getLogger(__name__)

# 4 MiB: on shared memory, smaller buckets pipeline better (see benchmarks/allreduce.py sweep).
DEFAULT_BUCKET_BYTES = 4 * 1024 * 1024
#: Timeout (seconds) of a gloo/NCCL data plane when none is given: recover.timeout_s's default.
DEFAULT_PLANE_TIMEOUT_S = 60.0


def _this_process() -> tuple[str, int, str | None]:
    """Host, pid and start time of this process: what fencing needs to never hit a recycled pid."""
    return (socket.gethostname(), os.getpid(), lifecycle.process_start_time(os.getpid()))


class FaultTolerantComm(Collectives):
    """ULFM communicator for W replicas x S shards; see the module docstring for the contract."""

    def __init__(
        self,
        layout: RankLayout | None = None,
        *,
        shards: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        data_plane: str = "mpi",
        plane_timeout_s: float = DEFAULT_PLANE_TIMEOUT_S,
    ) -> None:
        MPI = mpi()
        base = MPI.COMM_WORLD
        if layout is None:
            layout = RankLayout(base.Get_size(), shards)
        if layout.world_size != base.Get_size():
            raise ValueError(f"layout is for {layout.world_size} ranks but MPI has {base.Get_size()}")
        if bucket_bytes < 4:
            raise ValueError(f"bucket_bytes must be >= 4, got {bucket_bytes}")
        if not ulfm_available():
            raise ULFMUnavailableError(ulfm_unavailable_message())
        self._setup(layout, base.Get_rank(), bucket_bytes, data_plane, plane_timeout_s)
        self.world = base.Dup()
        self.world.Set_errhandler(MPI.ERRORS_RETURN)
        self._base_group = base.Get_group()
        self._ids = tuple(range(base.Get_size()))
        self.shard_comm = self._split_shard(self.world)
        self.alive_replicas = tuple(range(layout.replicas))
        rows = self.world.allgather((_this_process(), mpi_wait.local_choice(), mpi_wait.reach()))
        self._procs = {r: proc for r, (proc, _, _) in enumerate(rows)}
        self.launch_rank = base.Get_rank()
        self._launch_ranks = {r: r for r in range(base.Get_size())}
        # The first rank's process names this launch: unique, and known to every rank.
        self.job_id = ":".join(str(part) for part in rows[0][0])
        mpi_wait.agree((polite for _, polite, _ in rows), (reach for *_, reach in rows))
        self._open_plane()
        self._watch.start()

    def _setup(self, layout: RankLayout, rank: int, bucket_bytes: int, data_plane: str, plane_timeout_s: float) -> None:
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {', '.join(DATA_PLANES)}, got {data_plane!r}")
        if not plane_timeout_s > 0:
            raise ValueError(f"plane_timeout_s must be a positive number of seconds, got {plane_timeout_s!r}")
        self.layout = layout
        self.bucket_bytes = bucket_bytes
        #: ``recover.data_plane``: what carries the cross-replica buckets (one plane per world epoch).
        self.data_plane_kind = data_plane
        self.plane_timeout_s = plane_timeout_s
        #: This world epoch's data plane (None until this rank has a world).
        self.data_plane: DataPlane | None = None
        self._world_plane: MPIDataPlane | None = None
        #: Membership generation: 0 at start, +1 per repair or join. Buckets are tagged with it.
        self.world_epoch = 0
        #: Logical rank: the original world rank, or the lost rank a replacement took over. Never changes.
        self.rank = rank
        self.replica = layout.replica_of(rank)
        self.shard = layout.shard_of(rank)
        self.alive_replicas: tuple[int, ...] = ()
        # The group logical ranks are translated through, and each of its ranks' logical rank.
        self._base_group: MPI.Group | None = None
        self._ids: tuple[int, ...] = ()
        # members of the world they were computed for, with the ids they were translated through.
        self._members_of: tuple[object, tuple[int, ...], tuple[int, ...]] | None = None
        # Where every rank runs and which process it is, so a rank declared dead while
        # merely hung can be fenced off without ever hitting a recycled pid.
        self._procs: dict[int, tuple[str, int, str | None]] = {}
        #: A repair or agreement that takes longer ends this rank as one without quorum (see :meth:`repair`).
        self.repair_timeout_s = repair_timeout()
        self._bound = RepairBound(self.repair_timeout_s, lambda why: self.quorum_exit(why))
        # Started once this rank has a world; a repair or a join holds it off while the world changes.
        self._watch = QuorumWatch(self._watch_verdict, lambda why: self.quorum_exit(why))
        #: This launch's name (host:pid:start of its first rank): what the write fences hold.
        self.job_id = ""
        # The write fences of the run's outputs (lightning_recover.audit.fence), set by guard_writes.
        self._fences: list[WorldFence] = []
        #: Called with a point name ("repair:shrunk", ...) -- the hook fault injection uses.
        self.fault_hook: Callable[[str], None] | None = None
        #: ``recover.salvage``: a live rank of a broken replica waits as an orphan instead of leaving (comm/orphans.py).
        self.salvage = False
        #: This process's rank in the launch's MPI_COMM_WORLD (a seated orphan's too); -1 for a spawned replacement
        #: (never an orphan: its mates could not name it in the launch's group).
        self.launch_rank = -1
        # logical rank -> launch rank, for the members that are the launch's own processes.
        self._launch_ranks: dict[int, int] = {}
        #: The survivors' lobbies whose orphans still wait (comm/orphans.py).
        self.lobbies: list[Lobby] = []

    @classmethod
    def joiner(
        cls,
        layout: RankLayout,
        rank: int,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        data_plane: str = "mpi",
        plane_timeout_s: float = DEFAULT_PLANE_TIMEOUT_S,
    ) -> FaultTolerantComm:
        """A replacement rank's communicator: it has no world until :meth:`grow` installs the merged one.

        A seated orphan (salvage) is still a process of the launch -- it has no parent, unlike
        every spawned replacement -- and keeps its launch rank: it may be orphaned again."""
        if not ulfm_available():
            raise ULFMUnavailableError(ulfm_unavailable_message())
        self = cls.__new__(cls)
        self._setup(layout, rank, bucket_bytes, data_plane, plane_timeout_s)
        self.world = self.shard_comm = None  # type: ignore[assignment]
        MPI = mpi()
        if MPI.Comm.Get_parent() == MPI.COMM_NULL:
            self.launch_rank = MPI.COMM_WORLD.Get_rank()
        return self

    def grow(self, merged: MPI.Intracomm | None, *, deadline: float | None = None) -> bool:
        """Make ``merged`` (this world's survivors, then the joiners) the world; collective over ``merged``.

        Every member calls it, joiners included (those built by :meth:`joiner`). Returns
        False on every survivor -- and changes nothing -- when a member died meanwhile (the
        survivors' world stays as it was; the joiners leave).

        A survivor passes ``deadline`` (``time.monotonic()``): the members first meet in a
        non-blocking barrier on ``merged``, and the survivors then agree on their own world
        whether everyone arrived before it. A joiner that died without Open MPI telling
        anyone (one that exited with a non-zero status is never reported, see
        :mod:`lightning_recover.runtime.lifecycle`) or that is stopped would otherwise hold every
        survivor in the first blocking collective below forever. A survivor whose merge
        never completed passes ``merged=None``: it says "not arrived", so every survivor
        gives up. A joiner passes no deadline (its own timer bounds it, see
        :mod:`lightning_recover.cli.joiner`). On success the world epoch advances past every
        member's and ``alive_replicas`` counts the joiners' replicas.
        """
        with self._watch.changing():
            grown = self._grow(merged, deadline)
        if grown:
            self._watch.start()  # a joiner's first world
        return grown

    def _grow(self, merged: MPI.Intracomm | None, deadline: float | None) -> bool:
        MPI = mpi()
        survivor = self.world is not None
        arrived = merged is not None and self._meet(merged, deadline)
        if survivor:
            # Uniform over the survivors: a barrier that completed here may have timed out on
            # another survivor, and only a decision they all share keeps their worlds alike.
            arrived = self.agree(arrived)
        if not arrived or merged is None:
            return False
        rows: list[tuple[int, int, tuple[str, int, str | None], bool, str, str]] = []
        shard = None
        ok = 1
        try:
            # A survivor offers the world's wait, a joiner its own: all adopt the same (mpi_wait).
            rows = merged.allgather(
                (self.rank, self.world_epoch, _this_process(), mpi_wait.polite(), self.job_id, mpi_wait.reach(), self.launch_rank)
            )
            shard = merged.Split(self.shard, self.replica)
        except MPI.Exception:
            ok = 0
        try:
            # Uniform: a failure one member saw makes every member give up.
            ok = int(merged.Agree(ok))
        except MPI.Exception:
            ok = 0
        if not ok:
            unblock_cid_allocation()  # the split may have failed on a dead member
            return False
        assert shard is not None
        shard.Set_errhandler(MPI.ERRORS_RETURN)
        self.world, self.shard_comm = merged, shard
        self._base_group = merged.Get_group()
        self._ids = tuple(r for r, *_ in rows)
        self._procs.update({r: proc for r, _, proc, *_ in rows})
        for r, *_, launch in rows:
            if launch >= 0:
                self._launch_ranks[r] = launch
            else:
                self._launch_ranks.pop(r, None)
        mpi_wait.agree((polite for _, _, _, polite, *_ in rows), (reach for *_, reach, _ in rows))
        self.world_epoch = max(e for _, e, *_ in rows) + 1
        self.job_id = rows[0][4]  # a survivor's: the joiners come after them
        self.alive_replicas = tuple(self.layout.complete_replicas(self._ids))
        # Salvage: the joiners hold none of the earlier lobbies, and the recruiter's decision needs every
        # member to see the same orphans; those still waiting are given up.
        self.dismiss_orphans("a replica joined the world (waiting orphans are given up, docs/salvage.md)")
        self._open_plane()
        self._advance_fences()
        return True

    @staticmethod
    def _meet(merged: MPI.Intracomm, deadline: float | None) -> bool:
        """Whether every member of ``merged`` entered a barrier (before ``deadline``, if given).

        Non-blocking, so that a member that never comes costs the wait and nothing more;
        the pending request of a barrier given up on is left to the dropped communicator."""
        MPI = mpi()
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            request = merged.Ibarrier()
            pause = 0.0
            while not request.Test():
                if deadline is not None and time.monotonic() > deadline:
                    return False
                # Short sleeps: the members are waiting for this very barrier, it completes in milliseconds.
                pause = min(0.01, max(1e-4, 2 * pause))
                time.sleep(pause)
        except MPI.Exception:
            return False  # a member died (reported by ULFM): the same answer as a timeout
        return True

    # ------------------------------------------------------------------ membership
    @property
    def members(self) -> tuple[int, ...]:
        """Original world ranks in the current world communicator.

        Kept per world: every step reads it (the header's count), and translating n ranks
        each time would cost O(n) per step on every rank (benchmarks/control_plane.py)."""
        key = (self.world, self._ids)
        if self._members_of is None or self._members_of[0] is not key[0] or self._members_of[1] is not key[1]:
            self._members_of = (key[0], key[1], self._orig_ranks(self.world))
        return self._members_of[2]

    @property
    def world_rank(self) -> int:
        """Rank in the current (possibly shrunk) world; 0 is the current leader."""
        return self.world.Get_rank()

    @property
    def is_leader(self) -> bool:
        return self.world_rank == 0

    def _orig_ranks(self, comm: MPI.Comm) -> tuple[int, ...]:
        group = comm.Get_group()
        try:
            return self._logical(group)
        finally:
            group.Free()

    def _logical(self, group: MPI.Group) -> tuple[int, ...]:
        """The logical ranks of ``group``'s members (a member outside the base group is left out)."""
        undefined = mpi().UNDEFINED
        base = mpi().Group.Translate_ranks(group, list(range(group.Get_size())), self._base_group)
        return tuple(self._ids[r] for r in base if r != undefined)

    def known_failed(self) -> tuple[int, ...]:
        """Original ranks this rank has been told are dead in the current world (local view)."""
        MPI = mpi()
        out: set[int] = set()
        for comm in (self.world, self.shard_comm):
            try:
                comm.Ack_failed()
                group = comm.Get_failed()
            except MPI.Exception:
                continue
            try:
                if group.Get_size():
                    out.update(self._logical(group))
            finally:
                group.Free()
        return tuple(sorted(out))

    def _split_shard(self, world: MPI.Comm) -> MPI.Comm:
        comm = world.Split(self.shard, self.replica)
        comm.Set_errhandler(mpi().ERRORS_RETURN)
        return comm

    # ------------------------------------------------------------------ data plane
    def _close_planes(self) -> None:
        for old in (self.data_plane, self._world_plane):
            if old is not None:
                old.close()
        self.data_plane = self._world_plane = None

    def _open_plane(self) -> None:
        """Close the previous world epoch's data plane and build this one's (collective over the world).

        For gloo/NCCL the leader hosts a fresh ``TCPStore`` and broadcasts its address; a
        peer failure in that broadcast leaves a :class:`FailedPlane`, which raises it at the
        epoch's first bucket, where the step's recovery handles it like any other."""
        self._close_planes()
        self._world_plane = MPIDataPlane(self.world, self._fail, self.world_epoch)
        kind, size = self.data_plane_kind, self.shard_comm.Get_size()
        if kind == "mpi":
            self.data_plane = MPIDataPlane(self.shard_comm, self._fail, self.world_epoch)
            return
        # Only here: a rank on the MPI plane never imports torch.distributed (nor torch) for it.
        from lightning_recover.comm.torch_plane import TorchDistDataPlane, host_store

        store, address = None, None
        try:
            if self.is_leader:
                store, address = host_store([self._procs[r][0] for r in self.members], self.plane_timeout_s)
            address = self.bcast_object(address)
        except PeerFailure as exc:
            self.data_plane = FailedPlane(kind, self, self.world_epoch, size, f"peer failure during {exc.where}")
            return
        assert isinstance(address, tuple)
        if kind == "gloo":  # members on several hosts: gloo must bind where the other hosts reach (see netaddr)
            netaddr.prepare_gloo([self._procs[r][0] for r in self.members])
        self.data_plane = TorchDistDataPlane(
            kind, self, world_epoch=self.world_epoch, shard=self.shard, rank=self.shard_comm.Get_rank(), size=size,
            address=address, store=store, timeout_s=self.plane_timeout_s,
        )

    def failure_noticed(self) -> bool:
        """Whether this rank knows of a dead member of the current world, or that it was revoked.

        Cheap and local (a data plane polls it while its collective is pending). ULFM
        learns of failures and revokes only while MPI makes progress, which a rank blocked
        outside MPI never does; the probe drives that progress."""
        MPI = mpi()
        try:
            self.world.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        except MPI.Exception as exc:
            if exc.Get_error_class() in failure_classes():
                return True
            raise
        if self.world.Is_revoked() or self.shard_comm.Is_revoked():
            return True
        return bool(self.known_failed())

    # ------------------------------------------------------------------ failures
    def _fail(self, where: str, exc: MPI.Exception) -> PeerFailure:
        """Turn an MPI error into PeerFailure: revoke so blocked peers are released, apply the gate."""
        cls = exc.Get_error_class()
        if cls not in failure_classes() and not self._failure_confirmed():
            raise exc
        return self._peer_failure(where, cls, f"MPI error during {where}")

    def _failure_confirmed(self, within_s: float = FAILURE_CONFIRM_S) -> bool:
        """Whether a failure of a world member is known, or becomes known within ``within_s``.

        Open MPI sometimes reports a peer death as ERR_OTHER, and a non-blocking collective
        may do so before the death reaches the communicator's failed group (seen with
        ``MPI_Iallreduce`` while a peer was SIGKILLed): only a failure known by then makes
        the error a membership change; anything else is a real error."""
        deadline = time.monotonic() + within_s
        while True:
            if self.failure_noticed():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def peer_failure(self, where: str, error_class: int | None = None) -> PeerFailure:
        """The :class:`PeerFailure` for a failure a data plane saw: revoke so blocked peers are released, apply the gate."""
        return self._peer_failure(where, error_class, f"peer failure during {where}")

    def _peer_failure(self, where: str, error_class: int | None, reason: str) -> PeerFailure:
        self._revoke(self.shard_comm, self.world)
        dead = self.known_failed()
        self.check_gate(dead, reason=reason)
        return PeerFailure(dead, where, error_class)

    def fail_for(self, where: str, exc: MPI.Exception) -> PeerFailure:
        """The :class:`PeerFailure` for an MPI error of a caller's own point-to-point traffic on :attr:`world`."""
        return self._fail(where, exc)

    @staticmethod
    def _revoke(*comms: MPI.Comm) -> None:
        MPI = mpi()
        for comm in comms:
            try:
                comm.Revoke()
            except MPI.Exception:
                pass  # already revoked, or freed: either way nobody waits on it

    def check_gate(self, dead_ranks: Sequence[int], reason: str) -> None:
        """Leave through the replica-consistency gate if any of ``dead_ranks`` is in this rank's replica."""
        mates = set(self.layout.ranks_of_replica(self.replica)) - {self.rank}
        lost = sorted(mates.intersection(dead_ranks))
        if lost and not self.may_be_orphaned:
            self.gate_exit(f"{reason}: replica {self.replica} lost rank(s) {lost}")
        # With salvage the rank goes on into the repair, where it becomes an orphan.

    @property
    def may_be_orphaned(self) -> bool:
        """Salvage is on and this is a process of the launch (its mates can name it in the launch's group)."""
        return self.salvage and self.launch_rank >= 0

    def lobby_of(self, orphan: int) -> Lobby:
        return next(lobby for lobby in self.lobbies if orphan in lobby.orphans)

    def launch_rank_of(self, rank: int) -> int:
        return self._launch_ranks[rank]

    def orphan_host(self, orphan: int) -> str:
        return self._procs[orphan][0]

    def dismiss_orphans(self, reason: str) -> None:
        """Give up every waiting orphan: the leader tells each to leave (else each would wait out
        ``salvage_wait_s``, holding ``mpiexec`` open after training), and the lobbies go. An orphan
        itself (no world) holds no lobby."""
        if self.world is not None and self.is_leader:
            for lobby in self.lobbies:
                for orphan in lobby.orphans:
                    dismiss(lobby, orphan, reason)
        self.lobbies.clear()

    def forget_orphans(self, orphans: Sequence[int]) -> None:
        """Seated or gone: drop them from the lobbies, and free a lobby none waits on."""
        for lobby in list(self.lobbies):
            lobby.orphans = [r for r in lobby.orphans if r not in orphans]
            if not lobby.orphans:
                self.lobbies.remove(lobby)

    def take_seat(self, rank: int) -> None:
        """An orphan seated as logical rank ``rank`` (of the re-formed replica): it grows in as that rank."""
        self.rank = rank
        self.replica = self.layout.replica_of(rank)
        self.shard = self.layout.shard_of(rank)

    def gate_exit(self, reason: str) -> NoReturn:
        """:func:`lightning_recover.runtime.lifecycle.gate_exit` for this rank."""
        lifecycle.gate_exit(self.rank, reason)

    def agree(self, flag: bool = True) -> bool:
        """Fault-tolerant AND of ``flag`` over the survivors; ``False`` everywhere if anyone died meanwhile.

        Bounded like a repair (:class:`~lightning_recover.comm.repair_bound.RepairBound`): Open MPI's agreement waited for good when the
        middle one of 3 fake hosts was cut off (the issue's majority hang, found again by the
        chaos campaign), before any repair began."""
        MPI = mpi()
        try:
            with self._bound.within(f"the agreement at world epoch {self.world_epoch}"):
                if not mpi_wait.polite():
                    return bool(self.world.Agree(int(bool(flag))))
                # Waited politely like the step's reductions (every member makes the same choice:
                # mpi_wait). The blocking one polls TCP peers rarely: once a spawned replacement
                # joined (TCP, not shared memory) it took 4-8 ms here, Iagree 0.4 ms.
                buf = np.array([int(bool(flag))], dtype=np.intc)
                mpi_wait.wait(self.world.Iagree(buf))
                return bool(buf[0])
        except MPI.Exception as exc:
            if exc.Get_error_class() not in failure_classes():
                raise
            # ULFM raises PROC_FAILED from Agree uniformly, so returning False is uniform too.
            try:
                self.world.Ack_failed()
            except MPI.Exception:
                pass
            self.check_gate(self.known_failed(), reason="failure seen during agreement")
            return False


    # ------------------------------------------------------------------ repair
    def repair(self, max_rounds: int = 64) -> RepairResult:
        """Shrink to the survivors' complete replicas and advance the world epoch.

        Every survivor must call this after an ``agree`` returned ``False``. A rank whose
        replica is incomplete takes part in the agreement and then leaves via the gate.
        """
        t0 = time.perf_counter()
        # Open MPI's agreement can wait for good when a cut-off host's ranks are declared dead
        # one at a time (seen with 3 fake hosts, one partitioned): leave in bounded time instead,
        # as a side without quorum does, so that a supervising launcher relaunches the job.
        with self._bound.within(f"the repair after world epoch {self.world_epoch}"), self._watch.changing():
            return self._repair(max_rounds, t0)

    def _repair(self, max_rounds: int, t0: float) -> RepairResult:
        MPI = mpi()
        before = set(self.members)
        leader = self.members[0]
        current = self.world
        for rounds in range(1, max_rounds + 1):
            self._revoke(current, self.shard_comm)
            try:
                shrunk = current.Shrink()
            except MPI.Exception as exc:  # pragma: no cover - Shrink is itself fault tolerant
                log.warning("shrink failed (%s); retrying", exc)
                continue
            shrunk.Set_errhandler(MPI.ERRORS_RETURN)
            if self.fault_hook is not None:
                self.fault_hook("repair:shrunk")
            present = self._orig_ranks(shrunk)
            keep = set(self.layout.complete_replicas(present))
            mine_ok = self.replica in keep
            ok = 1
            world = shard = None
            try:
                # Both splits are taken on `shrunk`, so one rank's Revoke releases everyone. The
                # world keeps its order (Shrink does too): the leader moves only when it is lost.
                # When every present rank's replica is whole (every survivor computes the same
                # `present`) the world is `shrunk` itself: a split would all-gather every
                # member's (color, key), O(n) bytes per rank, to select all of them.
                whole = len(keep) == len(self.layout.replicas_touched(present))
                world = shrunk if whole else shrunk.Split(0 if mine_ok else MPI.UNDEFINED, shrunk.Get_rank())
                shard = shrunk.Split(self.shard if mine_ok else MPI.UNDEFINED, self.replica)
            except MPI.Exception:
                ok = 0
                self._revoke(shrunk)
            try:
                agreed = bool(shrunk.Agree(ok))
            except MPI.Exception:
                agreed = False
            if not agreed:
                current = shrunk
                continue
            verdict = self._quorum(before, present, keep, leader)
            if not verdict.proceed:
                self.quorum_exit(f"world epoch {self.world_epoch} -> {self.world_epoch + 1}: {verdict.reason}")
            lobby = self._lobby(shrunk, present, keep) if self.salvage else None
            if not mine_ok:
                dead = sorted(set(self.layout.ranks_of_replica(self.replica)) - set(present))
                if lobby is not None and self.may_be_orphaned:
                    self.world = self.shard_comm = None  # type: ignore[assignment]
                    self._close_planes()
                    raise Orphaned(lobby, dead, f"replica {self.replica} lost rank(s) {dead}: rank {self.rank} waits as an orphan")
                self.gate_exit(f"replica {self.replica} lost rank(s) {dead} (seen while repairing)")
            if lobby is not None:
                self.lobbies.append(lobby)
            assert world is not None and shard is not None
            world.Set_errhandler(MPI.ERRORS_RETURN)
            shard.Set_errhandler(MPI.ERRORS_RETURN)
            self.world, self.shard_comm = world, shard
            self.world_epoch += 1
            now = set(self.members)
            lost = tuple(sorted(before - now))
            lost_replicas = tuple(sorted(self.layout.replicas_touched(lost)))
            self.alive_replicas = tuple(self.layout.complete_replicas(now))
            # Fence only ranks MPI declared dead; a live partner of an incomplete replica
            # leaves through the gate on its own.
            self._fence(sorted(before - set(present)))
            self._advance_fences()
            self._open_plane()
            return RepairResult(self.world_epoch, lost, lost_replicas, self.alive_replicas, time.perf_counter() - t0, rounds)
        raise RuntimeError(f"repair did not converge in {max_rounds} rounds; the job cannot continue")

    def _lobby(self, shrunk: MPI.Intracomm, present: Sequence[int], keep: set[int]) -> Lobby | None:
        """Salvage: the lobby of this repair's orphans -- the live launch ranks of broken replicas -- if any."""
        orphans = [r for r in present if self.layout.replica_of(r) not in keep and r in self._launch_ranks]
        return Lobby(shrunk, orphans, tuple(present), self.world_epoch + 1) if orphans else None

    def _quorum(self, before: set[int], present: Sequence[int], keep: set[int], leader: int) -> quorum.QuorumVerdict:
        """May this side of the failure continue? Every survivor computes the same verdict
        from agreed inputs: the previous members, the shrunk group and the hosts of all."""
        lost = sorted(before - set(present))
        certain = quorum.certain_losses(
            lost, present, {r: self._procs[r][0] for r in before}, {r: self.layout.replica_of(r) for r in before}
        )
        return quorum.decide(self.alive_replicas, keep, certain, self.layout.replica_of(leader))

    def _watch_verdict(self) -> tuple[object, str] | None:
        """The quorum watch's read (:mod:`lightning_recover.comm.quorum_watch`): ``(world epoch, reason)`` when the
        deaths this rank knows of already leave its side without quorum, else None."""
        MPI = mpi()
        world = self.world
        if world is None:  # an orphan or a joiner: no side to judge
            return None
        try:
            # Reads what this rank's own waits (they drive MPI's progress) already learnt; a rank busy in
            # compute learns of deaths at its next MPI call, as always. Not acknowledged: the next
            # agreement must still report them.
            group = world.Get_failed()
        except MPI.Exception:
            return None
        try:
            if not group.Get_size():
                return None
            lost = set(self._logical(group))
        finally:
            group.Free()
        members = self.members
        present = [r for r in members if r not in lost]
        verdict = self._quorum(set(members), present, set(self.layout.complete_replicas(present)), members[0])
        if verdict.proceed:
            return None
        return self.world_epoch, f"world epoch {self.world_epoch}: rank(s) {sorted(lost)} known dead: {verdict.reason}"

    def guard_writes(self, directories: Sequence[str | os.PathLike[str]]) -> None:
        """Fence the run's outputs in ``directories`` with this launch and world epoch
        (:mod:`lightning_recover.audit.fence`); the leader takes the fences now and after every repair and join."""
        self._fences = [WorldFence(d) for d in directories]
        self._advance_fences()

    def _advance_fences(self) -> None:
        if self.world is not None and self.is_leader:
            for fence in self._fences:
                fence.advance(self.job_id, self.world_epoch)

    def check_fences(self, what: str) -> None:
        """Call just before writing ``what``: a rank of an older world or launch leaves instead of writing."""
        for fence in self._fences:
            if not fence.allows(self.job_id, self.world_epoch):
                self.quorum_exit(
                    f"refused to write the {what}: {fence.path} is held by {fence.holder()}, "
                    f"this rank is of job {self.job_id} at world epoch {self.world_epoch} (a newer world went on without it)"
                )

    def quorum_exit(self, reason: str) -> NoReturn:
        """:func:`lightning_recover.runtime.lifecycle.quorum_exit` for this rank."""
        lifecycle.quorum_exit(self.rank, reason)

    def _fence(self, lost: Sequence[int]) -> None:
        """SIGKILL ``lost`` ranks that run on this host: one the failure detector declared
        dead may only be hung (SIGSTOP, stuck in compute) and must never come back as a
        zombie member. A rank on another host can only be fenced by a survivor there."""
        host = socket.gethostname()
        for r in lost:
            h, pid, start = self._procs[r]
            if h == host:
                lifecycle.kill_process(
                    pid,
                    start,
                    f"declared dead by MPI before world epoch {self.world_epoch}; fenced so it never returns as a member",
                    by=f"rank {self.rank}",
                    target=f"rank {r}",
                )

    def free(self) -> None:
        """Close the data plane, free the world and shard communicators (end of job; see lifecycle.end_job)."""
        MPI = mpi()
        self._watch.stop()
        for plane in (self.data_plane, self._world_plane):
            if plane is not None:
                plane.close()
        for comm in (self.shard_comm, self.world):
            try:
                comm.Free()
            except MPI.Exception:
                pass
