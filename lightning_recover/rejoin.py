"""Hot re-join over ULFM: replacement replicas start while the survivors train, and join at a step boundary.

A job that lost replicas spawns replacements (``recover.rejoin=true``), up to the replica
count it started with. A replacement takes the *logical ranks* of a lost replica (the
layout never changes) and runs the same program: the interpreter and the original argv,
behind ``python -m lightning_recover.joiner`` (:mod:`lightning_recover.joiner`), which
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
             checkpoint, dumped in memory, shard by shard (:func:`send_state` /
             :func:`recv_state`); every rank admits the new replicas into the policy
             (:meth:`StepEngine.admit`).
    DROP     a replacement died (the leader's probe of the merged communicator fails), the
             spawn failed, the attempt passed ``rejoin_timeout_s``, or not every member came
             to the admission's barrier: the survivors drop the merged communicator (never
             revoke it: on Open MPI 5.0.11 revoking a communicator shared with a dead child
             wedged the survivors' next broadcast on their own world), the leader tells the
             replacements that said READY to ABORT, and the next attempt waits
             ``rejoin_backoff_s`` (doubled per failure in a row). After ``rejoin_attempts``
             failures in a row the job carries on without.

**What a failing replacement costs.** A replacement that exits (any status), crashes
(SIGKILL) or wedges (SIGSTOP) at any point before admission costs the survivors at most
its attempt: ``rejoin_timeout_s`` from the spawn (plus :data:`ADMIT_GRACE_S` if it fails
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
SIGKILL (:mod:`lightning_recover.joiner`), which Open MPI does report, so such an attempt is
usually dropped at the next step boundary rather than after ``rejoin_timeout_s``.

A repair of the survivors' world while an attempt is open drops it the same way (a
survivor of the merged communicator is gone). A replacement that is never admitted leaves
by itself after ``rejoin_timeout_s`` (the joiner's timer), so none outlives its attempt;
and when an attempt is dropped (or training ends) the leader SIGKILLs the attempt's
replacements on its host that nobody tells to leave -- those that never said READY, and all
of them once GO was sent -- from the pid and start time each sent right after the merge
(:func:`say_hello`): a stopped one, which its own timer cannot end, would otherwise hold
``mpiexec`` open after training when the hang watchdog is off.
A Spawn that never returns (a child killed before MPI_Init completed) leaves a parked
daemon thread behind: the attempt is dropped by its timeout, bounded by the attempt limit.

**Warm standbys** (``recover.rejoin_standbys = n``). A cold replacement spends most of its
time before the loss could matter to it: starting Python and MPI, importing torch and
Lightning, running the script's set-up (on this project's 2-core machine, 8-15 s of the
13-29 s measured from the kill to contributing again). So the leader keeps ``n`` standbys
spawned ahead of any loss, each one replica's processes::

    SPAWN    the leader alone Spawns S processes from MPI_COMM_SELF (a background thread;
             the next one only once the others are warm) and Merges them into a *link*
             (leader rank 0). They run ``python -m lightning_recover.joiner --standby``:
             say hello (pid) on the link, import the strategy and the installed packages the
             script imports at its top level (nothing of the user's own code), say WARM, and
             sleep, looking at the link every :data:`STANDBY_POLL_S` (no core taken).
    SEAT     a replica is lost: at the next boundary the leader sends a warm standby the
             lost replica's seat (no collective: only the leader knows its standbys). The
             standby starts its timer and runs the script as that replica's ranks, up to
             admission, where it sends CONNECT on the link.
    START    at the first boundary after CONNECT the leader decides START for that replica;
             every survivor duplicates its world and Accepts on a port the leader opened and
             sent over the link (a background thread); the standby Connects and both sides
             Merge (survivors first). From here on it is a replacement like any other: READY,
             ADMIT or DROP above.

Why the merge waits for the script: a standby's merged communicator is made from the
survivors' world *after* its script set up, so a loss among the survivors during the
script costs nothing; a loss during the short merge-and-admit window drops the attempt as
usual (a repair), but a standby's replacement keeps its seat and sends CONNECT again (its
timer restarts). ``MPI_Intercomm_create`` between the link and the world would need no port,
but it crashed Open MPI 5.0.11's ``coll/han`` on the merged communicator here;
Accept/Connect exchanges what ``han`` needs. A standby whose leader dies leaves by itself
(an MPI error on the link, or the leader's pid gone from this host); the new leader spawns
its own. At the end of training the leader tells its standbys to leave (``quit``) and
fences (SIGKILL, same host) those that never said hello. A standby that dies is counted:
after ``rejoin_attempts`` in a row the leader spawns no more and replacements are spawned
cold again. Drops caused by the survivors' own repair (any attempt) are not failures:
no backoff, not counted against ``rejoin_attempts``.

**Where a replacement's time goes.** Each replacement prints one line as its first step
starts, from the milestones it reached (:data:`MILESTONES`, :func:`breakdown`): spawn to
Python, MPI and merge, (standby) imports and wait, the script's imports and set-up, model
and optimizer, (standby) merge, the wait for a step boundary, the growth and transfer, and
the total since the loss. The leader's "re-joined" line says how long after the loss.

A replacement's program sees the job it joins, not its spawn: the joiner sets
``OMPI_COMM_WORLD_SIZE`` and ``OMPI_COMM_WORLD_RANK`` to the job's size and the logical rank
taken over, and the survivors' ``LR_*`` / ``LIGHTNING_RECOVER_*`` variables
(:func:`job_environ`), before the script runs; ``MPI.COMM_WORLD`` stays the spawn's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_recover import lifecycle

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

    from lightning_recover.communicator import FaultTolerantComm

__all__ = ["JoinAttempt", "Recruiter", "Seat", "recv_state", "send_state", "seat"]

log = logging.getLogger(__name__)

#: The survivors' environment variables a replacement takes over (see :func:`job_environ`).
FORWARDED_ENV_PREFIXES = ("LR_", "LIGHTNING_RECOVER_")

#: Seconds an admission may wait for every member beyond the attempt's limit (one that became
#: ready just before ``rejoin_timeout_s`` still gets this long to meet the survivors).
ADMIT_GRACE_S = 10.0

TAG_READY = 7301
TAG_DECISION = 7302
TAG_STATE = 7303
TAG_HELLO = 7304
#: Standby <-> leader, on the standby's link (see "Warm standbys" above).
TAG_WARM = 7305
TAG_SEAT = 7306
TAG_CONNECT = 7307
GO, ABORT = 1, 0
# The leader's per-boundary decision, broadcast to every survivor.
NOTHING, START, ADMIT, DROP = 0, 1, 2, 3
#: The second code of a START: a cold spawn (otherwise the replica whose seated standby connects).
COLD = -1

#: Seconds between a waiting standby's looks at its link: it sleeps in between, so that it
#: takes no core from the training ranks (a blocking MPI wait would poll one at 100%).
STANDBY_POLL_S = 0.02

#: Wall-clock times (``time.time()``) of this replacement's start-up milestones, see :func:`mark`.
_marks: dict[str, float] = {}

#: The milestones of a replacement, in order, with what the time up to each went to.
MILESTONES: tuple[tuple[str, str], ...] = (
    ("python", "spawn to Python"),
    ("merged", "MPI start and merge"),
    ("warm", "standby imports"),
    ("seated", "standby waiting for a loss"),
    ("strategy", "script imports and set-up"),
    ("ready", "model, optimizer, Lightning set-up"),
    ("connected", "standby merge"),
    ("go", "waiting for a step boundary"),
    ("state", "world growth and state transfer"),
    ("first_step", "Lightning's restore, first step begins"),
)


def mark(milestone: str) -> None:
    """Record when this replacement reached ``milestone`` (one of :data:`MILESTONES`; a repeat keeps the latest)."""
    if milestone not in dict(MILESTONES):
        raise ValueError(f"unknown re-join milestone {milestone!r}; use one of {[m for m, _ in MILESTONES]}")
    _marks[milestone] = time.time()


def breakdown(spawned_at: float, lost_at: float | None) -> str:
    """Where this replacement's start-up time went, one phrase per milestone reached, for its log line
    (a standby counts from its own spawn, not from its seat's)."""
    parts, prev = [], _marks.get("spawned", spawned_at)
    for key, what in MILESTONES:
        if key in _marks:
            parts.append(f"{what} {_marks[key] - prev:.2f} s")
            prev = _marks[key]
    since = f"; {prev - lost_at:.2f} s after the loss" if lost_at is not None else ""
    return ", ".join(parts) + since


@dataclass(frozen=True)
class Seat:
    """What a replacement is told when it is spawned (JSON in its argv)."""

    #: Logical rank of each spawned process, in the order of the children's own world.
    ranks: tuple[int, ...]
    attempt: int
    #: Wall-clock time the spawn started (the replacement's start-up time is measured from it).
    spawned_at: float
    #: What the survivors' setup broadcast that a replacement cannot take part in (logger versions).
    context: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"ranks": list(self.ranks), "attempt": self.attempt, "spawned_at": self.spawned_at, "context": self.context})

    @classmethod
    def from_json(cls, text: str) -> Seat:
        d = json.loads(text)
        return cls(tuple(int(r) for r in d["ranks"]), int(d["attempt"]), float(d["spawned_at"]), dict(d.get("context", {})))


@dataclass
class Joining:
    """This process is a replacement: its seat and the communicator it was merged into."""

    seat: Seat
    #: The children's own world (the replacements of this attempt), for their replica-local setup.
    children: MPI.Intracomm
    #: Survivors first, then the replacements; becomes the world at admission. A standby has
    #: none until :func:`connect` (its script runs first), and makes a new one after each
    #: attempt the survivors' own repair dropped.
    merged: MPI.Intracomm | None
    #: A standby's link: the leader that spawned it (rank 0), then its own processes.
    link: MPI.Intracomm | None = None

    @property
    def rank(self) -> int:
        """This process's logical rank."""
        return self.seat.ranks[self.children.Get_rank()]


_joining: Joining | None = None


def seat() -> Joining | None:
    """The seat this process was spawned into, or None for a rank of the original launch."""
    return _joining


def _set_joining(joining: Joining) -> None:
    global _joining
    _joining = joining


def _mpi() -> Any:
    from mpi4py import MPI

    return MPI


def job_environ() -> dict[str, str]:
    """This survivor's variables named ``LR_*`` or ``LIGHTNING_RECOVER_*``, for the seat of a replacement.

    The job's own settings, which the survivors may have resolved while running (for one,
    ``examples/pretrain.py`` fixes ``LR_RUN_STAMP``, its run directory, once rank 0's start
    time is known): a replacement starts later and from mpiexec's environment, and would
    otherwise resolve them differently (another run directory, another checkpoint dir).
    The joiner sets them before the script runs (:mod:`lightning_recover.joiner`)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


# ---------------------------------------------------------------------- survivor side
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
    #: Merged-communicator ranks that said READY (counted by the leader).
    ready: set[int] = field(default_factory=set)
    #: What each replacement said right after the merge (the leader's): pid, start time, host checksum.
    procs: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: GO was sent: from here on nobody tells the replacements anything more.
    admitting: bool = False
    #: The seated standby this attempt merges (the leader's; None on the others and for a cold spawn).
    standby: Standby | None = None
    #: The port the survivors accept a standby on (the leader's), closed when the attempt ends.
    port: str | None = None

    @property
    def size(self) -> int:
        return len(self.seat.ranks)

    def joiner_ranks(self) -> range:
        return range(self.survivors, self.survivors + self.size)


@dataclass
class Standby:
    """One warm standby as the leader sees it: one replica's processes, spawned ahead of a loss."""

    number: int
    spawned_at: float = field(default_factory=time.time)
    thread: threading.Thread | None = None
    #: The leader (rank 0) and the standby's processes (ranks 1..S, in their own world's order).
    link: Any = None
    error: str | None = None
    #: What each process said right after its merge with the leader: pid, start time, host checksum.
    procs: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: Link ranks that finished their imports (TAG_WARM).
    warm: set[int] = field(default_factory=set)
    #: The replica it was seated for (its script runs as that replica's ranks), None while idle.
    replica: int | None = None
    #: Link ranks whose script reached admission and asked to be merged (TAG_CONNECT).
    connecting: set[int] = field(default_factory=set)

    def alive_on_this_host(self) -> bool:
        """False when a process of it that said hello on this host is gone (SIGKILL, exit)."""
        host = _host_checksum()
        return all(lifecycle.process_start_time(pid) == str(start)
                   for pid, start, where in self.procs.values() if where == host and start >= 0)


class Recruiter:
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
    ) -> None:
        self.comm = comm
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
        #: Warm standbys to keep (the leader's, see "Warm standbys" in the module docstring).
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
        return self.attempt is not None or (bool(self.missing) and self.failures_in_a_row < self.attempts)

    def boundary(self, can_admit: bool) -> JoinAttempt | None:
        """The leader's decision, applied on every survivor. Returns the attempt to admit now, if any.

        Collective over the survivors' world (wrap it in ``StepEngine.run_collective``);
        a caller that gets an attempt runs the admission (:meth:`admit`) right away.
        """
        if not self.active():
            return None
        codes = self._decide(can_admit) if self.comm.is_leader else (NOTHING, COLD)
        code, replica = self.comm.broadcast_codes(list(codes))
        if code == START:
            self._start(replica)
        elif code == DROP:
            self.drop("the replacements did not start" if self.attempt is None or self.attempt.error is None else self.attempt.error)
        elif code == ADMIT:
            return self.attempt
        return None

    def _decide(self, can_admit: bool) -> tuple[int, int]:
        att = self.attempt
        if att is None:
            if self.serving_standbys():
                # A seated standby whose script is ready is merged now; otherwise wait for one
                # (a cold spawn now would only take cores from the standbys starting up).
                ready = next((sb for sb in self.seated if len(sb.connecting) == self.shards), None)
                return (START, ready.replica) if ready is not None and ready.replica is not None else (NOTHING, COLD)
            return (START, COLD) if time.monotonic() >= self._next_try else (NOTHING, COLD)
        status = self._status(att)
        if status == "failed":
            return DROP, COLD
        if status == "ready" and can_admit:
            return ADMIT, COLD
        return NOTHING, COLD

    def _status(self, att: JoinAttempt) -> str:
        """The leader's view of an attempt: "ready", "failed" or "waiting"."""
        MPI = _mpi()
        timed_out = time.monotonic() - att.started > self.timeout_s
        if att.error is not None:
            return "failed"
        if att.merged is None:
            if att.standby is not None and (att.standby.error is not None or not att.standby.alive_on_this_host()):
                att.error = f"standby {att.standby.number} died before it was merged"
                return "failed"
            if timed_out:
                att.error = f"the spawn did not complete in {self.timeout_s:g} s (recover.rejoin_timeout_s)"
                return "failed"
            return "waiting"
        status = MPI.Status()
        buf = np.zeros(1, dtype=np.int64)
        try:
            self._collect_hellos(att)
            while att.merged.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_READY, status=status):
                src = status.Get_source()
                att.merged.Recv([buf, MPI.INT64_T], source=src, tag=TAG_READY)
                att.ready.add(src)
        except MPI.Exception as exc:
            att.error = f"a replacement died while starting ({exc.Get_error_string()})"
            return "failed"
        if len(att.ready) == att.size:
            return "ready"
        if timed_out:
            att.error = f"{att.size - len(att.ready)} replacement(s) not ready after {self.timeout_s:g} s (recover.rejoin_timeout_s)"
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
        att = JoinAttempt(self.started_attempts, replicas, seat_, survivors=self.comm.world.Get_size())
        dup = self.comm.duplicate_world()
        info = self._spawn_info()
        args = ["-m", "lightning_recover.joiner", seat_.to_json(), *self.argv]

        self._merge_in_background(
            att, lambda: dup.Spawn(sys.executable, args=args, maxprocs=len(ranks), info=info, root=0), "spawn failed", "spawn"
        )
        if self.comm.is_leader:
            print(
                f"[lightning-recover] re-join attempt {att.number}: spawning {len(ranks)} rank(s) for replica(s) {list(replicas)}",
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

    # ------------------------------------------------------------------ warm standbys (the leader's)
    def _context(self) -> dict[str, Any]:
        return {**self.context(), "lost_at": self.lost_at}

    def serving_standbys(self) -> bool:
        """Whether this job's missing replicas come from standbys (else from cold spawns): the leader's view."""
        return self.standbys > 0 and (bool(self.pool) or bool(self.seated)) and self.standby_failures < self.attempts

    def tend(self, *, training: bool = True) -> None:
        """The leader, at every step boundary: keep :attr:`standbys` standbys, seat idle ones on missing
        replicas, and notice deaths. Never blocks and sends only to processes that said hello.
        ``training=False`` (the job still sets up): a standby spawned now imports at full priority."""
        if not self.comm.is_leader or self.standbys <= 0:
            return
        self._training = training
        for sb in [*self.pool, *self.seated]:
            self._poll_standby(sb)
            if sb.error is not None and (self.attempt is None or self.attempt.standby is not sb):
                self._forget(sb, sb.error)
        seated = {sb.replica for sb in self.seated}
        if self.attempt is not None:
            seated.update(self.attempt.replicas)
        for r in self.missing:
            if r in seated:
                continue
            idle = next((sb for sb in self.pool if len(sb.warm) == self.shards), None)
            if idle is None:
                break
            self._seat(idle, r)
        started = 0
        # While the job sets up, every standby starts at once: their imports overlap the job's own
        # start-up, and a loss in the first steps finds them all ready or nearly (one after the other,
        # the second was ready 7 s after an early loss, where torchft's restart takes 5 s). During
        # training one starts at a time: on hosts whose cores the training ranks use, two importing
        # torch at once would both be ready late, where one after the other has the first ready early.
        while (len(self.pool) < self.standbys and self.standby_failures < self.attempts
               and (not training or all(len(sb.warm) == self.shards for sb in self.pool))):
            self._spawn_standby()
            started += 1
        if started and not training:
            print(f"[lightning-recover] {started} warm standby(s) starting while the job sets up (recover.rejoin_standbys)",
                  file=sys.stderr, flush=True)

    def _forget(self, sb: Standby, reason: str) -> None:
        if sb in self.pool:
            self.pool.remove(sb)
        if sb in self.seated:
            self.seated.remove(sb)
        self.standby_failures += 1
        self._fence_standby(sb, reason)
        print(f"[lightning-recover] standby {sb.number} lost: {reason}"
              + ("" if self.standby_failures < self.attempts else
                 f"; {self.attempts} in a row (recover.rejoin_attempts): replacements are spawned cold from now on"),
              file=sys.stderr, flush=True)

    def _spawn_standby(self) -> None:
        """Spawn one standby (one replica's processes) from this process alone, in a background thread."""
        MPI = _mpi()
        self.spawned_standbys += 1
        sb = Standby(self.spawned_standbys)
        start = lifecycle.process_start_time(os.getpid())
        from lightning_recover import mpi_wait

        # On a host whose cores the job's ranks already share, a standby spawned during training
        # would take cores from it: it yields them (see joiner.yield_while_warming). One spawned
        # while the job sets up races the job's first loss instead, at full priority.
        spec = {"number": sb.number, "leader_pid": os.getpid(), "leader_start": start, "leader_host": _host_checksum(),
                "spawned_at": sb.spawned_at, "yield_cpu": mpi_wait.polite() and self._training, "timeout_s": self.timeout_s}
        args = ["-m", "lightning_recover.joiner", "--standby", json.dumps(spec), *self.argv]
        info = self._spawn_info()
        # Spawn is collective over its communicator: standbys spawned at once from their own threads
        # must not share one (two collectives in flight on one communicator are erroneous in MPI).
        parent = MPI.COMM_SELF.Dup()

        def spawn() -> None:
            try:
                inter = parent.Spawn(sys.executable, args=args, maxprocs=self.shards, info=info, root=0)
                link = inter.Merge(high=False)
                link.Set_errhandler(MPI.ERRORS_RETURN)
                sb.link = link
            except MPI.Exception as exc:
                sb.error = f"spawn failed: {exc.Get_error_string()}"
            finally:
                parent.Free()

        sb.thread = threading.Thread(target=spawn, name=f"lightning-recover-standby-{sb.number}", daemon=True)
        self.pool.append(sb)
        sb.thread.start()

    def _spawn_info(self) -> Any:
        MPI = _mpi()
        info = MPI.Info.Create()
        info.Set("wdir", os.getcwd())
        info.Set("bind_to", "none")
        if self.hosts:
            info.Set("host", self.hosts)
        else:
            # A dead rank's slot is not given back: only an oversubscribed placement finds room.
            info.Set("map_by", ":OVERSUBSCRIBE")
        return info

    def _poll_standby(self, sb: Standby) -> None:
        """Read what a standby said (hello, warm, connect) without blocking; a dead one gets ``error``."""
        MPI = _mpi()
        if sb.link is None or sb.error is not None:
            return
        status = MPI.Status()
        buf = np.zeros(3, dtype=np.int64)
        try:
            for tag in (TAG_HELLO, TAG_WARM, TAG_CONNECT):
                while sb.link.Iprobe(source=MPI.ANY_SOURCE, tag=tag, status=status):
                    src = status.Get_source()
                    sb.link.Recv([buf, MPI.INT64_T], source=src, tag=tag)
                    if tag == TAG_HELLO:
                        sb.procs[src] = (int(buf[0]), int(buf[1]), int(buf[2]))
                    elif tag == TAG_WARM:
                        sb.warm.add(src)
                    else:
                        sb.connecting.add(src)
        except MPI.Exception as exc:
            sb.error = f"a standby process died ({exc.Get_error_string()})"
            return
        if not sb.alive_on_this_host():
            sb.error = "a standby process died"

    def _send_link(self, sb: Standby, payload: dict[str, Any], tag: int) -> None:
        """A small JSON message to every process of ``sb`` that said hello (connected: the send never waits)."""
        MPI = _mpi()
        data = np.frombuffer(json.dumps(payload).encode(), dtype=np.uint8).copy()
        self._sent.append(data)  # the buffer outlives the freed requests
        for r in sorted(sb.procs):
            try:
                sb.link.Isend([data, MPI.BYTE], dest=r, tag=tag).Free()
            except MPI.Exception:
                pass  # that one is dead: tend() notices

    def _seat(self, sb: Standby, replica: int) -> None:
        """Give an idle standby the seat of a lost replica: its script starts at once, merged later (connect)."""
        layout = self.comm.layout
        ranks = tuple(layout.rank_of(replica, s) for s in range(layout.shards))
        seat_ = Seat(ranks, self.started_attempts + 1, time.time(), self._context())
        self._send_link(sb, {"seat": seat_.to_json()}, TAG_SEAT)
        self.pool.remove(sb)
        sb.replica = replica
        self.seated.append(sb)
        print(f"[lightning-recover] standby {sb.number} takes the seat of replica {replica}", file=sys.stderr, flush=True)

    def _dismiss(self, sb: Standby, reason: str) -> None:
        """Tell a standby to leave (it exits 0); one that never said hello is fenced instead."""
        if sb.link is not None:
            self._poll_standby(sb)
            if sb.procs and sb.error is None:
                self._send_link(sb, {"quit": reason}, TAG_SEAT)
        if len(sb.procs) < self.shards:
            self._fence_standby(sb, reason)

    def _fence_standby(self, sb: Standby, reason: str) -> None:
        """SIGKILL the standby's processes on this host that are still there (a stopped or wedged one too)."""
        host = _host_checksum()
        for pid, start, where in sb.procs.values():
            if where == host and start >= 0:
                lifecycle.kill_process(pid, str(start), f"standby {sb.number}: {reason}", by="leader", target="standby")

    def _start_standby(self, replica: int) -> None:
        """START for a seated standby: every survivor accepts it on a duplicate of the world (background thread)."""
        MPI = _mpi()
        layout = self.comm.layout
        ranks = tuple(layout.rank_of(replica, s) for s in range(layout.shards))
        self.started_attempts += 1
        seat_ = Seat(ranks, self.started_attempts, time.time(), self._context())
        att = JoinAttempt(self.started_attempts, (replica,), seat_, survivors=self.comm.world.Get_size())
        dup = self.comm.duplicate_world()
        if self.comm.is_leader:
            att.standby = next(sb for sb in self.seated if sb.replica == replica)
            att.port = MPI.Open_port()
            att.standby.connecting.clear()
            self._send_link(att.standby, {"port": att.port, "attempt": att.number}, TAG_SEAT)
            # The standby's processes, by their rank in the merged communicator (for the fence).
            for r, proc in att.standby.procs.items():
                att.procs[att.survivors + r - 1] = proc

        self._merge_in_background(att, lambda: dup.Accept(att.port, root=0), "the standby's merge failed", "accept")
        if self.comm.is_leader:
            assert att.standby is not None
            print(f"[lightning-recover] re-join attempt {att.number}: merging standby {att.standby.number} "
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
        if att.port is not None and att.thread is not None and not att.thread.is_alive():
            try:
                _mpi().Close_port(att.port)
            except _mpi().Exception:
                pass
            att.port = None

    def _collect_hellos(self, att: JoinAttempt) -> None:
        """The leader receives what the replacements said after the merge (:func:`say_hello`); never blocks."""
        MPI = _mpi()
        status = MPI.Status()
        buf = np.zeros(3, dtype=np.int64)
        while att.merged.Iprobe(source=MPI.ANY_SOURCE, tag=TAG_HELLO, status=status):
            src = status.Get_source()
            att.merged.Recv([buf, MPI.INT64_T], source=src, tag=TAG_HELLO)
            att.procs[src] = (int(buf[0]), int(buf[1]), int(buf[2]))

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
        host = _host_checksum()
        for r in att.joiner_ranks():
            if r in att.procs and (att.admitting or r not in att.ready):
                pid, start, where = att.procs[r]
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
        wedged or still starting, and leaves by its own timer (:mod:`lightning_recover.joiner`)."""
        MPI = _mpi()
        if self.comm.is_leader and att.merged is not None:
            abort = np.array([ABORT], dtype=np.int64)
            self._sent.append(abort)  # the buffer outlives the freed requests
            for r in sorted(att.ready):
                try:
                    att.merged.Isend([abort, MPI.INT64_T], dest=r, tag=TAG_DECISION).Free()
                except MPI.Exception:
                    pass  # that one is dead

    def drop(self, reason: str, *, notify: bool = True, repaired: bool = False) -> None:
        """Give the open attempt up (on every survivor): tell live replacements (``notify``), back off.

        After a repair nobody is told: a member of the merged communicator died, which
        interrupts the replacements' wait for the decision by itself. Such a drop
        (``repaired``) is the survivors' own doing, not the replacements' failure: it is not
        counted against ``rejoin_attempts``, the next attempt starts at the next boundary
        without backoff, and a standby's replacement keeps its seat (it asks to be merged
        again, see :func:`connect`)."""
        att, self.attempt = self.attempt, None
        if att is None:
            return
        self._end_attempt_port(att)
        if repaired:
            if att.standby is not None and att.standby.error is None:
                att.standby.connecting.clear()  # it keeps its seat, and asks again
            else:
                self._fence(att, f"dropped ({reason})")
                if att.standby is not None:
                    self._forget(att.standby, reason)
            self._next_try = time.monotonic()
            if self.comm.is_leader:
                print(f"[lightning-recover] re-join attempt {att.number} dropped: {reason}; next attempt at the next "
                      f"step boundary" + (" (the standby keeps its seat)" if att.standby is not None else ""),
                      file=sys.stderr, flush=True)
            return
        if notify:
            self._abort(att)
        self._fence(att, f"dropped ({reason})")
        if att.standby is not None and att.standby in self.seated:
            self.seated.remove(att.standby)
            self._fence_standby(att.standby, f"dropped ({reason})")
        self.failures_in_a_row += 1
        self._next_try = time.monotonic() + self.backoff_s * 2 ** (self.failures_in_a_row - 1)
        if self.comm.is_leader:
            more = self.failures_in_a_row < self.attempts
            print(
                f"[lightning-recover] re-join attempt {att.number} dropped: {reason}; "
                + (f"next attempt in {self.backoff_s * 2 ** (self.failures_in_a_row - 1):g} s" if more
                   else f"{self.attempts} failed in a row (recover.rejoin_attempts): training goes on without"),
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
        if att.standby is not None:
            self.seated.remove(att.standby)
            self.standby_failures = 0
        return True


# ---------------------------------------------------------------------- replacement side
def _host_checksum() -> int:
    """This host's name as a number (what :func:`say_hello` sends; the leader compares it with its own)."""
    return zlib.crc32(socket.gethostname().encode())


def say_hello(merged: MPI.Intracomm) -> None:
    """Right after the merge, tell the leader who this process is (pid, start time, host), so that
    it can end this replacement if its attempt is dropped (see :meth:`Recruiter._fence`). Best effort."""
    MPI = _mpi()
    start = lifecycle.process_start_time(os.getpid())
    hello = np.array([os.getpid(), int(start) if start is not None and start.isdigit() else -1, _host_checksum()], dtype=np.int64)
    try:
        merged.Send([hello, MPI.INT64_T], dest=0, tag=TAG_HELLO)
    except MPI.Exception:
        pass  # the leader is gone: the attempt is dropped, and the joiner's timer ends this process


def await_admission(joining: Joining, said_ready: Callable[[], None] = lambda: None) -> str:
    """Say READY to the survivors and wait for their decision: ``"go"`` (then :meth:`grow`), ``"abort"``
    (the survivors dropped the attempt), or ``"lost"`` when a member of the merged communicator
    died (the survivors' repair dropped the attempt; the joiner's timer bounds a wait nobody
    answers). ``said_ready`` runs in between (the ``join_ready`` fault point)."""
    MPI = _mpi()
    merged = joining.merged
    assert merged is not None, "await_admission before the replacement was merged (connect)"
    buf = np.zeros(1, dtype=np.int64)
    try:
        merged.Send([np.array([joining.rank], dtype=np.int64), MPI.INT64_T], dest=0, tag=TAG_READY)
        said_ready()
        merged.Recv([buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=TAG_DECISION)
    except MPI.Exception:
        return "lost"
    return "go" if int(buf[0]) == GO else "abort"


def wait_on_link(link: MPI.Intracomm, leader_alive: Callable[[], bool]) -> dict[str, Any] | None:
    """A standby's wait for the leader's next word (TAG_SEAT, JSON), sleeping between looks so that
    it takes no core from training; None when the leader is gone (an MPI error, or ``leader_alive``
    says so)."""
    MPI = _mpi()
    status = MPI.Status()
    checked = time.monotonic()
    while True:
        try:
            if link.Iprobe(source=0, tag=TAG_SEAT, status=status):
                data = np.empty(status.Get_count(MPI.BYTE), dtype=np.uint8)
                link.Recv([data, MPI.BYTE], source=0, tag=TAG_SEAT)
                return dict(json.loads(data.tobytes().decode()))
        except MPI.Exception:
            return None
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if not leader_alive():
                return None
        time.sleep(STANDBY_POLL_S)


def tell_leader(link: MPI.Intracomm, tag: int) -> bool:
    """One small message to the leader on a standby's link; False if the leader is gone."""
    MPI = _mpi()
    try:
        link.Send([np.zeros(3, dtype=np.int64), MPI.INT64_T], dest=0, tag=tag)
    except MPI.Exception:
        return False
    return True


#: Set by the joiner for a standby's replacement: whether the leader that spawned it still runs.
leader_alive: Callable[[], bool] = lambda: True


def connect(joining: Joining) -> bool:
    """A standby's replacement, ready to be admitted: ask the leader to be merged, and merge.

    Sends TAG_CONNECT on the link, waits for the leader's port (the survivors START an attempt
    at their next step boundary and accept on it), connects and merges (survivors first), and
    says hello on the merged communicator. False when the leader is gone or sent ``quit``."""
    MPI = _mpi()
    link = joining.link
    assert link is not None, "connect() is for a standby's replacement"
    if not tell_leader(link, TAG_CONNECT):
        return False
    msg = wait_on_link(link, leader_alive)
    if msg is None or "port" not in msg:
        return False
    try:
        inter = MPI.COMM_WORLD.Connect(str(msg["port"]), root=0)
        merged = inter.Merge(high=True)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
    except MPI.Exception:
        return False
    joining.merged = merged
    joining.seat = dataclasses.replace(joining.seat, attempt=int(msg["attempt"]))
    say_hello(merged)
    mark("connected")
    return True


def give_up(joining: Joining, reason: str) -> None:
    """A replacement that was not admitted leaves quietly: one stderr line, exit status 0."""
    print(f"[lightning-recover] replacement for rank {joining.rank}: {reason}; leaving", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------- the state transfer
def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a placeholder (its index in ``tensors``, and how to rebuild it)."""
    import torch
    if isinstance(obj, torch.Tensor):
        spec = None
        local = obj
        if hasattr(obj, "to_local") and hasattr(obj, "placements"):
            spec = {"placements": tuple(obj.placements), "shape": tuple(obj.shape), "stride": tuple(obj.stride())}
            local = obj.to_local()
        tensors.append(local.detach().to("cpu").contiguous())
        return _Placeholder(len(tensors) - 1, tuple(local.shape), local.dtype, spec)
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_flatten(v, tensors) for v in obj)
    return obj


@dataclass(frozen=True)
class _Placeholder:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: For a DTensor: its placements and global shape/stride (rebuilt on the joiner's mesh).
    dtensor: dict[str, Any] | None


def _restore(obj: Any, tensors: Sequence[torch.Tensor], mesh: Any, device: torch.device) -> Any:
    if isinstance(obj, _Placeholder):
        t = tensors[obj.index].to(device)
        if obj.dtensor is not None:
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(t, mesh, obj.dtensor["placements"], shape=obj.dtensor["shape"], stride=obj.dtensor["stride"])
        return t
    if isinstance(obj, dict):
        return {k: _restore(v, tensors, mesh, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(v, tensors, mesh, device) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_restore(v, tensors, mesh, device) for v in obj)
    return obj


def _bytes(t: torch.Tensor) -> np.ndarray:
    import torch

    return t.view(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)


def send_state(comm: FaultTolerantComm, state: dict[str, Any], to: Sequence[int]) -> int:
    """Send ``state`` (a checkpoint dict; DTensors go as their local shard) to world ranks ``to``; returns bytes sent.

    The skeleton travels pickled, every tensor as its raw bytes (no pickling of tensor data).
    A peer death raises :class:`PeerFailure` (through the communicator's failure path).
    """
    MPI = _mpi()
    tensors: list[torch.Tensor] = []
    skeleton = pickle.dumps(_flatten(state, tensors), protocol=pickle.HIGHEST_PROTOCOL)
    header = np.frombuffer(skeleton, dtype=np.uint8)
    sent = 0
    try:
        for dest in to:
            comm.world.Send([np.array([header.size], dtype=np.int64), MPI.INT64_T], dest=dest, tag=TAG_STATE)
            comm.world.Send([header, MPI.BYTE], dest=dest, tag=TAG_STATE)
            for t in tensors:
                comm.world.Send([_bytes(t), MPI.BYTE], dest=dest, tag=TAG_STATE)
            sent += header.size + sum(t.numel() * t.element_size() for t in tensors)
    except MPI.Exception as exc:
        raise comm.fail_for("state transfer", exc) from None
    return sent


def recv_state(comm: FaultTolerantComm, source: int, mesh: Any, device: torch.device) -> dict[str, Any]:
    """Receive what :func:`send_state` sent from world rank ``source``; DTensors are rebuilt on ``mesh``."""
    import torch

    MPI = _mpi()
    try:
        n = np.zeros(1, dtype=np.int64)
        comm.world.Recv([n, MPI.INT64_T], source=source, tag=TAG_STATE)
        header = np.empty(int(n[0]), dtype=np.uint8)
        comm.world.Recv([header, MPI.BYTE], source=source, tag=TAG_STATE)
        skeleton = pickle.loads(header.tobytes())
        tensors: list[torch.Tensor] = []
        for ph in sorted(_placeholders(skeleton), key=lambda p: p.index):
            t = torch.empty(ph.shape, dtype=ph.dtype)
            if t.numel():
                comm.world.Recv([_bytes(t), MPI.BYTE], source=source, tag=TAG_STATE)
            tensors.append(t)
    except MPI.Exception as exc:
        raise comm.fail_for("state transfer", exc) from None
    return _restore(skeleton, tensors, mesh, device)


def _placeholders(obj: Any) -> Iterator[_Placeholder]:
    if isinstance(obj, _Placeholder):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _placeholders(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _placeholders(v)


def donor_and_recipients(comm: FaultTolerantComm, joiners: Sequence[int]) -> tuple[int, dict[int, list[int]]]:
    """The donor replica (the lowest live veteran) and, per shard, the world ranks of the replacements it sends to."""
    members = comm.members
    veterans = [r for r in comm.alive_replicas if r not in joiners]
    if not veterans:
        # Not a PeerFailure: a repair cannot bring a donor back, and retrying would loop forever.
        raise RuntimeError(
            f"every replica that held the live state died before the transfer (live: {list(comm.alive_replicas)}, "
            f"all replacements); relaunch from the newest checkpoint (ckpt_path=last)"
        )
    donor = veterans[0]
    layout = comm.layout
    to: dict[int, list[int]] = {}
    for s in range(layout.shards):
        to[s] = [members.index(layout.rank_of(r, s)) for r in joiners if layout.rank_of(r, s) in members]
    return donor, to
