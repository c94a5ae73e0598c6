"""Hot re-join over ULFM: replacement replicas start while the survivors train, and join at a step boundary.

A job that lost replicas spawns replacements (``recover.rejoin.enabled=true``), up to the replica
count it started with. A replacement takes the *logical ranks* of a lost replica (the
layout never changes) and runs the same program: the interpreter and the original argv,
behind ``python -m lightning_recover.cli.joiner`` (:mod:`lightning_recover.cli.joiner`), which
initializes MPI and merges with the survivors *before* the script imports torch.

One join attempt, as every survivor runs it (the leader decides at each step boundary and
broadcasts its decision, one small broadcast per step while replicas are missing)::

    START    every survivor duplicates its world and, in a background thread, Spawns
             k = missing replicas x S processes on the duplicate and Merges them (survivors
             first). Spawn returns once the children initialized MPI (about the start of a
             bare interpreter); the survivors' step loop never waits for it.
    (wait)   each replacement runs the user's script; its strategy builds the model and the
             optimizer, sends READY to the merged communicator's rank 0 and waits for GO.
    ADMIT    at the first step boundary after every replacement is READY (never an epoch's
             first step): the leader sends GO; every member calls
             :meth:`FaultTolerantComm.grow` on the merged communicator, which first meets
             every member in a non-blocking barrier bounded by the attempt's time (at least
             :data:`ADMIT_GRACE_S` more), the survivors agreeing on their own world whether
             all came; the donor replica (the lowest veteran) sends Lightning's own
             checkpoint, dumped in memory, shard by shard
             (:mod:`lightning_recover.membership.transfer`); every rank admits the new replicas into the policy
             (:meth:`StepEngine.admit`).
    DROP     a replacement died (the leader's probe of the merged communicator fails), the
             spawn failed, the attempt passed ``rejoin.timeout_s``, or not every member came
             to the admission's barrier: the survivors drop the merged communicator (never
             revoke it: on Open MPI 5.0.11 revoking a communicator shared with a dead child
             wedged the survivors' next broadcast on their own world), the leader tells the
             replacements that said READY to ABORT, and the next attempt waits
             ``rejoin.backoff_s`` (doubled per failure in a row). After ``rejoin.attempts``
             failures in a row the job carries on without.

**What a failing replacement costs.** A replacement that exits (any status), crashes
(SIGKILL) or wedges (SIGSTOP) at any point before admission costs the survivors at most
its attempt: ``rejoin.timeout_s`` from the spawn (plus :data:`ADMIT_GRACE_S` if it fails
inside an admission that began near the limit), then the usual drop, backoff and give-up.
Two rules keep it so, because Open MPI 5.0.11 does not report every death: of two spawned
processes that exit with a non-zero status, only one ever reaches the survivors as a
process failure (the runtime's abort of their job stalls), and a first message to the other
waits forever inside ``MPI_Isend`` (the address lookup that opens the connection). So:

* before admission the survivors send only to replacements whose READY they received (that
  message opened the connection): ABORT goes to those, GO only when all are READY; a
  replacement that never said READY is never contacted and leaves by its own timer;
* every wait on the replacements is bounded: the leader's probe for READY never blocks,
  and admission's first collective is the bounded barrier above; the survivors only enter
  the blocking part of :meth:`~FaultTolerantComm.grow` once every member has met them.

On top of that the joiner turns a script's exit or uncaught exception before admission into
SIGKILL (:mod:`lightning_recover.cli.joiner`), which Open MPI does report, so such an attempt is
usually dropped at the next step boundary rather than after ``rejoin.timeout_s``.

A repair of the survivors' world while an attempt is open drops it the same way (a
survivor of the merged communicator is gone). A replacement that is never admitted leaves
by itself after ``rejoin.timeout_s`` (the joiner's timer), so none outlives its attempt;
and when an attempt is dropped (or training ends) the leader SIGKILLs the attempt's
replacements on its host that nobody tells to leave -- those that never said READY, and all
of them once GO was sent -- from the pid and start time each sent right after the merge
(:func:`~lightning_recover.membership.handshake.say_hello`): a stopped one, which its own
timer cannot end, would otherwise hold ``mpiexec`` open after training when the hang
watchdog is off.
A Spawn that never returns (a child killed before MPI_Init completed) leaves a parked
daemon thread behind: the attempt is dropped by its timeout, bounded by the attempt limit.

Drops caused by the survivors' own repair (any attempt) are not failures: no backoff, not
counted against ``rejoin.attempts``.

**Salvage** (``recover.salvage``): before any spawn, the leader may decide SEAT_ORPHANS: the
orphans that waiting broken replicas left (:mod:`lightning_recover.membership.salvage` plans
which) are seated as a lost replica on a port every survivor accepts on, like a standby; with
re-join on they first spawn the ranks no orphan holds themselves (1 process for one lost GPU,
not S; :mod:`lightning_recover.comm.orphans`). From the merge on, such an attempt is admitted,
dropped and fenced like any other.

Here: :class:`Recruiter`, which runs every attempt on every survivor (START, ADMIT, DROP),
and :class:`JoinAttempt`, one attempt's state. The rest of re-join is in its own modules:
the replacement's seat (:mod:`~lightning_recover.membership.seat`), the messages and the
replacement's half of them (:mod:`~lightning_recover.membership.handshake`), the leader's
warm standbys (:mod:`~lightning_recover.membership.standby`, a base of the recruiter), the
state transfer (:mod:`~lightning_recover.membership.transfer`) and the replacement's
start-up times (:mod:`~lightning_recover.membership.milestones`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_recover.comm.orphans import OrphanSeat, send_seat
from lightning_recover.comm.ulfm import unblock_cid_allocation
from lightning_recover.membership.handshake import ABORT, GO, TAG_DECISION, TAG_HELLO, TAG_READY, TAG_SEAT, host_checksum
from lightning_recover.membership.placement import SpawnPlacement, spawn_placement
from lightning_recover.membership.salvage import Orphan, Reformation, plan_reformations
from lightning_recover.membership.seat import ORPHANS_PORT, Seat
from lightning_recover.membership.standby import Standby, WarmStandbys
from lightning_recover.runtime import lifecycle
from lightning_recover.runtime.markers import ENV_SPARE_HOSTS

if TYPE_CHECKING:
    from lightning_recover.comm.communicator import FaultTolerantComm

__all__ = ["JoinAttempt", "Recruiter"]

#: Seconds an admission may wait for every member beyond the attempt's limit (one that became
#: ready just before ``rejoin.timeout_s`` still gets this long to meet the survivors).
ADMIT_GRACE_S = 10.0

# The leader's per-boundary decision, broadcast to every survivor.
NOTHING, START, ADMIT, DROP, SEAT_ORPHANS = 0, 1, 2, 3, 4
#: The second code of a START: a cold spawn (otherwise the replica whose seated standby connects).
COLD = -1


def _mpi() -> Any:
    """``mpi4py.MPI``, imported on first use: the import initializes MPI, which the joiner does itself first."""
    from mpi4py import MPI

    return MPI


@dataclass
class LeaderSide:
    """The leader's part of a spawn attempt: what it hears from the replacements, and what it seats."""

    #: Merged-communicator ranks that said READY.
    ready: set[int] = field(default_factory=set)
    #: What each replacement said right after the merge: pid, start time, host checksum.
    procs: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: The seated standby this attempt merges (None for a cold spawn).
    standby: Standby | None = None
    #: The port the survivors accept a standby or orphans on, closed when the attempt ends.
    port: str | None = None


@dataclass
class JoinAttempt:
    """One spawn attempt in flight: its per-attempt state, in one object."""

    number: int
    replicas: tuple[int, ...]
    seat: Seat
    #: Survivors in the merged communicator (the replacements are ranks ``survivors..``).
    survivors: int
    started: float = field(default_factory=time.monotonic)
    thread: threading.Thread | None = None
    merged: Any = None
    error: str | None = None
    #: GO was sent: from here on nobody tells the replacements anything more.
    admitting: bool = False
    #: Processes spawned per replica it seats (the ledger's ``spawned``): S, or fewer when orphans fill the rest.
    spawned: int | None = None
    #: What only the leader keeps of the attempt (empty on the other survivors).
    leader: LeaderSide = field(default_factory=LeaderSide)

    @property
    def size(self) -> int:
        return len(self.seat.ranks)

    def joiner_ranks(self) -> range:
        return range(self.survivors, self.survivors + self.size)


class Recruiter(WarmStandbys):
    """The survivors' side of hot re-join; :meth:`boundary` runs at every step boundary on every survivor."""

    def __init__(
        self,
        comm: FaultTolerantComm,
        *,
        hosts: str | None,
        attempts: int,
        backoff_s: float,
        timeout_s: float,
        argv: Sequence[str] | None = None,
        context: Callable[[], dict[str, Any]] = dict,
        standbys: int = 0,
        shards: int = 1,
        fault_point: Callable[[str, int], None] = lambda phase, attempt: None,
        spawn: bool = True,
    ) -> None:
        self.comm = comm
        #: ``recover.rejoin``: lost replicas may be spawned again (else only orphans re-form them: salvage).
        self.spawn = spawn
        #: Fault injection's points in the survivors' side of an attempt (phase, attempt number).
        self.fault_point = fault_point
        self.hosts = hosts
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.argv = list(sys.argv if argv is None else argv)
        self.context = context
        self.attempt: JoinAttempt | None = None
        self.started_attempts = 0
        self.failures_in_a_row = 0
        self._next_try = 0.0
        # Buffers of decisions sent without waiting (their requests are freed; MPI may still read them).
        self._sent: list[np.ndarray] = []
        #: Warm standbys to keep (the leader's, see :mod:`lightning_recover.membership.standby`).
        self.standbys = standbys
        self.shards = shards
        self.pool: list[Standby] = []
        self.seated: list[Standby] = []
        self.spawned_standbys = 0
        #: Standbys lost before they served, in a row; at ``attempts`` the leader stops spawning them.
        self.standby_failures = 0
        #: Wall-clock time of the survivors' latest loss (:meth:`note_loss`), for the replacements' breakdown.
        self.lost_at: float | None = None
        self._training = False

    def note_loss(self) -> None:
        """The survivors repaired their world: the clock of "capacity back" starts now."""
        self.lost_at = time.time()

    def joined_at(self, attempt: int) -> None:
        """A replacement admitted by ``attempt`` continues the survivors' count (every member must
        agree on :meth:`active` and number the next attempt alike)."""
        self.started_attempts, self.failures_in_a_row, self.attempt = attempt, 0, None

    @property
    def missing(self) -> tuple[int, ...]:
        """Replicas of the original layout that are not live."""
        alive = set(self.comm.alive_replicas)
        return tuple(r for r in range(self.comm.layout.replicas) if r not in alive)

    def active(self) -> bool:
        """Whether this boundary needs the leader's decision (the same answer on every survivor)."""
        if self.attempt is not None:
            return True
        # O(1) on the steady step (every replica live); the missing ones are listed only when some are.
        if len(self.comm.alive_replicas) >= self.comm.layout.replicas:
            return False
        if self._may_spawn():
            return True
        # Salvage without re-join: no orphan waiting (a whole replica lost) leaves nothing to plan, and every step
        # after such a loss stays O(1) -- the missing replicas are listed only for orphans to fill them.
        return bool(self.comm.lobbies) and self._reformation(spawn=False, seats=self.missing) is not None

    def _may_spawn(self) -> bool:
        """Whether re-join may spawn now (the same answer on every survivor: the leader's clock decides when)."""
        return self.spawn and self.failures_in_a_row < self.attempts

    def _reformations(self, *, spawn: bool, seats: Sequence[int]) -> list[Reformation]:
        """Salvage: the lost replicas of ``seats`` that waiting orphans make whole again -- alone, or (``spawn``)
        with spawned ranks for the shard indices none of them holds (every survivor's lobbies agree)."""
        if not self.comm.lobbies or not seats:
            return []
        layout = self.comm.layout
        orphans = [Orphan(lobby.world_epoch, r, layout.shard_of(r), self.comm.orphan_host(r))
                   for lobby in self.comm.lobbies for r in lobby.orphans]
        return plan_reformations(orphans, seats, layout.shards, spawn=spawn)

    def _reformation(self, *, spawn: bool, seats: Sequence[int]) -> Reformation | None:
        """The first of :meth:`_reformations`. Its orphans do not depend on ``seats`` (only the seat it takes
        does), so the replica the leader broadcasts is all the others need to seat the same orphans."""
        plans = self._reformations(spawn=spawn, seats=seats)
        return plans[0] if plans else None

    def orphans_will_seat(self) -> set[int]:
        """The leader's: the lost replicas waiting orphans re-form at the coming boundaries (a standby is not
        seated on them: the orphans keep the healthy ranks working, and the standby stays for a replica no
        orphan can help)."""
        return {p.replica for p in self._reformations(spawn=self._may_spawn(), seats=self.unserved())}

    def boundary(self, can_admit: bool) -> JoinAttempt | None:
        """The leader's decision, applied on every survivor. Returns the attempt to admit now, if any.

        Collective over the survivors' world (wrap it in ``StepEngine.run_collective``);
        a caller that gets an attempt runs the admission (:meth:`admit`) right away.
        """
        if not self.active():
            return None
        codes = self._decide(can_admit) if self.comm.is_leader else (NOTHING, COLD, 0)
        code, replica, spawn = self.comm.broadcast_codes(list(codes))
        if code == SEAT_ORPHANS:
            self._seat_orphans(replica, spawn=bool(spawn))
        elif code == START:
            self._start(replica)
        elif code == DROP:
            self.drop("the replacements did not start" if self.attempt is None or self.attempt.error is None else self.attempt.error)
        elif code == ADMIT:
            return self.attempt
        return None

    def _decide(self, can_admit: bool) -> tuple[int, int, int]:
        """The leader's (code, replica, spawn): ``replica`` is the seat of a START of a standby or of
        SEAT_ORPHANS (COLD: a cold spawn), ``spawn`` whether the re-formation may spawn ranks."""
        att = self.attempt
        spawn_now = self._may_spawn() and time.monotonic() >= self._next_try
        if att is None and (plan := self._reformation(spawn=spawn_now, seats=self.unserved())) is not None:
            return SEAT_ORPHANS, plan.replica, int(spawn_now)
        if att is None and not self.spawn:
            return NOTHING, COLD, 0
        if att is None:
            if self.serving_standbys():
                # A seated standby whose script is ready is merged now; otherwise wait for one
                # (a cold spawn now would only take cores from the standbys starting up).
                ready = next((sb for sb in self.seated if len(sb.connecting) == self.shards), None)
                return (START, ready.replica, 0) if ready is not None and ready.replica is not None else (NOTHING, COLD, 0)
            return (START, COLD, 0) if time.monotonic() >= self._next_try else (NOTHING, COLD, 0)
        status = self._status(att)
        if status == "failed":
            return DROP, COLD, 0
        if status == "ready" and can_admit:
            return ADMIT, COLD, 0
        return NOTHING, COLD, 0

    def _status(self, att: JoinAttempt) -> str:
        """The leader's view of an attempt: "ready", "failed" or "waiting"."""
        MPI = _mpi()
        timed_out = time.monotonic() - att.started > self.timeout_s
        if att.error is not None:
            return "failed"
        if att.merged is None:
            if att.leader.standby is not None and (att.leader.standby.error is not None or not att.leader.standby.alive_on_this_host()):
                att.error = f"standby {att.leader.standby.number} died before it was merged"
                return "failed"
            if timed_out:
                att.error = f"the spawn did not complete in {self.timeout_s:g} s (recover.rejoin.timeout_s)"
                return "failed"
            return "waiting"
        status = MPI.Status()
        buf = np.zeros(1, dtype=np.int64)
        try:
            self._collect_hellos(att)
            while att.merged.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_READY, status=status):
                src = status.Get_source()
                att.merged.Recv([buf, MPI.INT64_T], source=src, tag=TAG_READY)
                att.leader.ready.add(src)
        except MPI.Exception as exc:
            att.error = f"a replacement died while starting ({exc.Get_error_string()})"
            return "failed"
        if len(att.leader.ready) == att.size:
            return "ready"
        if timed_out:
            att.error = f"{att.size - len(att.leader.ready)} replacement(s) not ready after {self.timeout_s:g} s (recover.rejoin.timeout_s)"
            return "failed"
        return "waiting"

    def _start(self, replica: int = COLD) -> None:
        if replica != COLD:
            self._start_standby(replica)
            return
        layout = self.comm.layout
        replicas = self.missing
        ranks = tuple(layout.rank_of(r, s) for r in replicas for s in range(layout.shards))
        self.started_attempts += 1
        seat_ = Seat(ranks, self.started_attempts, time.time(), self._context())
        att = JoinAttempt(self.started_attempts, replicas, seat_, survivors=self.comm.world.Get_size(), spawned=layout.shards)
        dup = self.comm.duplicate_world()
        info = self._spawn_info()
        args = ["-m", "lightning_recover.cli.joiner", seat_.to_json(), *self.argv]

        self._merge_in_background(
            att, lambda: dup.Spawn(sys.executable, args=args, maxprocs=len(ranks), info=info, root=0), "spawn failed", "spawn"
        )
        if self.comm.is_leader:
            print(
                f"[lightning-recover] re-join attempt {att.number}: spawning {len(ranks)} rank(s) for replica(s) {list(replicas)} "
                f"{self._placement().describe()}",
                file=sys.stderr, flush=True,
            )

    def close(self) -> None:
        """End of training: an open attempt's replacements are told ABORT (they leave at once), the others fenced;
        the leader's standbys are told to leave (those still starting are fenced)."""
        att, self.attempt = self.attempt, None
        if att is not None:
            self._abort(att)
            self._fence(att, "training ended before it was admitted")
            self._end_attempt_port(att)
        for sb in [*self.pool, *self.seated]:
            self._dismiss(sb, "training ended")
        self.pool, self.seated = [], []
        self.comm.dismiss_orphans("training ended")

    def _context(self) -> dict[str, Any]:
        """What a seat carries (:attr:`Seat.context`): the survivors' context, and when they lost the replica."""
        return {**self.context(), "lost_at": self.lost_at}

    def _placement(self) -> SpawnPlacement:
        return spawn_placement(self.hosts, os.environ.get(ENV_SPARE_HOSTS), self.failures_in_a_row)

    def _spawn_info(self) -> Any:
        """Where spawned processes go, cold replacements and standbys alike (:mod:`~lightning_recover.membership.placement`)."""
        info = _mpi().Info.Create()
        for key, value in self._placement().info_items(os.getcwd()):
            info.Set(key, value)
        return info

    def _seat_orphans(self, replica: int, *, spawn: bool) -> None:
        """Salvage: every survivor accepts the first re-formation, seated as lost replica ``replica`` (the
        leader's choice), on a duplicate of the world (background thread); the leader sends each orphan its
        seat and the port on its lobby. The orphans spawn the ranks no orphan fills themselves (``spawn``),
        and connect with them."""
        MPI = _mpi()
        plan = self._reformation(spawn=spawn, seats=(replica,))
        assert plan is not None, "the leader decided SEAT_ORPHANS: every survivor's lobbies hold the same orphans"
        layout = self.comm.layout
        orphans = [m.rank for m in plan.orphans]
        # In the order of the replica's own communicator: its orphans, then the ranks they spawn.
        ranks = tuple(layout.rank_of(plan.replica, m.shard) for m in plan.orphans) + tuple(
            layout.rank_of(plan.replica, s) for s in plan.spawned_shards)
        self.started_attempts += 1
        seat_ = Seat(ranks, self.started_attempts, time.time(), self._context())
        att = JoinAttempt(self.started_attempts, (plan.replica,), seat_, survivors=self.comm.world.Get_size(),
                          spawned=len(plan.spawned_shards))
        dup = self.comm.duplicate_world()
        if self.comm.is_leader:
            att.leader.port = MPI.Open_port()
            members = tuple(self.comm.launch_rank_of(r) for r in orphans)
            spawn_args: tuple[str, ...] = ()
            if plan.spawned_shards:
                told = Seat(ranks, seat_.attempt, seat_.spawned_at, {**seat_.context, ORPHANS_PORT: att.leader.port})
                spawn_args = ("-m", "lightning_recover.cli.joiner", told.to_json(), *self.argv)
            info = tuple(self._placement().info_items(os.getcwd()))
            for i, orphan in enumerate(orphans):
                seat_msg = OrphanSeat(ranks[i], members, att.leader.port, seat_.to_json(), spawn_args, len(plan.spawned_shards), info)
                try:
                    send_seat(self.comm.lobby_of(orphan), orphan, seat_msg)
                except MPI.Exception as exc:  # it died while it waited: the attempt is dropped at the next boundary
                    att.error = f"orphan rank {orphan} died while it waited ({exc.Get_error_string()})"
        self.comm.forget_orphans(orphans)
        self._merge_in_background(att, lambda: dup.Accept(att.leader.port, root=0), "the orphans' merge failed", "accept")
        if self.comm.is_leader:
            made = (f"{len(plan.spawned_shards)} process(es) spawned by the orphans, not {layout.shards}, "
                    f"{self._placement().describe()}" if plan.spawned_shards else "no process spawned")
            print(f"[lightning-recover] re-join attempt {att.number}: orphan rank(s) {orphans} re-form replica {plan.replica} "
                  f"(salvage: {made})", file=sys.stderr, flush=True)

    def _start_standby(self, replica: int) -> None:
        """START for a seated standby: every survivor accepts it on a duplicate of the world (background thread)."""
        MPI = _mpi()
        layout = self.comm.layout
        ranks = tuple(layout.rank_of(replica, s) for s in range(layout.shards))
        self.started_attempts += 1
        seat_ = Seat(ranks, self.started_attempts, time.time(), self._context())
        # A standby's processes were spawned ahead of the loss: S of them, as for a cold spawn.
        att = JoinAttempt(self.started_attempts, (replica,), seat_, survivors=self.comm.world.Get_size(), spawned=layout.shards)
        dup = self.comm.duplicate_world()
        if self.comm.is_leader:
            att.leader.standby = next(sb for sb in self.seated if sb.replica == replica)
            att.leader.port = MPI.Open_port()
            att.leader.standby.connecting.clear()
            self._send_link(att.leader.standby, {"port": att.leader.port, "attempt": att.number}, TAG_SEAT)
            # The standby's processes, by their rank in the merged communicator (for the fence).
            for r, proc in att.leader.standby.procs.items():
                att.leader.procs[att.survivors + r - 1] = proc

        self.fault_point("join_accept", att.number)
        self._merge_in_background(att, lambda: dup.Accept(att.leader.port, root=0), "the standby's merge failed", "accept")
        if self.comm.is_leader:
            assert att.leader.standby is not None
            print(f"[lightning-recover] re-join attempt {att.number}: merging standby {att.leader.standby.number} "
                  f"for replica {replica}", file=sys.stderr, flush=True)

    def _merge_in_background(self, att: JoinAttempt, connect: Callable[[], Any], failure: str, name: str) -> None:
        """Reach the replacements (``connect`` returns the inter-communicator) and merge them, on a helper
        thread so the survivors keep training; the attempt holds the result (``merged``) or why not (``error``)."""
        MPI = _mpi()

        def run() -> None:
            try:
                merged = connect().Merge(high=False)
                merged.Set_errhandler(MPI.ERRORS_RETURN)
                att.merged = merged
            except MPI.Exception as exc:
                att.error = f"{failure}: {exc.Get_error_string()}"
            except Exception as exc:  # noqa: BLE001 - a thread's exception would vanish and leave the attempt waiting
                att.error = f"{failure}: {type(exc).__name__}: {exc}"

        att.thread = threading.Thread(target=run, name=f"lightning-recover-{name}-{att.number}", daemon=True)
        self.attempt = att
        att.thread.start()

    def _end_attempt_port(self, att: JoinAttempt) -> None:
        """Close the leader's port once its accept returned (a parked one keeps it)."""
        if att.leader.port is not None and att.thread is not None and not att.thread.is_alive():
            try:
                _mpi().Close_port(att.leader.port)
            except _mpi().Exception:
                pass
            att.leader.port = None

    def _collect_hellos(self, att: JoinAttempt) -> None:
        """The leader receives what the replacements said after the merge
        (:func:`~lightning_recover.membership.handshake.say_hello`); never blocks."""
        MPI = _mpi()
        status = MPI.Status()
        buf = np.zeros(3, dtype=np.int64)
        while att.merged.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_HELLO, status=status):
            src = status.Get_source()
            att.merged.Recv([buf, MPI.INT64_T], source=src, tag=TAG_HELLO)
            att.leader.procs[src] = (int(buf[0]), int(buf[1]), int(buf[2]))

    def _fence(self, att: JoinAttempt, reason: str) -> None:
        """The leader SIGKILLs the dropped attempt's replacements on its host that nobody will tell to leave:
        those that never said READY (dead, wedged or still starting), and all of them once GO was sent.

        Their own timer ends a replacement that runs; a stopped one (SIGSTOP) it cannot end, and
        that one would hold ``mpiexec`` open after training when the hang watchdog is off
        (``--hang-timeout 0``). A replacement on another host is left to its timer."""
        if not self.comm.is_leader:
            return
        MPI = _mpi()
        if att.merged is not None:
            try:
                self._collect_hellos(att)
            except MPI.Exception:
                pass  # a dead member: fence those that said who they are
        host = host_checksum()
        for r in att.joiner_ranks():
            if r in att.leader.procs and (att.admitting or r not in att.leader.ready):
                pid, start, where = att.leader.procs[r]
                if where == host:
                    lifecycle.kill_process(
                        pid, str(start), f"re-join attempt {att.number}: {reason}", by="leader",
                        target=f"replacement for rank {att.seat.ranks[r - att.survivors]}",
                    )

    def _abort(self, att: JoinAttempt) -> None:
        """Tell the replacements that said READY to leave, never blocking; the others are not contacted.

        A first send to a process opens the connection to it, and Open MPI looks its address
        up in the runtime then: for a replacement that died unreported (two that exited with
        a non-zero status in one attempt: only the first death reached the survivors) that
        lookup waits forever, inside ``Isend``, on the survivor's main thread. A replacement
        that said READY is connected already (its message came in); one that did not is dead,
        wedged or still starting, and leaves by its own timer (:mod:`lightning_recover.cli.joiner`)."""
        MPI = _mpi()
        if self.comm.is_leader and att.merged is not None:
            abort = np.array([ABORT], dtype=np.int64)
            self._sent.append(abort)  # the buffer outlives the freed requests
            for r in sorted(att.leader.ready):
                try:
                    att.merged.Isend([abort, MPI.INT64_T], dest=r, tag=TAG_DECISION).Free()
                except MPI.Exception:
                    pass  # that one is dead

    def drop(self, reason: str, *, notify: bool = True, repaired: bool = False) -> None:
        """Give the open attempt up (on every survivor): tell live replacements (``notify``), back off.

        After a repair nobody is told: a member of the merged communicator died, which
        interrupts the replacements' wait for the decision by itself. Such a drop
        (``repaired``) is the survivors' own doing, not the replacements' failure: it is not
        counted against ``rejoin.attempts``, the next attempt starts at the next boundary
        without backoff, and a standby's replacement that was merged keeps its seat (it asks
        to be merged again, see :func:`~lightning_recover.membership.handshake.connect`). One
        not merged yet may be blocked in ``MPI_Comm_connect`` against an accept that never
        completes (the survivors' world lost a member): it would never ask again, so it is
        fenced like a cold replacement and the replica waits for another standby."""
        att, self.attempt = self.attempt, None
        if att is None:
            return
        self._end_attempt_port(att)
        if att.thread is not None and not att.thread.is_alive():
            # Its spawn or merge may have failed inside a communicator creation (a member died), which
            # leaves Open MPI holding back the survivors' next one -- a repair's shrink included.
            unblock_cid_allocation()
        if repaired:
            keeps_seat = att.leader.standby is not None and att.leader.standby.error is None and att.merged is not None
            if keeps_seat:
                assert att.leader.standby is not None
                att.leader.standby.connecting.clear()  # it asks again
            else:
                self._fence(att, f"dropped ({reason})")
                if att.leader.standby is not None:
                    self._forget(att.leader.standby, reason)
            self._next_try = time.monotonic()
            if self.comm.is_leader:
                print(f"[lightning-recover] re-join attempt {att.number} dropped: {reason}; next attempt at the next "
                      f"step boundary" + (" (the standby keeps its seat)" if keeps_seat else
                                          " (the standby was not merged yet: ended, another one takes the seat)"
                                          if att.leader.standby is not None else ""),
                      file=sys.stderr, flush=True)
            return
        if notify:
            self._abort(att)
        self._fence(att, f"dropped ({reason})")
        if att.leader.standby is not None and att.leader.standby in self.seated:
            self.seated.remove(att.leader.standby)
            self._fence_standby(att.leader.standby, f"dropped ({reason})")
        self.failures_in_a_row += 1
        self._next_try = time.monotonic() + self.backoff_s * 2 ** (self.failures_in_a_row - 1)
        if self.comm.is_leader:
            more = self.failures_in_a_row < self.attempts
            print(
                f"[lightning-recover] re-join attempt {att.number} dropped: {reason}; "
                + (f"next attempt in {self.backoff_s * 2 ** (self.failures_in_a_row - 1):g} s" if more
                   else f"{self.attempts} failed in a row (recover.rejoin.attempts): training goes on without"),
                file=sys.stderr, flush=True,
            )

    def admit(self, att: JoinAttempt) -> bool:
        """Send GO and grow the world (every survivor); False, with the attempt dropped, if a member died
        or did not come within the attempt's time (at least :data:`ADMIT_GRACE_S` from now)."""
        MPI = _mpi()
        assert att.thread is not None
        deadline = max(att.started + self.timeout_s, time.monotonic() + ADMIT_GRACE_S)
        # The leader's merge completed, so every survivor's should have; a survivor whose merge
        # did not complete in time says so in grow's agreement, and the attempt is dropped everywhere.
        att.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        att.admitting = True
        if self.comm.is_leader and att.merged is not None:
            go = np.array([GO], dtype=np.int64)
            self._sent.append(go)
            for r in att.joiner_ranks():  # every one said READY: connected, the send cannot wait on the runtime
                try:
                    att.merged.Isend([go, MPI.INT64_T], dest=r, tag=TAG_DECISION).Free()
                except MPI.Exception:
                    pass  # grow's agreement below fails everywhere
        if not self.comm.grow(att.merged, deadline=deadline):
            self.attempt = att
            self.drop("a replacement died or did not come while the world grew", notify=False)
            att.merged = None  # gone members: never reuse it
            return False
        self.attempt = None
        self.failures_in_a_row = 0
        self._end_attempt_port(att)
        if att.leader.standby is not None:
            self.seated.remove(att.leader.standby)
            self.standby_failures = 0
        return True

