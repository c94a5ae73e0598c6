"""StaticWorld: ReCoVer's constant-B workload policy, made exactly-once (ReCoVer's versatile workload).

Each step sums the gradients of exactly B = T * G_init microbatches with fixed step-local
ids 0..B-1, whatever fails. A lost contributor is replaced by the spare that shadows it (no
extra compute), or its ids are replayed by the survivors (a boundary step). The per-replica
quota is :func:`steady_quota`; the protocol (begin_step -> fail* -> commit, join at a
boundary) is :class:`lightning_recover.workload.policy.WorkloadPolicy`'s.

A join never changes B; the steady plan of the enlarged live set re-balances the roles:
G_cur falls back towards G_init as replicas return, and once more than T are live the extra
ones are spares again.

A joiner's first step: with ``StaticWorld(join_as_spare=True)`` (the default) the
replicas admitted at a boundary are spares for the step that follows it, shadowing a
contributor, and the replicas that were already live carry the step exactly as they
would have without the join; from the next step on the joiners contribute. Dying in
that first step then costs no replay, and a contributor lost in it is covered by the
joiner at no extra compute. With ``join_as_spare=False`` the joiners contribute at once
when the live replicas before them cannot carry B at G_init (they are ordered after the
replicas already live, so they are the spares when more than T are live).
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from lightning_recover.config import ConfigurationError
from lightning_recover.workload.policy import WorkloadPolicy, _check_setting, _Slot
from lightning_recover.workload.step_plan import CommitRecord, Membership, PolicyError, Role, StepPlan, TooFewReplicasError

__all__ = ["StaticWorld", "steady_quota"]


def steady_quota(B: int, W_cur: int, G_init: int) -> int:
    """Smallest G >= G_init with W_cur * G >= B: the per-replica quota that keeps B constant."""
    if W_cur < 1:
        raise TooFewReplicasError(f"no live replicas left to carry B={B}")
    return max(G_init, -(-B // W_cur))

class StaticWorld(WorkloadPolicy):
    """ReCoVer's constant-B policy with exactly-once microbatch ids (see module docstring)."""

    name = "static"

    def __init__(
        self,
        W_init: int,
        G_init: int,
        T: int | None = None,
        min_replicas: int = 1,
        *,
        join_as_spare: bool = True,
    ) -> None:
        if not isinstance(join_as_spare, bool):
            raise ConfigurationError(f"join_as_spare must be True or False, got {join_as_spare!r}")
        self.join_as_spare = join_as_spare
        W_init = _check_setting("W_init", W_init, 1, "start at least one replica")
        G_init = _check_setting("G_init", G_init, 1, "set recover.grad_accum to a positive integer")
        if T is None:
            T = W_init
        T = _check_setting("T", T, 1, "set recover.target_replicas to at least 1 (or leave it unset)")
        if T > W_init:
            raise ConfigurationError(
                f"T (target contributing replicas) must be <= W_init={W_init}, got {T}; "
                f"lower recover.target_replicas or start more replicas"
            )
        min_replicas = self._check_min_replicas(min_replicas, W_init)
        super().__init__(W_init, G_init, T, min_replicas)
        self.G_cur = steady_quota(self.B, W_init, G_init)

    def _steady_membership(self, live: tuple[int, ...], joined: Collection[int]) -> Membership:
        B, G_init = self.B, self.G_init
        # Replicas that were live before the boundary come first: a join never demotes them,
        # and with join_as_spare they alone carry the joiners' first step.
        if joined:
            veterans = tuple(r for r in live if r not in joined)
            joiners = tuple(r for r in live if r in joined)
        else:
            veterans, joiners = live, ()
        carriers = len(veterans) if self.join_as_spare and veterans else len(live)
        G = steady_quota(B, carriers, G_init)
        n_major, R = divmod(B, G)
        # W_cur * G >= B guarantees a replica is left for the remainder.
        return Membership(B=B, G=G, veterans=veterans, joiners=joiners, n_major=n_major, minor=R > 0)

    def begin_step(self, step: int, alive: Collection[int]) -> StepPlan:
        self._open(step, alive)
        assert self._membership is not None
        self.G_cur = self._membership.G
        return self._plan()

    def fail(self, lost: Collection[int]) -> StepPlan:
        dead_slots = {r: self._slot(r) for r in self._lose(lost)}
        pool: list[int] = []
        for r, slot in dead_slots.items():
            if not slot.contributes:
                continue  # a spare's shadow work is never needed by the sum
            # Replays held by the dead replica were never covered by anyone else.
            pool.extend(slot.replay)
            heirs = self._shadows_of(r)
            if heirs:
                heir = heirs[0]
                self._changes[heir] = _Slot(slot.role, slot.base, True, None)
                for s in heirs[1:]:
                    self._slot(s).shadows = heir  # same ids, so their work stays valid
            else:
                pool.extend(slot.base)
        if pool:
            self._replay(sorted(pool))
        return self._plan()

    def _shadows_of(self, r: int) -> list[int]:
        """The live spares shadowing ``r``, sorted: O(spares per contributor), not O(W)."""
        m = self._membership
        assert m is not None
        found: set[int] = {s for s, slot in self._changes.items() if not slot.contributes and slot.shadows == r}
        i = m.position(r)
        if i is not None and i < m.n_contrib:
            # Its steady shadows sit every n_contrib positions after the contributors.
            for pos in range(m.n_contrib + i, m.n, m.n_contrib):
                s = m.replica_at(pos)
                if s not in self._changes:
                    found.add(s)
        return sorted(found - self._dead)

    def _replay(self, pool: list[int]) -> None:
        """Water-fill the lost ids over all survivors so replay counts differ by at most 1.

        Survivors keep what they already hold (their accumulators stay valid); because
        counts were balanced before, adding to the least loaded keeps them within
        {floor, ceil} of (total replayed / W_cur), which is the boundary step's G_ext.
        Among equals, contributors go first so spares keep shadowing as long as possible.

        The fill takes replicas level by level: at level c, every survivor holding at most c
        replays, contributors before spares, each by index. Only the few replicas a failure
        changed hold replays, so a level costs what it hands out, not O(W).
        """
        counts = {r: len(s.replay) for r, s in self._changes.items() if s.replay and r not in self._dead}
        W_cur = len(self._live)
        level = 0 if len(counts) < W_cur else min(counts.values())
        add: dict[int, int] = {}
        left = len(pool)
        while left:
            size = W_cur - sum(1 for c in counts.values() if c > level)
            take = min(left, size)
            for r in itertools.islice((r for r in self._fill_order() if counts.get(r, 0) <= level), take):
                add[r] = add.get(r, 0) + 1
            left -= take
            level += 1
        i = 0
        for r in sorted(add):
            k = add[r]
            slot = self._slot(r)
            if not slot.contributes:
                # A spare turned replayer drops its shadow: the caller discards that work.
                slot.role, slot.base, slot.contributes, slot.shadows = Role.MINOR, (), True, None
            slot.replay.extend(pool[i : i + k])
            i += k

    def _fill_order(self) -> Iterator[int]:
        """The survivors, contributors first, each group by replica index (the fill's tie order)."""
        m = self._membership
        assert m is not None
        changed_contrib = sorted(r for r, s in self._changes.items() if s.contributes and r not in self._dead)
        changed_spare = sorted(r for r, s in self._changes.items() if not s.contributes and r not in self._dead)
        steady_contrib = (r for r in m.contributors_sorted() if r not in self._changes and r not in self._dead)
        steady_spare = (r for r in m.spares_sorted() if r not in self._changes and r not in self._dead)
        yield from heapq.merge(steady_contrib, changed_contrib)
        yield from heapq.merge(steady_spare, changed_spare)

    def _plan(self) -> StepPlan:
        return self._step_plan(divisor=self.B, G_cur=self.G_cur)

    def commit(self) -> CommitRecord:
        step = self._require_open("commit")
        self._check_covered(step)
        replayed = sum(len(s.replay) for r, s in self._changes.items() if r not in self._dead)
        G_cur = steady_quota(self.B, len(self._live), self.G_init)
        record = self._record(((0, self.B),), self.B, replayed, G_cur)
        self.G_cur = G_cur
        return record

    def _check_covered(self, step: int) -> None:
        """The ids the step commits are 0..B-1 exactly once: its membership covers them, so
        what a failure took away (the changed and dead replicas' steady shares) must equal
        what it added (their shares now). O(changed), not O(B)."""
        m = self._membership
        assert m is not None
        removed: list[int] = []
        added: list[int] = []
        for r, slot in self._changes.items():
            steady = m.plan_of(r)
            if steady.contributes:
                removed.extend(steady.ids)
            if slot.contributes and r not in self._dead:
                added.extend(slot.base)
                added.extend(slot.replay)
        for r in self._dead - self._changes.keys():
            steady = m.plan_of(r)
            if steady.contributes:
                removed.extend(steady.ids)
        if sorted(removed) != sorted(added):
            # Unreachable by construction; refuse to apply a wrong sum if it ever happens.
            missing = sorted(set(removed) - set(added))
            twice = sorted(i for i, c in collections.Counter(added).items() if c > 1)
            raise PolicyError(
                f"step {step}: plan does not cover ids 0..{self.B - 1} exactly once "
                f"(missing {missing[:10]}, held twice {twice[:10]}); this is a bug in lightning_recover"
            )

    def _after_membership_change(self) -> None:
        self.G_cur = steady_quota(self.B, len(self._live), self.G_init)

    def state_dict(self) -> dict[str, Any]:
        d = self._common_state()
        d["G_cur"] = self.G_cur
        d["join_as_spare"] = self.join_as_spare
        return d

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        # A joiner must plan its first step as the survivors do.
        if d.get("join_as_spare", self.join_as_spare) != self.join_as_spare:
            raise ConfigurationError(
                f"policy state has join_as_spare={d['join_as_spare']!r} but this run has "
                f"join_as_spare={self.join_as_spare}; every replica, joiners included, must use the same setting"
            )
        self._load_common(d)
        # Derived, not trusted: the quota is a function of the live set.
        self.G_cur = steady_quota(self.B, len(self._live), self.G_init)
