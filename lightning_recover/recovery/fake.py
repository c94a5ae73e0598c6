"""FakeWorld: the communicator contract kept in one process, for fast tests of the step engine.

Role in the recovery protocol: a stand-in for layer 1
(:class:`lightning_recover.communicator.FaultTolerantComm`) that keeps the contract of
:class:`~lightning_recover.recovery.interface.ReplicaComm` with ULFM's semantics, so the
step engine (layer 2) and the recovery callbacks can be driven through every failure
point in seconds. It complements the real MPI tests, it never replaces them.

Each simulated rank runs in its own thread (:meth:`FakeWorld.run`) and talks through its
:class:`FakeComm`. What ULFM does, the fake does:

* a collective of a world epoch is a rendezvous of that epoch's members; it completes
  (a real SUM of the tensors) once every member contributed, and when a member died
  without contributing, everyone waiting gets :class:`PeerFailure` and the epoch is
  revoked, so every later collective of it fails at once;
* ``agree`` is fault tolerant: it completes when every member contributed or is dead,
  and answers the same to everyone: the AND of the flags, ``False`` if a member died;
* ``repair`` shrinks to the survivors (fault tolerant), keeps complete replicas only,
  agrees on the result and advances ``world_epoch`` by one; a death inside it costs
  another round;
* the replica-consistency gate: a rank whose replica lost a member leaves (a
  :class:`RankDeath`) at its next communicator call, or as soon as it notices the failure.

Failures are scripted with :class:`Kill` (before or in the middle of a bucket of a
reduction or of a world allreduce, at an agreement, inside a repair) or raised from a
rank's own code with :meth:`FakeComm.die` (like fault injection's SIGKILL in a
microbatch). A death in the middle of a collective leaves part of the world with the
result and the rest with PeerFailure, as in MPI; nothing may depend on which. An uncaught
exception in a rank is a crash, a death like any other (as ``install_crash_hook`` makes it
in production). Every wait has a deadline: a protocol that would hang fails with an
``AssertionError`` starting "deadlock in FakeWorld" instead.

Uses torch and threads; no MPI, no Lightning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import torch

from lightning_recover.recovery.buckets import ReduceHandle, plan_buckets
from lightning_recover.recovery.interface import PeerFailure, RepairResult
from lightning_recover.topology import RankLayout

__all__ = ["Died", "FakeComm", "FakeWorld", "Kill", "RankDeath", "KILL_POINTS"]

R = TypeVar("R")

#: Where a :class:`Kill` can strike (see its docstring).
KILL_POINTS = ("bucket", "world", "agree", "repair")
# MPI has no 16-bit sum; the real communicator widens them to fp32, so the fake does too.
_WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
_SUMMABLE = {torch.float32, torch.float64, torch.int32, torch.int64, *_WIDEN}


@dataclass(frozen=True)
class Died:
    """How a simulated rank ended: ``killed`` (scripted), ``gate`` (its replica lost a member) or ``crashed``."""

    rank: int
    how: str
    where: str
    error: BaseException | None = field(default=None, compare=False)


class RankDeath(BaseException):
    """Unwinds a simulated rank's thread: it was killed or left through the gate.

    A ``BaseException`` like the SIGKILL it stands for: ``except Exception`` in the code
    under test does not catch it.
    """

    def __init__(self, died: Died) -> None:
        self.died = died
        super().__init__(f"rank {died.rank} {died.how}: {died.where}")


@dataclass(frozen=True)
class Kill:
    """Kill ``rank`` at a point of its own communicator calls (each kind counted per rank, from 1).

    ``at="bucket"``: before bucket ``bucket`` of its ``call``-th reduction across replicas
    (one per reduction round: a repair's re-reduce is the next call). ``at="world"``:
    before its ``call``-th allreduce across the world (the engine's loss reduction, or a
    collective between steps). ``at="agree"``: entering its ``call``-th agreement, before
    it contributes. ``at="repair"``: inside its ``call``-th repair, in round ``round``,
    after the shrink and before the agreement (the real communicator's
    ``fault_hook("repair:shrunk")``).

    ``mid=True`` (``bucket`` and ``world`` only): the rank dies *during* that collective,
    after its data went in: the ranks below it get the sum, the others PeerFailure, as
    when a real allreduce breaks after part of the world has its result.
    """

    rank: int
    at: str
    call: int = 1
    bucket: int = 0
    round: int = 1
    mid: bool = False

    def __post_init__(self) -> None:
        if self.at not in KILL_POINTS:
            raise ValueError(f"Kill.at must be one of {', '.join(KILL_POINTS)}, got {self.at!r}")
        for name in ("call", "round"):
            if getattr(self, name) < 1:
                raise ValueError(f"Kill.{name} counts from 1, got {getattr(self, name)}")
        if self.bucket < 0:
            raise ValueError(f"Kill.bucket is a bucket index (>= 0), got {self.bucket}")
        if self.mid and self.at not in ("bucket", "world"):
            raise ValueError(f"Kill.mid applies to a reduction (at='bucket' or 'world'), not at={self.at!r}")


@dataclass
class _Op:
    """One rendezvous: who takes part, what each gave, and (once complete) the one result all read."""

    members: tuple[int, ...]
    tag: tuple[Any, ...]
    inputs: dict[int, Any] = field(default_factory=dict)
    done: bool = False
    result: Any = None
    #: Set when a member died mid-collective: only these ranks get the result.
    lucky: frozenset[int] | None = None


class FakeWorld:
    """``replicas`` x ``shards`` simulated ranks in one process (see the module docstring)."""

    def __init__(
        self,
        replicas: int,
        shards: int = 1,
        bucket_numel: int = 4,
        *,
        kills: Iterable[Kill] = (),
        timeout: float = 10.0,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"FakeWorld needs at least one replica, got replicas={replicas}")
        if bucket_numel < 1:
            raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
        if timeout <= 0:
            raise ValueError(f"timeout is seconds to wait for peers, got {timeout}")
        self.layout = RankLayout(replicas * shards, shards)
        self.bucket_numel = bucket_numel
        self.timeout = timeout
        # One lock for the whole world: every decision (completion, death, revoke) is made
        # under it, which is what makes answers such as agree's uniform.
        self._cv = threading.Condition()
        self._members: dict[int, tuple[int, ...]] = {0: tuple(range(self.layout.world_size))}
        self._revoked: set[int] = set()
        self._dead: dict[int, Died] = {}
        self._ops: dict[tuple[Any, ...], _Op] = {}
        self._kills: list[Kill] = []
        self.fired: list[Kill] = []
        self._comms = {r: FakeComm(self, r) for r in range(self.layout.world_size)}
        self.kill(*kills)

    # ------------------------------------------------------------------ public
    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def comm(self, rank: int) -> FakeComm:
        """The communicator of simulated ``rank`` (the same object every time)."""
        if rank not in self._comms:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")
        return self._comms[rank]

    def kill(self, *kills: Kill) -> None:
        """Script more failures (see :class:`Kill`)."""
        for k in kills:
            if not 0 <= k.rank < self.world_size:
                raise ValueError(f"Kill.rank {k.rank} is not a rank of this world (0..{self.world_size - 1})")
        with self._cv:
            self._kills.extend(kills)

    @property
    def unfired(self) -> list[Kill]:
        """Scripted kills whose point was never reached (the rank died first, or never got there)."""
        with self._cv:
            return [k for k in self._kills if k not in self.fired]

    @property
    def dead(self) -> dict[int, Died]:
        """Ranks that died so far, and how."""
        with self._cv:
            return dict(self._dead)

    def run(
        self, fn: Callable[[FakeComm], R], *, timeout: float | None = None, raise_errors: bool = True
    ) -> dict[int, R | Died]:
        """Run ``fn(comm)`` on every live rank, each in its own thread; their results, or how they died.

        A rank that raised anything but :class:`RankDeath` crashed: it counts as dead for
        its peers (they recover from it), and with ``raise_errors`` the first such error
        is raised here once every thread has ended. Ranks dead before the call map to
        their :class:`Died`.
        """
        limit = timeout if timeout is not None else 4 * self.timeout
        results: dict[int, R | Died] = {}
        crashes: list[tuple[int, BaseException]] = []

        def body(comm: FakeComm) -> None:
            try:
                results[comm.rank] = fn(comm)
            except RankDeath as death:
                results[comm.rank] = death.died
            except BaseException as exc:  # noqa: BLE001 - a crash of the simulated rank, reported below
                died = Died(comm.rank, "crashed", f"{type(exc).__name__}: {exc}", exc)
                with self._cv:
                    crashes.append((comm.rank, exc))
                    self._mark_dead(died)
                results[comm.rank] = died

        live = [c for r, c in self._comms.items() if r not in self.dead]
        threads = [threading.Thread(target=body, args=(c,), name=f"fake-rank-{c.rank}", daemon=True) for c in live]
        for t in threads:
            t.start()
        deadline = time.monotonic() + limit
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [c.rank for c, t in zip(live, threads) if t.is_alive()]
        if stuck:
            raise AssertionError(
                f"deadlock in FakeWorld: ranks {stuck} still running {limit:.1f}s after run() started; "
                f"dead so far: {self._describe_dead()}"
            )
        for r, died in self.dead.items():
            results.setdefault(r, died)
        if raise_errors and crashes:
            rank, exc = crashes[0]
            exc.add_note(f"raised on simulated rank {rank} of FakeWorld (dead: {self._describe_dead()})")
            raise exc
        return dict(sorted(results.items()))

    # ------------------------------------------------------------------ deaths
    def _describe_dead(self) -> str:
        return ", ".join(f"{d.rank} ({d.how}: {d.where})" for d in self.dead.values()) or "none"

    def _mark_dead(self, died: Died) -> None:
        with self._cv:
            self._dead.setdefault(died.rank, died)
            self._cv.notify_all()

    def _die(self, comm: FakeComm, how: str, where: str) -> NoReturn:
        died = Died(comm.rank, how, where)
        self._mark_dead(died)
        raise RankDeath(died)

    def _enter(self, comm: FakeComm, what: str) -> None:
        """Every communicator call starts here: a dead rank never acts again; the gate applies."""
        with self._cv:
            if comm.rank in self._dead:
                raise RankDeath(self._dead[comm.rank])
            self._gate(comm, f"entering {what}")

    def _gate(self, comm: FakeComm, reason: str) -> None:
        mates = set(self.layout.ranks_of_replica(comm.replica)) - {comm.rank}
        lost = sorted(mates.intersection(self._dead))
        if lost:
            self._die(comm, "gate", f"{reason}: replica {comm.replica} lost rank(s) {lost}")

    def _due(self, comm: FakeComm, at: str, call: int, *, bucket: int = 0, repair_round: int = 1) -> Kill | None:
        """The scripted kill due at this point, if any (marked fired)."""
        with self._cv:
            for k in self._kills:
                if k in self.fired or k.rank != comm.rank or k.at != at or k.call != call:
                    continue
                if (at == "bucket" and k.bucket != bucket) or (at == "repair" and k.round != repair_round):
                    continue
                self.fired.append(k)
                return k
        return None

    def _maybe_kill(self, comm: FakeComm, at: str, call: int, *, bucket: int = 0, repair_round: int = 1) -> None:
        k = self._due(comm, at, call, bucket=bucket, repair_round=repair_round)
        if k is not None:
            self._die(comm, "killed", f"scripted {k}")

    def _failure(self, comm: FakeComm, epoch: int, where: str) -> PeerFailure:
        """What a rank sees when a collective of ``epoch`` fails: the gate first, then PeerFailure."""
        self._revoked.add(epoch)
        self._cv.notify_all()
        self._gate(comm, f"failure seen during {where}")
        known = [r for r in self._members[epoch] if r in self._dead]
        return PeerFailure(known, where)

    # ------------------------------------------------------------------ rendezvous
    def _op(self, key: tuple[Any, ...], members: tuple[int, ...], tag: tuple[Any, ...], rank: int) -> _Op:
        op = self._ops.setdefault(key, _Op(members, tag))
        if op.tag != tag or op.members != members:
            raise AssertionError(
                f"SPMD mismatch in FakeWorld at {key}: rank {rank} called {tag} over {members}, "
                f"but ranks {sorted(op.inputs)} called {op.tag} over {op.members}"
            )
        return op

    def _wait(self, deadline: float, comm: FakeComm, key: tuple[Any, ...], op: _Op) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            missing = [m for m in op.members if m not in op.inputs]
            raise AssertionError(
                f"deadlock in FakeWorld: rank {comm.rank} waited {self.timeout:.1f}s in {op.tag} "
                f"(key {key}) for ranks {missing}, which are alive and never came; dead: {self._describe_dead()}"
            )
        self._cv.wait(min(left, 0.5))

    def _reduce(
        self,
        comm: FakeComm,
        key: tuple[Any, ...],
        members: tuple[int, ...],
        tag: tuple[Any, ...],
        where: str,
        data: list[torch.Tensor],
        dying: Kill | None = None,
    ) -> list[torch.Tensor]:
        """A plain (not fault-tolerant) collective: SUM of ``data`` over ``members``, or PeerFailure.

        With ``dying`` this rank contributes and then dies inside the collective.
        """
        epoch = key[0]
        with self._cv:
            if epoch in self._revoked:
                if dying is not None:
                    self._die(comm, "killed", f"scripted {dying} (the collective was already revoked)")
                raise self._failure(comm, epoch, where)
            op = self._op(key, members, tag, comm.rank)
            op.inputs[comm.rank] = data
            if dying is not None:
                op.lucky = frozenset(m for m in members if m < comm.rank)
            if len(op.inputs) == len(members):
                # Member order, so every rank gets the same bits.
                op.result = [sum(op.inputs[m][j] for m in members) for j in range(len(data))]
                op.done = True
                self._cv.notify_all()
            if dying is not None:
                self._die(comm, "killed", f"scripted {dying}")
            deadline = time.monotonic() + self.timeout
            while True:
                if op.done:
                    if op.lucky is not None and comm.rank not in op.lucky:
                        raise self._failure(comm, epoch, where)
                    return [t.clone() for t in op.result]
                if epoch in self._revoked or any(m in self._dead and m not in op.inputs for m in members):
                    raise self._failure(comm, epoch, where)
                self._wait(deadline, comm, key, op)

    def _gather_ft(
        self, comm: FakeComm, key: tuple[Any, ...], members: tuple[int, ...], value: Any
    ) -> tuple[dict[int, Any], tuple[int, ...]]:
        """A fault-tolerant rendezvous (agree, shrink): completes once every member gave or died.

        Returns what the contributors gave and the members dead at completion, computed
        once and read by everyone.
        """
        with self._cv:
            op = self._op(key, members, key[1:2], comm.rank)
            op.inputs[comm.rank] = value
            deadline = time.monotonic() + self.timeout
            while True:
                if not op.done and all(m in op.inputs or m in self._dead for m in members):
                    op.result = (dict(op.inputs), tuple(m for m in members if m in self._dead))
                    op.done = True
                    self._cv.notify_all()
                if op.done:
                    return op.result  # type: ignore[no-any-return]
                self._wait(deadline, comm, key, op)


class FakeComm:
    """One simulated rank's communicator: keeps :class:`~lightning_recover.recovery.interface.ReplicaComm`."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self._world = world
        self.rank = rank  # original world rank, never changes
        self.replica = world.layout.replica_of(rank)
        self.shard = world.layout.shard_of(rank)
        self.world_epoch = 0
        self.alive_replicas: tuple[int, ...] = tuple(range(world.layout.replicas))
        self.lost_ranks: tuple[int, ...] = ()
        # Per-rank call counters, the coordinates of a scripted Kill.
        self.reductions = 0
        self.world_reductions = 0
        self.agreements = 0
        self.repairs = 0
        self._seq: dict[tuple[int, str], int] = {}

    def __repr__(self) -> str:
        return f"FakeComm(rank={self.rank}, replica={self.replica}, shard={self.shard}, world_epoch={self.world_epoch})"

    # ------------------------------------------------------------------ membership
    @property
    def members(self) -> tuple[int, ...]:
        """Original world ranks of the current world epoch."""
        return self._world._members[self.world_epoch]

    @property
    def is_leader(self) -> bool:
        """Rank 0 of the current world, as the real communicator defines it (the lowest live rank)."""
        return self.rank == min(self.members)

    def die(self, where: str = "own code") -> NoReturn:
        """End this rank now, like a SIGKILL from fault injection (raises :class:`RankDeath`)."""
        self._world._die(self, "killed", where)

    def _next(self, name: str) -> int:
        key = (self.world_epoch, name)
        self._seq[key] = self._seq.get(key, 0) + 1
        return self._seq[key]

    # ------------------------------------------------------------------ collectives
    def plan(self, tensors: Sequence[torch.Tensor]) -> ReduceHandle:
        """A fresh handle splitting ``tensors`` into buckets of ``bucket_numel`` elements."""
        return ReduceHandle(plan_buckets([t.numel() for t in tensors], self._world.bucket_numel))

    def allreduce(
        self,
        tensors: Sequence[torch.Tensor],
        out: Sequence[torch.Tensor] | None = None,
        *,
        handle: ReduceHandle | None = None,
        across: str = "replicas",
        on_bucket: Callable[[int], None] | None = None,
        after_bucket: Callable[[int], None] | None = None,
    ) -> ReduceHandle:
        """SUM ``tensors`` over the replicas (same shard) or the world, bucket by bucket, like the real one."""
        if across not in ("replicas", "world"):
            raise ValueError(f"across must be 'replicas' or 'world', got {across!r}")
        w = self._world
        w._enter(self, f"allreduce across {across}")
        dsts = list(out) if out is not None else list(tensors)
        _check_tensors(tensors, dsts)
        if handle is None:
            handle = self.plan(tensors)
        if across == "replicas":
            self.reductions += 1
            call, name = self.reductions, f"shard{self.shard}"
            members = tuple(m for m in self.members if w.layout.shard_of(m) == self.shard)
        else:
            self.world_reductions += 1
            call, name, members = self.world_reductions, "world", self.members
        first = True
        for i in handle.pending(self.world_epoch):
            if on_bucket is not None:
                on_bucket(i)
            if across == "replicas":
                due = w._due(self, "bucket", call, bucket=i)
            else:
                due = w._due(self, "world", call) if first else None
            if due is not None and not due.mid:
                w._die(self, "killed", f"scripted {due}")
            first = False
            bucket = handle.buckets[i]
            if out is None:
                if i in handle.snapshots:  # stale: restore the local values before reducing again
                    for (ti, s, e), snap in zip(bucket.segments, handle.snapshots[i]):
                        tensors[ti].detach().view(-1)[s:e].copy_(snap)
                else:
                    handle.snapshots[i] = [tensors[ti].detach().reshape(-1)[s:e].clone() for ti, s, e in bucket.segments]
            bucket.world_epoch = None
            # A copy: the peers sum it later, after this rank may have written its own result.
            data = [
                tensors[ti].detach().reshape(-1)[s:e].to(_WIDEN.get(tensors[ti].dtype, tensors[ti].dtype), copy=True)
                for ti, s, e in bucket.segments
            ]
            tag = ("reduce", across, i, tuple((s, e) for _, s, e in bucket.segments), tuple(str(t.dtype) for t in data))
            key = (self.world_epoch, name, self._next(name))
            sums = w._reduce(self, key, members, tag, f"reduce of bucket {i}/{len(handle.buckets)} across {across}", data, due)
            for (ti, s, e), total in zip(bucket.segments, sums):
                dsts[ti].detach().view(-1)[s:e].copy_(total)
            bucket.world_epoch = self.world_epoch
            if after_bucket is not None:
                after_bucket(i)
        return handle

    def agree(self, flag: bool = True) -> bool:
        """The AND of ``flag`` over the survivors, the same answer everywhere; ``False`` if a member died."""
        w = self._world
        w._enter(self, "agree")
        self.agreements += 1
        w._maybe_kill(self, "agree", self.agreements)
        key = (self.world_epoch, "agree", self._next("agree"))
        flags, dead = w._gather_ft(self, key, self.members, bool(flag))
        if dead:
            with w._cv:
                w._gate(self, "failure seen during agreement")
            return False
        return all(flags.values())

    def repair(self, max_rounds: int = 64) -> RepairResult:
        """Shrink to the survivors' complete replicas and advance the world epoch (see the module docstring)."""
        w = self._world
        w._enter(self, "repair")
        self.repairs += 1
        t0 = time.perf_counter()
        epoch = self.world_epoch
        before = self.members
        current = before
        for rnd in range(1, max_rounds + 1):
            shrunk, _ = w._gather_ft(self, (epoch, "shrink", rnd), current, True)
            present = tuple(sorted(shrunk))
            w._maybe_kill(self, "repair", self.repairs, repair_round=rnd)
            keep = w.layout.complete_replicas(present)
            mine_ok = self.replica in keep
            _, died = w._gather_ft(self, (epoch, "repair-agree", rnd), present, mine_ok)
            if died:
                current = present  # a death during the repair: another round
                continue
            if not mine_ok:
                lost_mates = sorted(set(w.layout.ranks_of_replica(self.replica)) - set(present))
                w._die(self, "gate", f"replica {self.replica} lost rank(s) {lost_mates} (seen while repairing)")
            now = tuple(r for p in keep for r in w.layout.ranks_of_replica(p))
            with w._cv:
                if w._members.setdefault(epoch + 1, now) != now:
                    raise AssertionError(
                        f"FakeWorld bug: two memberships for world epoch {epoch + 1}: {w._members[epoch + 1]} and {now}"
                    )
            self.world_epoch = epoch + 1
            lost = tuple(sorted(set(before) - set(now)))
            self.lost_ranks = tuple(sorted({*self.lost_ranks, *lost}))
            self.alive_replicas = tuple(keep)
            return RepairResult(
                world_epoch=self.world_epoch,
                lost_ranks=lost,
                lost_replicas=tuple(sorted(w.layout.replicas_touched(lost))),
                alive_replicas=self.alive_replicas,
                seconds=time.perf_counter() - t0,
                rounds=rnd,
            )
        raise RuntimeError(f"repair did not converge in {max_rounds} rounds; the job cannot continue")


def _check_tensors(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    if len(src) != len(dst):
        raise ValueError(f"got {len(src)} input tensors but {len(dst)} outputs")
    for i, (a, b) in enumerate(zip(src, dst)):
        if a.numel() != b.numel() or a.dtype != b.dtype:
            raise ValueError(f"tensor {i}: output {tuple(b.shape)}/{b.dtype} does not match input {tuple(a.shape)}/{a.dtype}")
        if not (a.is_contiguous() and b.is_contiguous()):
            raise ValueError(f"tensor {i} is not contiguous; call .contiguous() before reducing")
        if a.dtype not in _SUMMABLE:
            raise TypeError(f"tensor {i} has dtype {a.dtype}, which cannot be summed; use one of {sorted(map(str, _SUMMABLE))}")
