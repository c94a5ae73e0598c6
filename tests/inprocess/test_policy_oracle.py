"""StaticWorld's O(1)-per-step plans equal the plain O(W) algorithm's, replica for replica.

The policy now plans from a :class:`~lightning_recover.workload.step_plan.Membership` built
once per membership change plus the few replicas a failure changed. Which replica computes
which id decides how the floating-point sums group, so the fast plans must be the very
plans of the straightforward algorithm (every replica's slot rebuilt each step, a heap over
every survivor for the replay), not merely valid ones. :class:`Oracle` is that algorithm,
written for clarity; hypothesis drives both through random failures, cascades and re-joins.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_recover.workload.static_world import StaticWorld, steady_quota
from lightning_recover.workload.step_plan import Role, StepPlan


@dataclass
class Slot:
    role: Role
    base: tuple[int, ...]
    contributes: bool
    shadows: int | None
    replay: list[int] = field(default_factory=list)

    def view(self) -> tuple[str, tuple[int, ...], bool, int | None, tuple[int, ...]]:
        return (self.role.value, tuple(sorted((*self.base, *self.replay))), self.contributes, self.shadows, tuple(sorted(self.replay)))


class Oracle:
    """The reference: every replica's slot as a dict, rebuilt each step (O(W) per step)."""

    def __init__(self, W: int, G_init: int, T: int, join_as_spare: bool) -> None:
        self.B, self.G_init, self.join_as_spare = T * G_init, G_init, join_as_spare
        self.live: list[int] = list(range(W))
        self.joined: set[int] = set()
        self.slots: dict[int, Slot] = {}

    def begin(self, alive: list[int]) -> None:
        self.live = sorted(alive)
        veterans = [r for r in self.live if r not in self.joined]
        order = veterans + [r for r in self.live if r in self.joined]
        carriers = len(veterans) if self.join_as_spare and veterans else len(order)
        G = steady_quota(self.B, carriers, self.G_init)
        n_major, R = divmod(self.B, G)
        self.slots, contributors = {}, []
        for i, r in enumerate(order[:n_major]):
            self.slots[r] = Slot(Role.MAJOR, tuple(range(i * G, (i + 1) * G)), True, None)
            contributors.append(r)
        rest = order[n_major:]
        if R:
            self.slots[rest[0]] = Slot(Role.MINOR, tuple(range(n_major * G, self.B)), True, None)
            contributors.append(rest[0])
            rest = rest[1:]
        for j, r in enumerate(rest):
            target = self.slots[contributors[j % len(contributors)]]
            role = Role.MAJOR_SPARE if target.role is Role.MAJOR else Role.MINOR_SPARE
            self.slots[r] = Slot(role, target.base, False, contributors[j % len(contributors)])

    def fail(self, lost: list[int]) -> None:
        newly = sorted(set(lost) & set(self.slots))
        dead = {r: self.slots.pop(r) for r in newly}
        self.live = [r for r in self.live if r not in dead]
        pool: list[int] = []
        for r in newly:
            slot = dead[r]
            if not slot.contributes:
                continue
            pool.extend(slot.replay)
            heirs = sorted(s for s, ss in self.slots.items() if not ss.contributes and ss.shadows == r)
            if heirs:
                self.slots[heirs[0]] = Slot(slot.role, slot.base, True, None)
                for s in heirs[1:]:
                    self.slots[s].shadows = heirs[0]
            else:
                pool.extend(slot.base)
        if not pool:
            return
        pool.sort()
        heap = [(len(s.replay), not s.contributes, r) for r, s in self.slots.items()]
        heapq.heapify(heap)
        add = dict.fromkeys(self.slots, 0)
        for _ in pool:
            n, spare, r = heapq.heappop(heap)
            add[r] += 1
            heapq.heappush(heap, (n + 1, spare, r))
        i = 0
        for r in sorted(self.slots):
            if add[r]:
                slot = self.slots[r]
                if not slot.contributes:
                    slot.role, slot.base, slot.contributes, slot.shadows = Role.MINOR, (), True, None
                slot.replay.extend(pool[i : i + add[r]])
                i += add[r]

    def commit(self) -> None:
        self.joined = set()

    def join(self, replicas: list[int]) -> None:
        self.live = sorted(set(self.live) | set(replicas))
        self.joined |= set(replicas)


def same(plan: StepPlan, oracle: Oracle) -> None:
    got = {r: (p.role.value, p.ids, p.contributes, p.shadows, p.extra) for r, p in plan.plans.items()}
    assert got == {r: s.view() for r, s in oracle.slots.items()}
    assert plan.shadowing() == {r: s.shadows for r, s in oracle.slots.items() if not s.contributes}


@settings(max_examples=400, deadline=None)
@given(
    W=st.integers(1, 24),
    G_init=st.integers(1, 4),
    spares=st.integers(0, 8),
    join_as_spare=st.booleans(),
    data=st.data(),
)
def test_fast_plans_are_the_reference_plans(W: int, G_init: int, spares: int, join_as_spare: bool, data: st.DataObject) -> None:
    T = max(1, W - spares)
    policy, oracle = StaticWorld(W, G_init, T=T, join_as_spare=join_as_spare), Oracle(W, G_init, T, join_as_spare)
    live = list(range(W))
    # The caller passes the communicator's tuple: the same object while nothing changes.
    alive: tuple[int, ...] = tuple(live)
    for step in range(data.draw(st.integers(1, 8))):
        plan = policy.begin_step(step, alive)
        oracle.begin(list(alive))
        same(plan, oracle)
        for _ in range(data.draw(st.integers(0, 3))):
            left = list(plan.plans)
            if len(left) < 2:
                break
            lost = data.draw(st.lists(st.sampled_from(left), min_size=1, max_size=len(left) - 1, unique=True))
            plan = policy.fail(lost)
            oracle.fail(lost)
            same(plan, oracle)
        rec = policy.commit()
        oracle.commit()
        assert rec.replicas == plan.live and rec.microbatch_ids == tuple(range(step * policy.B, (step + 1) * policy.B))
        live = list(rec.replicas)
        gone = sorted(set(range(W)) - set(live))
        if gone and data.draw(st.booleans()):
            back = data.draw(st.lists(st.sampled_from(gone), min_size=1, unique=True))
            policy.join(back)
            oracle.join(back)
            live = sorted(set(live) | set(back))
        if tuple(live) != alive:
            alive = tuple(live)


def test_a_steady_step_reuses_its_membership() -> None:
    """The same live tuple again: no re-plan, the plan shares the step before's membership."""
    policy = StaticWorld(4096, 8, T=4000)
    alive = tuple(range(4096))
    first = policy.begin_step(0, alive)
    policy.commit()
    second = policy.begin_step(1, alive)
    assert second.membership is first.membership
    rec = policy.commit()
    assert rec.membership_since == 0 and not rec.defines and rec.id_ranges == ((8 * 4000, 2 * 8 * 4000),)
