"""StaticWorld: ReCoVer's constant-B workload policy, made exactly-once (layer 3).

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

import heapq
from collections.abc import Collection, Mapping
from typing import Any

from lightning_recover.config import ConfigurationError
from lightning_recover.workload.policy import WorkloadPolicy, _check_setting, _Slot
from lightning_recover.workload.step_plan import CommitRecord, PolicyError, Role, StepPlan, TooFewReplicasError

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

    def _steady_slots(self, live: list[int]) -> tuple[int, dict[int, _Slot]]:
        B, G_init = self.B, self.G_init
        # Replicas that were live before the boundary come first: a join never demotes them,
        # and with join_as_spare they alone carry the joiners' first step.
        veterans = [r for r in live if r not in self._joined]
        live = veterans + [r for r in live if r in self._joined]
        carriers = len(veterans) if self.join_as_spare and veterans else len(live)
        G = steady_quota(B, carriers, G_init)
        n_major, R = divmod(B, G)
        slots: dict[int, _Slot] = {}
        contributors: list[int] = []
        for i, r in enumerate(live[:n_major]):
            slots[r] = _Slot(Role.MAJOR, tuple(range(i * G, (i + 1) * G)), True, None)
            contributors.append(r)
        rest = live[n_major:]
        if R > 0:
            # W_cur * G >= B guarantees a replica is left for the remainder.
            minor, rest = rest[0], rest[1:]
            slots[minor] = _Slot(Role.MINOR, tuple(range(n_major * G, B)), True, None)
            contributors.append(minor)
        for j, r in enumerate(rest):
            # Round-robin, majors first: the most expensive losses get shadows first.
            target = contributors[j % len(contributors)]
            tslot = slots[target]
            role = Role.MAJOR_SPARE if tslot.role is Role.MAJOR else Role.MINOR_SPARE
            slots[r] = _Slot(role, tslot.base, False, target)
        return G, slots

    def begin_step(self, step: int, alive: Collection[int]) -> StepPlan:
        live = self._open(step, alive)
        self.G_cur, self._slots = self._steady_slots(live)
        return self._plan()

    def fail(self, lost: Collection[int]) -> StepPlan:
        newly, dead = self._lose(lost)
        pool: list[int] = []
        for r in newly:
            slot = dead[r]
            if not slot.contributes:
                continue  # a spare's shadow work is never needed by the sum
            # Replays held by the dead replica were never covered by anyone else.
            pool.extend(slot.replay)
            heirs = sorted(
                s for s, ss in self._slots.items() if not ss.contributes and ss.shadows == r
            )
            if heirs:
                heir = heirs[0]
                self._slots[heir] = _Slot(slot.role, slot.base, True, None)
                for s in heirs[1:]:
                    self._slots[s].shadows = heir  # same ids, so their work stays valid
            else:
                pool.extend(slot.base)
        if pool:
            self._replay(sorted(pool))
        return self._plan()

    def _replay(self, pool: list[int]) -> None:
        """Water-fill the lost ids over all survivors so replay counts differ by at most 1.

        Survivors keep what they already hold (their accumulators stay valid); because
        counts were balanced before, adding to the least loaded keeps them within
        {floor, ceil} of (total replayed / W_cur), which is the boundary step's G_ext.
        Among equals, contributors go first so spares keep shadowing as long as possible.
        """
        heap = [
            (len(s.replay), not s.contributes, r) for r, s in self._slots.items()
        ]
        heapq.heapify(heap)
        add = dict.fromkeys(self._slots, 0)
        for _ in pool:
            n, spare, r = heapq.heappop(heap)
            add[r] += 1
            heapq.heappush(heap, (n + 1, spare, r))
        i = 0
        for r in sorted(self._slots):
            k = add[r]
            if k == 0:
                continue
            slot = self._slots[r]
            if not slot.contributes:
                # A spare turned replayer drops its shadow: the caller discards that work.
                slot.role, slot.base, slot.contributes, slot.shadows = Role.MINOR, (), True, None
            slot.replay.extend(pool[i : i + k])
            i += k

    def _plan(self) -> StepPlan:
        assert self._step is not None
        replayed = tuple(sorted(i for s in self._slots.values() for i in s.replay))
        W_cur = len(self._slots)
        return StepPlan(
            step=self._step,
            B=self.B,
            plans=self._frozen_plans(),
            divisor=self.B,
            G_cur=self.G_cur,
            G_ext=-(-len(replayed) // W_cur) if replayed else 0,
            replayed=replayed,
        )

    def commit(self) -> CommitRecord:
        step = self._require_open("commit")
        plan = self._plan()
        ids = plan.committed_ids
        if ids != tuple(range(self.B)):
            # Unreachable by construction; refuse to apply a wrong sum if it ever happens.
            missing = sorted(set(range(self.B)) - set(ids))
            raise PolicyError(
                f"step {step}: plan does not cover ids 0..{self.B - 1} exactly once "
                f"(missing {missing[:10]}, {len(ids)} held); this is a bug in lightning_recover"
            )
        record = CommitRecord(
            step=step,
            B=self.B,
            committed=len(ids),
            microbatch_ids=tuple(step * self.B + i for i in ids),
            replicas=plan.live,
            roles={r: p.role.value for r, p in plan.plans.items()},
            faults=tuple(self._faults),
            extra_microbatches=len(plan.replayed),
            G_cur=steady_quota(self.B, len(self._live), self.G_init),
            joined=tuple(sorted(self._joined)),
        )
        self.G_cur = record.G_cur
        self._next_step = step + 1
        self._step = None
        self._slots = {}
        self._faults = []
        self._joined = set()
        return record

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
