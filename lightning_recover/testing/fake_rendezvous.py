"""The simulated world's ULFM core: one lock, memberships by world epoch, deaths, and the rendezvous.

Role in the recovery protocol: the semantics :class:`~lightning_recover.testing.fake.FakeWorld`
keeps for the step engine, as ULFM keeps them for the real communicator. Every collective
of a simulated rank is a rendezvous of its world epoch's members, decided once under one
lock and read by everyone, so the answers are uniform where ULFM's are:

* a plain collective (:meth:`Rendezvous._reduce`) completes with the SUM in member order once
  every member gave; a member dead without giving revokes the epoch and every waiter gets
  :class:`~lightning_recover.comm.interface.PeerFailure` (a member dying *inside* it leaves
  the ranks below it with the result, as a real allreduce broken half-way does);
* a fault-tolerant one (:meth:`Rendezvous._gather_ft`: agree, shrink) completes once every
  member gave or died, and tells everyone the same dead;
* a survivors' merge (:meth:`Rendezvous._merge`) admits the replicas whose replacement ranks
  are all ready, or nobody if a member died;
* the replica-consistency gate (:meth:`Rendezvous._gate`): a rank whose replica lost a
  member dies (:class:`~lightning_recover.testing.fake_faults.RankDeath`) when it notices.

Every wait has a deadline: a protocol that would hang fails with an ``AssertionError``
starting "deadlock in FakeWorld" instead. Uses torch (the sums) and threads; no MPI.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import torch

from lightning_recover.comm.interface import PeerFailure
from lightning_recover.comm.topology import RankLayout
from lightning_recover.testing.fake_faults import Died, Kill, RankDeath

__all__ = ["Rendezvous", "SimulatedRank"]


class SimulatedRank(Protocol):
    """What the core reads of a simulated rank (a :class:`~lightning_recover.testing.fake.FakeComm`)."""

    #: Original world rank (a replacement takes it again).
    rank: int
    #: Incarnation: 0 started with the job, n the n-th replacement.
    life: int
    replica: int


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


class Rendezvous:
    """The state every simulated rank shares and the rendezvous it meets in (see the module docstring).

    :class:`~lightning_recover.testing.fake.FakeWorld` builds on it: the ranks' threads,
    their communicators and the failure script live there.
    """

    def __init__(self, layout: RankLayout, timeout: float) -> None:
        self.layout = layout
        self.timeout = timeout
        # One lock for the whole world: every decision (completion, death, revoke) is made
        # under it, which is what makes answers such as agree's uniform.
        self._cv = threading.Condition()
        self._members: dict[int, tuple[int, ...]] = {0: tuple(range(self.layout.world_size))}
        self._revoked: set[int] = set()
        self._dead: dict[int, Died] = {}
        self._ops: dict[tuple[Any, ...], _Op] = {}
        #: Every death so far, earlier incarnations of respawned ranks included, in order.
        self.deaths: list[Died] = []
        # Re-join: replacement ranks ready in join(), and the admissions merges decided.
        self._ready: set[int] = set()
        self._admitted: dict[int, tuple[int, tuple[int, ...], tuple[int, ...], Any]] = {}

    @property
    def dead(self) -> dict[int, Died]:
        """Ranks that died so far, and how."""
        with self._cv:
            return dict(self._dead)

    # ------------------------------------------------------------------ deaths
    def _describe_dead(self) -> str:
        return ", ".join(f"{d.rank} ({d.how}: {d.where})" for d in self.dead.values()) or "none"

    def _mark_dead(self, died: Died) -> None:
        with self._cv:
            if died.rank not in self._dead:
                self._dead[died.rank] = died
                self.deaths.append(died)
                self._ready.discard(died.rank)
            self._cv.notify_all()

    def _die(self, comm: SimulatedRank, how: str, where: str) -> NoReturn:
        died = Died(comm.rank, how, where, life=comm.life)
        self._mark_dead(died)
        raise RankDeath(died)

    def _gate(self, comm: SimulatedRank, reason: str) -> None:
        mates = set(self.layout.ranks_of_replica(comm.replica)) - {comm.rank}
        lost = sorted(mates.intersection(self._dead))
        if lost:
            self._die(comm, "gate", f"{reason}: replica {comm.replica} lost rank(s) {lost}")

    def _failure(self, comm: SimulatedRank, epoch: int, where: str) -> PeerFailure:
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

    def _wait(self, deadline: float, comm: SimulatedRank, key: tuple[Any, ...], op: _Op) -> None:
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
        comm: SimulatedRank,
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
        self, comm: SimulatedRank, key: tuple[Any, ...], members: tuple[int, ...], value: Any
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

    def _merge(
        self, comm: SimulatedRank, key: tuple[Any, ...], members: tuple[int, ...], payload: Any, wait_for: tuple[int, ...]
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The survivors' side of a merge (fault tolerant, decided once under the lock).

        Completes when every member gave or died and every replica in ``wait_for`` is
        ready or dead. Returns (joined replicas, new members), or None when a member died.
        """
        epoch = key[0]
        with self._cv:
            op = self._op(key, members, ("merge", wait_for), comm.rank)
            op.inputs[comm.rank] = payload
            self._cv.notify_all()
            deadline = time.monotonic() + self.timeout
            while True:
                if not op.done and all(m in op.inputs or m in self._dead for m in members) and all(
                    all(r in self._ready or r in self._dead for r in self.layout.ranks_of_replica(p)) for p in wait_for
                ):
                    if any(m in self._dead for m in members):
                        op.result = None
                    else:
                        joined = tuple(
                            p
                            for p in range(self.layout.replicas)
                            if all(r in self._ready for r in self.layout.ranks_of_replica(p))
                        )
                        new = tuple(sorted({*members, *(r for p in joined for r in self.layout.ranks_of_replica(p))}))
                        alive = tuple(sorted({self.layout.replica_of(r) for r in new}))
                        if joined:
                            if self._members.setdefault(epoch + 1, new) != new:
                                raise AssertionError(
                                    f"FakeWorld bug: two memberships for world epoch {epoch + 1}: {self._members[epoch + 1]} and {new}"
                                )
                            # Shard by shard: each joiner rank gets the state of the lowest member holding its shard.
                            for p in joined:
                                for r in self.layout.ranks_of_replica(p):
                                    shard = self.layout.shard_of(r)
                                    given = op.inputs[min(m for m in members if self.layout.shard_of(m) == shard)]
                                    self._ready.discard(r)
                                    self._admitted[r] = (epoch + 1, joined, alive, given)
                        op.result = (joined, new)
                    op.done = True
                    self._cv.notify_all()
                if op.done:
                    return op.result  # type: ignore[no-any-return]
                self._wait(deadline, comm, key, op)
