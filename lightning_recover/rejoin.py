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

A replacement's program sees the job it joins, not its spawn: the joiner sets
``OMPI_COMM_WORLD_SIZE`` and ``OMPI_COMM_WORLD_RANK`` to the job's size and the logical rank
taken over, and the survivors' ``LR_*`` / ``LIGHTNING_RECOVER_*`` variables
(:func:`job_environ`), before the script runs; ``MPI.COMM_WORLD`` stays the spawn's.
"""

from __future__ import annotations

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
import torch

from lightning_recover import lifecycle
from lightning_recover.communicator import FaultTolerantComm

if TYPE_CHECKING:
    from mpi4py import MPI

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
GO, ABORT = 1, 0
# The leader's per-boundary decision, broadcast to every survivor.
NOTHING, START, ADMIT, DROP = 0, 1, 2, 3


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
    #: Survivors first, then the replacements; becomes the world at admission.
    merged: MPI.Intracomm

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

    @property
    def size(self) -> int:
        return len(self.seat.ranks)

    def joiner_ranks(self) -> range:
        return range(self.survivors, self.survivors + self.size)


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
        code = self._decide(can_admit) if self.comm.is_leader else NOTHING
        code = self.comm.broadcast_codes([code])[0]
        if code == START:
            self._start()
        elif code == DROP:
            self.drop("the replacements did not start" if self.attempt is None or self.attempt.error is None else self.attempt.error)
        elif code == ADMIT:
            return self.attempt
        return None

    def _decide(self, can_admit: bool) -> int:
        att = self.attempt
        if att is None:
            return START if time.monotonic() >= self._next_try else NOTHING
        status = self._status(att)
        if status == "failed":
            return DROP
        if status == "ready" and can_admit:
            return ADMIT
        return NOTHING

    def _status(self, att: JoinAttempt) -> str:
        """The leader's view of an attempt: "ready", "failed" or "waiting"."""
        MPI = _mpi()
        timed_out = time.monotonic() - att.started > self.timeout_s
        if att.error is not None:
            return "failed"
        if att.merged is None:
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

    def _start(self) -> None:
        MPI = _mpi()
        layout = self.comm.layout
        replicas = self.missing
        ranks = tuple(layout.rank_of(r, s) for r in replicas for s in range(layout.shards))
        self.started_attempts += 1
        seat_ = Seat(ranks, self.started_attempts, time.time(), self.context())
        att = JoinAttempt(self.started_attempts, replicas, seat_, survivors=self.comm.world.Get_size())
        dup = self.comm.duplicate_world()
        info = MPI.Info.Create()
        info.Set("wdir", os.getcwd())
        info.Set("bind_to", "none")
        if self.hosts:
            info.Set("host", self.hosts)
        else:
            # A dead rank's slot is not given back: only an oversubscribed placement finds room.
            info.Set("map_by", ":OVERSUBSCRIBE")
        args = ["-m", "lightning_recover.joiner", seat_.to_json(), *self.argv]

        def spawn() -> None:
            try:
                inter = dup.Spawn(sys.executable, args=args, maxprocs=len(ranks), info=info, root=0)
                merged = inter.Merge(high=False)
                merged.Set_errhandler(MPI.ERRORS_RETURN)
                att.merged = merged
            except MPI.Exception as exc:
                att.error = f"spawn failed: {exc.Get_error_string()}"

        att.thread = threading.Thread(target=spawn, name=f"lightning-recover-spawn-{att.number}", daemon=True)
        self.attempt = att
        att.thread.start()
        if self.comm.is_leader:
            print(
                f"[lightning-recover] re-join attempt {att.number}: spawning {len(ranks)} rank(s) for replica(s) {list(replicas)}",
                file=sys.stderr, flush=True,
            )

    def close(self) -> None:
        """End of training: an open attempt's replacements are told ABORT (they leave at once), the others fenced."""
        att, self.attempt = self.attempt, None
        if att is not None:
            self._abort(att)
            self._fence(att, "training ended before it was admitted")

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

    def drop(self, reason: str, *, notify: bool = True) -> None:
        """Give the open attempt up (on every survivor): tell live replacements (``notify``), back off.

        After a repair nobody is told: a member of the merged communicator died, which
        interrupts the replacements' wait for the decision by itself."""
        att, self.attempt = self.attempt, None
        if att is None:
            return
        if notify:
            self._abort(att)
        self._fence(att, f"dropped ({reason})")
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


def await_admission(joining: Joining, said_ready: Callable[[], None] = lambda: None) -> bool:
    """Say READY to the survivors and wait for their decision: True on GO (then :meth:`grow`), False on ABORT
    or when the leader died (the joiner's timer bounds a wait nobody answers). ``said_ready`` runs
    in between (the ``join_ready`` fault point)."""
    MPI = _mpi()
    merged = joining.merged
    buf = np.zeros(1, dtype=np.int64)
    try:
        merged.Send([np.array([joining.rank], dtype=np.int64), MPI.INT64_T], dest=0, tag=TAG_READY)
        said_ready()
        merged.Recv([buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=TAG_DECISION)
    except MPI.Exception:
        return False  # the leader that spawned us is gone: its attempt is dropped
    return int(buf[0]) == GO


def give_up(joining: Joining, reason: str) -> None:
    """A replacement that was not admitted leaves quietly: one stderr line, exit status 0."""
    print(f"[lightning-recover] replacement for rank {joining.rank}: {reason}; leaving", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(0)


# ---------------------------------------------------------------------- the state transfer
def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a placeholder (its index in ``tensors``, and how to rebuild it)."""
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
