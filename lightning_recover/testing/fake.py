"""FakeWorld: the communicator contract kept in one process, for fast tests of the step engine.

Role in the recovery protocol: a stand-in for the collectives
(:class:`lightning_recover.comm.communicator.FaultTolerantComm`) that keeps the contract of
:class:`~lightning_recover.comm.interface.ReplicaComm` with ULFM's semantics, so the
step engine (in-step recovery) and the recovery callbacks can be driven through every failure
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
  :class:`~lightning_recover.testing.fake_faults.RankDeath`) at its next communicator call,
  or as soon as it notices the failure.

Hot re-join, as Spawn + Merge do it in ULFM: :meth:`FakeWorld.spawn` starts a replacement
for a lost replica (its ranks again, next incarnation: ``FakeComm.life``) in new threads of
the running :meth:`FakeWorld.run`; a replacement calls :meth:`FakeComm.join` when it is
ready and waits there. Only the survivors decide when membership grows: at a step boundary
they call :meth:`FakeComm.merge`, a fault-tolerant rendezvous that admits every replica
whose ranks are all ready (optionally waiting for some), hands each joiner rank the
payload of the lowest member holding the same shard (the live state, shard by shard) and
advances ``world_epoch``. A joiner ready in the middle of a
step therefore waits for the next boundary. A member dead at the merge makes it fail the
same way everywhere (:class:`PeerFailure`, nobody admitted): repair, then merge again.

Failures are scripted with :class:`~lightning_recover.testing.fake_faults.Kill` (before or in
the middle of a bucket of a reduction or of a world allreduce, at an agreement, inside a
repair, entering a merge or, for a replacement, entering join: a death during start-up) or
raised from a rank's own code with :meth:`FakeComm.die` (like fault injection's SIGKILL in a
microbatch). A death in the middle of a collective leaves part of the world with the
result and the rest with PeerFailure, as in MPI; nothing may depend on which. An uncaught
exception in a rank is a crash, a death like any other (as ``install_crash_hook`` makes it
in production). Every wait has a deadline: a protocol that would hang fails with an
``AssertionError`` starting "deadlock in FakeWorld" instead.

Where it lives: :mod:`lightning_recover.testing.fake_rendezvous` keeps these semantics (the
lock, memberships, deaths, the rendezvous), :mod:`lightning_recover.testing.fake_faults` the
failure script (:class:`~lightning_recover.testing.fake_faults.Kill`) and how a rank ends
(:class:`~lightning_recover.testing.fake_faults.Died`); this module the world's threads and
each rank's communicator.

Uses torch and threads; no MPI, no Lightning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import torch

from lightning_recover.comm.buckets import ReduceHandle, plan_buckets
from lightning_recover.comm.interface import RepairResult
from lightning_recover.comm.topology import RankLayout
from lightning_recover.testing.fake_faults import Died, Kill, RankDeath
from lightning_recover.testing.fake_rendezvous import Rendezvous

__all__ = ["Admission", "FakeComm", "FakeWorld", "Merged"]

R = TypeVar("R")

# MPI has no 16-bit sum; the real communicator widens them to fp32, so the fake does too.
_WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
_SUMMABLE = {torch.float32, torch.float64, torch.int32, torch.int64, *_WIDEN}


@dataclass(frozen=True)
class Merged:
    """What a survivors' merge did: the joiners admitted (none: nothing changed) and the new world."""

    world_epoch: int
    joined: tuple[int, ...]
    alive_replicas: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class Admission:
    """What a joiner learns when a merge admits it: the new world and the leader's payload."""

    world_epoch: int
    joined: tuple[int, ...]
    alive_replicas: tuple[int, ...]
    payload: Any
    #: Seconds it waited in join() for a merge.
    waited_s: float


class FakeWorld(Rendezvous):
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
        super().__init__(RankLayout(replicas * shards, shards), timeout)
        self.bucket_numel = bucket_numel
        self._kills: list[Kill] = []
        self.fired: list[Kill] = []
        self._comms = {r: FakeComm(self, r) for r in range(self.layout.world_size)}
        self._requests: set[Hashable] = set()
        # Threads of the current run(); spawn() adds to it.
        self._threads: list[tuple[FakeComm, threading.Thread]] = []
        self._body: Callable[[FakeComm, Callable[[FakeComm], Any]], None] | None = None
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
    def joining(self) -> tuple[int, ...]:
        """Replicas whose replacement ranks are all ready in join(), waiting for a merge."""
        with self._cv:
            return tuple(
                p for p in range(self.layout.replicas) if all(r in self._ready for r in self.layout.ranks_of_replica(p))
            )

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

        def body(comm: FakeComm, fn: Callable[[FakeComm], Any]) -> None:
            try:
                results[comm.rank] = fn(comm)
            except RankDeath as death:
                results[comm.rank] = death.died
            except BaseException as exc:  # noqa: BLE001 - a crash of the simulated rank, reported below
                died = Died(comm.rank, "crashed", f"{type(exc).__name__}: {exc}", exc, life=comm.life)
                with self._cv:
                    crashes.append((comm.rank, exc))
                    self._mark_dead(died)
                results[comm.rank] = died

        with self._cv:
            self._body, self._threads = body, []
            for r, c in self._comms.items():
                if r not in self._dead:
                    self._start(c, fn)
        deadline = time.monotonic() + limit
        i = 0
        while True:
            with self._cv:
                if i >= len(self._threads):
                    self._body = None  # every thread ended: no more spawns into this run
                    break
                t = self._threads[i][1]
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                break
            i += 1
        stuck = [c.rank for c, t in self._threads if t.is_alive()]
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

    def _start(self, comm: FakeComm, fn: Callable[[FakeComm], Any]) -> None:
        assert self._body is not None
        t = threading.Thread(target=self._body, args=(comm, fn), name=f"fake-rank-{comm.rank}.{comm.life}", daemon=True)
        self._threads.append((comm, t))
        t.start()

    def spawn(self, replica: int, fn: Callable[[FakeComm], Any], *, request: Hashable | None = None) -> bool:
        """Start a replacement for lost ``replica``: its ranks again, next incarnation, running ``fn``.

        Call it from a rank's code inside :meth:`run` (the new threads belong to that run).
        The replica must be dead and repaired out of the world. Every survivor may ask for
        the same replacement: returns False (nothing started) for a ``request`` already
        served, or, without one, while a replacement is starting or waiting to be merged.
        """
        if not 0 <= replica < self.layout.replicas:
            raise ValueError(f"replica {replica} is not a replica of this world (0..{self.layout.replicas - 1})")
        ranks = self.layout.ranks_of_replica(replica)
        with self._cv:
            if self._body is None:
                raise RuntimeError("spawn() outside run(): call it from a simulated rank's code")
            if request is not None:
                if request in self._requests:
                    return False
                self._requests.add(request)
            if not all(r in self._dead for r in ranks):
                if all(self._comms[r].world_epoch is None for r in ranks):
                    return False  # its replacement is starting or waiting to be merged
                raise ValueError(
                    f"spawn({replica}): replica {replica} is alive (ranks {list(ranks)}); only a lost replica is replaced"
                )
            newest = self._members[max(self._members)]
            if any(r in newest for r in ranks):
                raise ValueError(
                    f"spawn({replica}): replica {replica} is dead but still a member of world epoch "
                    f"{max(self._members)}; repair the world first (replace only what a repair removed)"
                )
            for r in ranks:
                old = self._comms[r]
                self._dead.pop(r)
                self._comms[r] = FakeComm(self, r, life=old.life + 1)
            for r in ranks:
                self._start(self._comms[r], fn)
            self._cv.notify_all()
        return True

    # ------------------------------------------------------------------ entering a call, scripted kills
    def _enter(self, comm: FakeComm, what: str) -> None:
        """Every communicator call starts here: a dead rank never acts again; the gate applies."""
        with self._cv:
            if comm.rank in self._dead:
                raise RankDeath(self._dead[comm.rank])
            if self._comms[comm.rank] is not comm:
                raise RankDeath(Died(comm.rank, "killed", f"{what}: incarnation {comm.life} was replaced", life=comm.life))
            self._gate(comm, f"entering {what}")

    def _due(self, comm: FakeComm, at: str, call: int, *, bucket: int = 0, repair_round: int = 1) -> Kill | None:
        """The scripted kill due at this point, if any (marked fired)."""
        with self._cv:
            for k in self._kills:
                if k in self.fired or k.rank != comm.rank or k.life != comm.life or k.at != at or k.call != call:
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


class FakeComm:
    """One simulated rank's communicator: keeps :class:`~lightning_recover.comm.interface.ReplicaComm`."""

    def __init__(self, world: FakeWorld, rank: int, life: int = 0) -> None:
        self._world = world
        self.rank = rank  # original world rank, never changes (a replacement takes it again)
        self.life = life  # 0: started with the job; n: the n-th replacement of this rank
        self.replica = world.layout.replica_of(rank)
        self.shard = world.layout.shard_of(rank)
        # A replacement is in no world until a merge admits it.
        self.world_epoch: int | None = 0 if life == 0 else None  # type: ignore[assignment]
        self.alive_replicas: tuple[int, ...] = tuple(range(world.layout.replicas)) if life == 0 else ()
        self.lost_ranks: tuple[int, ...] = ()
        # Per-rank call counters, the coordinates of a scripted Kill.
        self.reductions = 0
        self.world_reductions = 0
        self.agreements = 0
        self.repairs = 0
        self.merges = 0
        self._seq: dict[tuple[int, str], int] = {}

    def __repr__(self) -> str:
        return (
            f"FakeComm(rank={self.rank}, life={self.life}, replica={self.replica}, shard={self.shard}, "
            f"world_epoch={self.world_epoch})"
        )

    # ------------------------------------------------------------------ membership
    @property
    def members(self) -> tuple[int, ...]:
        """Original world ranks of the current world epoch."""
        return self._world._members[self.world_epoch]

    @property
    def is_leader(self) -> bool:
        """Rank 0 of the current world, as the real communicator defines it (the lowest live rank)."""
        return self.rank == min(self.members)

    # ------------------------------------------------------------------ re-join
    def merge(self, payload: Any = None, *, wait_for: Collection[int] = ()) -> Merged:
        """Survivors, at a step boundary: admit the replacements that are ready (see the module docstring).

        Every member calls it with the same ``wait_for`` (replicas to wait for, ready or
        dead: tests use it to pin the boundary a join lands on). A joiner rank receives the
        ``payload`` of the lowest member holding its shard. Raises :class:`PeerFailure` on every survivor alike if a member
        died: repair, then merge again (the joiners keep waiting).
        """
        w = self._world
        w._enter(self, "merge")
        self.merges += 1
        w._maybe_kill(self, "merge", self.merges)
        t0 = time.perf_counter()
        epoch = self.world_epoch
        key = (epoch, "merge", self._next("merge"))
        result = w._merge(self, key, self.members, payload, tuple(sorted(set(wait_for))))
        if result is None:
            with w._cv:
                raise w._failure(self, epoch, "merge")
        joined, new = result
        if joined:
            self.world_epoch = epoch + 1
            self.alive_replicas = tuple(sorted({w.layout.replica_of(r) for r in new}))
        return Merged(self.world_epoch, joined, self.alive_replicas, time.perf_counter() - t0)

    def join(self) -> Admission:
        """A replacement: ready now; wait until a survivors' merge admits this replica."""
        w = self._world
        w._enter(self, "join")
        if self.world_epoch is not None:
            raise RuntimeError(f"rank {self.rank} is already a member (world epoch {self.world_epoch}); only a replacement joins")
        w._maybe_kill(self, "join", 1)
        t0 = time.perf_counter()
        with w._cv:
            w._ready.add(self.rank)
            w._cv.notify_all()
            # Survivors may take long (a whole step) to reach the boundary: a generous bound.
            deadline = time.monotonic() + 4 * w.timeout
            while self.rank not in w._admitted:
                w._gate(self, "waiting to join")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"deadlock in FakeWorld: replacement rank {self.rank} (life {self.life}) waited "
                        f"{4 * w.timeout:.1f}s in join() and no merge admitted it; dead: {w._describe_dead()}"
                    )
                w._cv.wait(min(left, 0.5))
            epoch, joined, alive, payload = w._admitted.pop(self.rank)
        self.world_epoch = epoch
        self.alive_replicas = alive
        return Admission(epoch, joined, alive, payload, time.perf_counter() - t0)

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
        out: Sequence[torch.Tensor],
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
        dsts = list(out)
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
