"""Property and example tests of the versatile workload policies (lightning_recover.workload: policy, static_world, adaptive_world)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lightning_recover.audit.ledger import microbatch_ids, resolve
from lightning_recover.config import ConfigurationError
from lightning_recover.workload.adaptive_world import AdaptiveWorld
from lightning_recover.workload.factory import make_policy
from lightning_recover.workload.static_world import StaticWorld, steady_quota
from lightning_recover.workload.step_plan import CommitRecord, PolicyError, ReplicaNotLiveError, Role, StepPlan, TooFewReplicasError

# ---------------------------------------------------------------------------------------
# invariant checks shared by the property tests


def base_ids(p) -> set[int]:
    return set(p.ids) - set(p.extra)


def check_exactly_once(plan: StepPlan) -> None:
    assert plan.committed_ids == tuple(range(plan.B))
    seen: set[int] = set()
    for p in plan.plans.values():
        if p.contributes:
            assert not (seen & set(p.ids)), "an id is held by two contributors"
            seen |= set(p.ids)
    assert plan.divisor == plan.B


def check_roles(plan: StepPlan) -> None:
    for r, p in plan.plans.items():
        assert p.replica == r
        assert list(p.ids) == sorted(set(p.ids)), "ids must be sorted and unique"
        assert all(0 <= i < plan.B for i in p.ids)
        if p.contributes:
            assert p.role in (Role.MAJOR, Role.MINOR) and p.shadows is None
        else:
            assert p.role.is_spare and p.extra == ()
            target = plan.plans[p.shadows]  # shadows a live replica
            assert target.contributes
            assert set(p.ids) == base_ids(target), "a spare must hold its target's own ids"
            want = Role.MAJOR_SPARE if target.role is Role.MAJOR else Role.MINOR_SPARE
            assert p.role is want


def check_boundary(plan: StepPlan) -> None:
    W = len(plan.plans)
    L = len(plan.replayed)
    assert plan.replayed == tuple(sorted(i for p in plan.plans.values() for i in p.extra))
    assert plan.G_ext == math.ceil(L / W)
    counts = [len(p.extra) for p in plan.plans.values()]
    # As even as possible over ALL survivors: every one holds floor or ceil of L / W.
    assert min(counts) == L // W
    assert max(counts) == plan.G_ext


def check_steady(plan: StepPlan, G_init: int) -> None:
    B, W, G = plan.B, len(plan.plans), plan.G_cur
    assert plan.G_ext == 0 and plan.replayed == ()
    assert W * G >= B and G >= G_init
    assert G == G_init or W * (G - 1) < B, "G_cur must be minimal"
    assert G == steady_quota(B, W, G_init)
    contributors = [plan.plans[r] for r in plan.contributors]
    assert sum(len(p.ids) for p in contributors) == B
    majors = [p for p in contributors if p.role is Role.MAJOR]
    minors = [p for p in contributors if p.role is Role.MINOR]
    assert len(majors) == B // G and all(len(p.ids) == G for p in majors)
    assert len(minors) == (1 if B % G else 0)
    assert all(0 < len(p.ids) < G for p in minors)
    # Majors are the lowest live indices, with consecutive blocks.
    live = sorted(plan.plans)
    assert [p.replica for p in majors] == live[: len(majors)]
    for k, p in enumerate(majors):
        assert p.ids == tuple(range(k * G, (k + 1) * G))


# ---------------------------------------------------------------------------------------
# a caller simulator: it drives a policy the way the strategy does and checks invariants


@dataclass
class Run:
    policy: StaticWorld
    twin: StaticWorld  # fed the same events, must agree (determinism)
    acc: dict[int, set[int]] = field(default_factory=dict)  # caller-side accumulators
    plan: StepPlan | None = None
    stepped_with_replay: bool = False
    absorbed_only: bool = True

    def begin(self, step: int, alive: list[int]) -> None:
        self.plan = self.policy.begin_step(step, alive)
        assert self.twin.begin_step(step, alive) == self.plan
        check_exactly_once(self.plan)
        check_roles(self.plan)
        check_steady(self.plan, self.policy.G_init)
        self.acc = {r: set(p.ids) for r, p in self.plan.plans.items()}
        self.stepped_with_replay = False

    def fail(self, lost: list[int]) -> None:
        old = self.plan
        assert old is not None
        newly = [r for r in set(lost) if r in old.plans]
        survivors = [r for r in old.plans if r not in lost]
        new = self.policy.fail(lost)
        assert self.twin.fail(lost) == new
        # Labels for --hypothesis-show-statistics: the interesting paths must be reached.
        for r in newly:
            event(f"lost a {old.plans[r].role.value}")
        if old.replayed and len(new.replayed) > len(old.replayed):
            event("cascade within a boundary step")
        if any(not old.plans[r].contributes and new.plans[r].extra for r in survivors):
            event("spare turned replayer")
        if any(
            not old.plans[r].contributes and new.plans[r].contributes and not new.plans[r].extra
            for r in survivors
        ):
            event("spare promoted")
        assert sorted(new.plans) == sorted(survivors)
        check_exactly_once(new)
        check_roles(new)
        check_boundary(new)
        # Only a non-contributing spare may be told to drop ids it accumulated.
        for r in survivors:
            have, want = self.acc[r], set(new.plans[r].ids)
            if not have <= want:
                assert not old.plans[r].contributes, f"contributor {r} would lose work"
                have = set()
            self.acc[r] = have | want
        # A loss absorbed entirely by live shadows costs no extra microbatches.
        absorbed = all(
            not old.plans[r].contributes
            or (
                old.plans[r].extra == ()
                and any(
                    s in survivors and not old.plans[s].contributes and old.plans[s].shadows == r
                    for s in old.plans
                )
            )
            for r in newly
        )
        if absorbed:
            assert new.replayed == old.replayed
            for r in survivors:
                assert new.plans[r].extra == old.plans[r].extra
        if new.replayed:
            self.stepped_with_replay = True
        self.plan = new

    def commit(self) -> CommitRecord:
        plan = self.plan
        assert plan is not None
        rec = self.policy.commit()
        assert self.twin.commit() == rec
        B = self.policy.B
        assert rec.B == B and rec.committed == B
        assert rec.microbatch_ids == tuple(range(rec.step * B, rec.step * B + B))
        assert rec.replicas == plan.live
        assert rec.extra_microbatches == len(plan.replayed)
        if not self.stepped_with_replay:
            assert rec.extra_microbatches == 0
        assert rec.G_cur == steady_quota(B, len(plan.plans), self.policy.G_init)
        # Contributors' accumulators together hold each id once.
        held = sorted(i for r in plan.contributors for i in self.acc[r])
        assert held == list(range(B))
        return rec


def pick_victims(data, plan: StepPlan) -> list[int]:
    """Choose replicas to kill, biased towards the interesting ones (spares, the minor)."""
    live = sorted(plan.plans)
    kind = data.draw(
        st.sampled_from(["random", "spare", "minor", "shadowed", "unshadowed", "all"])
    )
    by_kind = {
        "spare": [r for r in live if not plan.plans[r].contributes],
        "minor": [r for r in live if plan.plans[r].role is Role.MINOR],
        "shadowed": [
            r for r in live if any(p.shadows == r for p in plan.plans.values())
        ],
        "unshadowed": [
            r
            for r in live
            if plan.plans[r].contributes and not any(p.shadows == r for p in plan.plans.values())
        ],
        "all": live,
    }
    if kind != "random" and by_kind[kind]:
        pool = by_kind[kind]
        if kind == "all":
            return pool
        return data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
    return data.draw(
        st.lists(st.sampled_from(live), min_size=1, max_size=min(4, len(live)), unique=True)
    )


@st.composite
def configs(draw) -> tuple[int, int, int, int]:
    W = draw(st.integers(1, 64))
    T = draw(st.integers(1, W))
    G = draw(st.integers(1, 16))
    m = draw(st.sampled_from([1, 1, 1, max(1, W // 3)]))
    return W, T, G, m


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), data=st.data())
def test_static_world_exactly_once_under_random_failures(cfg, data):
    W_init, T, G_init, min_rep = cfg
    pol = StaticWorld(W_init, G_init, T=T, min_replicas=min_rep)
    run = Run(pol, StaticWorld(W_init, G_init, T=T, min_replicas=min_rep))
    assert pol.B == T * G_init
    live = list(range(W_init))
    step = 0
    for _ in range(data.draw(st.integers(1, 6))):
        # Failures found between steps shrink `alive` before begin_step.
        between: list[int] = []
        if len(live) > 1 and data.draw(st.booleans()):
            between = data.draw(
                st.lists(st.sampled_from(live), min_size=1, max_size=len(live) - 1, unique=True)
            )
        alive = [r for r in live if r not in between]
        if len(alive) < min_rep:
            with pytest.raises(TooFewReplicasError):
                pol.begin_step(step, alive)
            return
        run.begin(step, alive)
        # Several fail() calls in one step: cascades through boundary steps.
        for _ in range(data.draw(st.integers(0, 3))):
            lost = pick_victims(data, run.plan)
            # A repeated report of an already dead replica must be harmless.
            if data.draw(st.booleans()) and between:
                lost = lost + between[:1]
            left = [r for r in run.plan.plans if r not in lost]
            if len(left) < max(1, min_rep):
                with pytest.raises(TooFewReplicasError) as err:
                    pol.fail(lost)
                assert str(len(left)) in str(err.value)
                return
            run.fail(lost)
        rec = run.commit()
        assert set(rec.faults) == set(alive) - set(rec.replicas) | set(between)
        live = list(rec.replicas)
        # A checkpoint between steps resumes into an identical policy.
        state = json.loads(json.dumps(pol.state_dict()))
        fresh = StaticWorld(W_init, G_init, T=T, min_replicas=min_rep)
        fresh.load_state_dict(state)
        run.twin = fresh
        step += data.draw(st.integers(1, 2))


@settings(max_examples=150, deadline=None)
@given(cfg=configs(), data=st.data())
def test_shadow_absorbed_failures_cost_nothing(cfg, data):
    W_init, T, G_init, _ = cfg
    pol = StaticWorld(W_init, G_init, T=T)
    plan = pol.begin_step(0, range(W_init))
    spares = [r for r in plan.live if not plan.plans[r].contributes]
    # Kill contributors one by one while each still has a spare behind it.
    for _ in range(data.draw(st.integers(1, 4))):
        shadowed = sorted({p.shadows for p in plan.plans.values() if p.shadows is not None})
        if not shadowed:
            break
        victim = data.draw(st.sampled_from(shadowed))
        heir = min(r for r, p in plan.plans.items() if p.shadows == victim)
        new = pol.fail([victim])
        assert new.G_ext == 0 and new.replayed == ()
        assert new.plans[heir].contributes and new.plans[heir].ids == plan.plans[victim].ids
        assert new.plans[heir].role is plan.plans[victim].role
        check_exactly_once(new)
        check_roles(new)
        plan = new
    rec = pol.commit()
    assert rec.extra_microbatches == 0 and rec.committed == pol.B
    # Every loss cost one spare, never a contributor slot.
    assert len(plan.contributors) == W_init - len(spares) and len(rec.faults) <= len(spares)


# ---------------------------------------------------------------------------------------
# worked examples


def test_paper_worked_case_64_replicas_down_to_32():
    pol = StaticWorld(W_init=64, G_init=128)
    assert pol.B == 8192 and pol.G_cur == 128
    live = list(range(64))
    step = 0
    while len(live) > 32:
        for _ in range(5):
            plan = pol.begin_step(step, live)
            if step % 5 == 4:
                victim = live[(step * 7) % len(live)]
                W_cur = len(live) - 1
                lost_ids = len(plan.plans[victim].ids)
                plan = pol.fail([victim])
                assert plan.G_ext == math.ceil(lost_ids / W_cur)
                check_boundary(plan)
            check_exactly_once(plan)
            rec = pol.commit()
            assert rec.B == 8192 and rec.committed == 8192
            assert rec.microbatch_ids == tuple(range(step * 8192, (step + 1) * 8192))
            live = list(rec.replicas)
            step += 1
    assert len(live) == 32
    assert pol.G_cur == 256 and rec.G_cur == 256
    plan = pol.begin_step(step, live)
    assert all(p.role is Role.MAJOR and len(p.ids) == 256 for p in plan.plans.values())


def test_first_boundary_of_paper_case():
    pol = StaticWorld(64, 128)
    pol.begin_step(0, range(64))
    plan = pol.fail([10])
    assert plan.G_ext == 3  # ceil(128 / 63)
    assert len(plan.replayed) == 128
    rec = pol.commit()
    assert rec.extra_microbatches == 128 and rec.faults == (10,)
    assert rec.G_cur == 131  # ceil(8192 / 63)
    plan = pol.begin_step(1, rec.replicas)
    assert plan.G_cur == 131
    assert [len(plan.plans[r].ids) for r in plan.contributors].count(131) == 62
    minor = [p for p in plan.plans.values() if p.role is Role.MINOR]
    assert len(minor) == 1 and len(minor[0].ids) == 8192 - 62 * 131


def test_spares_shadow_round_robin_and_promotion():
    pol = StaticWorld(W_init=7, G_init=2, T=3)  # B=6, 3 majors, 4 spares
    plan = pol.begin_step(0, range(7))
    assert [plan.plans[r].role for r in range(3)] == [Role.MAJOR] * 3
    assert [plan.plans[r].shadows for r in range(3, 7)] == [0, 1, 2, 0]
    assert all(plan.plans[r].role is Role.MAJOR_SPARE for r in range(3, 7))
    plan = pol.fail([0])
    assert plan.plans[3].contributes and plan.plans[3].ids == (0, 1)
    assert plan.plans[6].shadows == 3  # the second shadow now backs the heir
    plan = pol.fail([3])
    assert plan.plans[6].contributes and plan.plans[6].ids == (0, 1)
    rec = pol.commit()
    assert rec.extra_microbatches == 0 and rec.faults == (0, 3)
    assert rec.roles == {1: "major", 2: "major", 4: "major_spare", 5: "major_spare", 6: "major"}


def test_spare_receiving_replay_stops_shadowing():
    pol = StaticWorld(W_init=5, G_init=4, T=4)  # B=16, 4 majors + 1 spare behind replica 0
    pol.begin_step(0, range(5))
    plan = pol.fail([2])  # 4 lost ids over 4 survivors: everyone, the spare included
    assert plan.G_ext == 1
    spare = plan.plans[4]
    assert spare.contributes and spare.role is Role.MINOR and spare.shadows is None
    assert spare.ids == spare.extra and len(spare.ids) == 1
    plan = pol.fail([0])  # no shadow left for 0: its 4 ids and its replay go round again
    check_exactly_once(plan)
    check_boundary(plan)
    assert plan.G_ext == math.ceil(8 / 3)


def test_cascade_returns_original_and_extra_ids():
    pol = StaticWorld(W_init=4, G_init=5)  # B=20, no spares
    pol.begin_step(0, range(4))
    p1 = pol.fail([0])
    assert p1.G_ext == 2 and len(p1.replayed) == 5
    had = set(p1.plans[1].ids)
    p2 = pol.fail([1])  # replica 1 held 5 own ids + 2 replayed ones
    assert len(p2.replayed) == 10 and p2.G_ext == 5
    assert had <= set(p2.replayed) | set(p2.plans[2].ids) | set(p2.plans[3].ids)
    for r in (2, 3):
        assert set(p1.plans[r].ids) <= set(p2.plans[r].ids)
    rec = pol.commit()
    assert rec.extra_microbatches == 10 and rec.G_cur == 10 and rec.faults == (0, 1)


def test_minor_loss_is_replayed():
    pol = StaticWorld(W_init=8, G_init=4)  # B=32
    pol.begin_step(0, range(8))
    pol.fail([7])
    pol.commit()
    plan = pol.begin_step(1, range(7))  # G_cur=5: 6 majors + minor with 2
    assert plan.G_cur == 5 and plan.plans[6].role is Role.MINOR and len(plan.plans[6].ids) == 2
    plan = pol.fail([6])
    assert plan.G_ext == 1 and len(plan.replayed) == 2
    check_exactly_once(plan)


def test_between_step_failures_are_faults_of_the_next_step():
    pol = StaticWorld(W_init=4, G_init=2)
    pol.begin_step(0, range(4))
    pol.commit()
    plan = pol.begin_step(1, [0, 2, 3])
    assert plan.G_cur == 3 and plan.G_ext == 0
    rec = pol.commit()
    assert rec.faults == (1,) and rec.extra_microbatches == 0


def test_rebegin_uncommitted_step_keeps_its_faults():
    pol = StaticWorld(W_init=4, G_init=2)
    pol.begin_step(0, range(4))
    pol.fail([3])
    plan = pol.begin_step(0, [0, 1, 2])  # the attempt was aborted; the step re-runs
    assert plan.G_ext == 0 and plan.G_cur == 3
    assert pol.commit().faults == (3,)


def test_fail_is_idempotent_for_dead_replicas():
    pol = StaticWorld(W_init=4, G_init=2)
    pol.begin_step(0, range(4))
    a = pol.fail([1])
    assert pol.fail([1]) == a
    assert pol.fail([]) == a


def test_too_few_replicas():
    pol = StaticWorld(W_init=3, G_init=2, min_replicas=2)
    pol.begin_step(0, range(3))
    with pytest.raises(TooFewReplicasError, match=r"only 1 replica.*min_replicas=2"):
        pol.fail([0, 1])
    pol = StaticWorld(W_init=2, G_init=2)
    pol.begin_step(0, range(2))
    with pytest.raises(TooFewReplicasError, match="0 left"):
        pol.fail([0, 1])
    with pytest.raises(TooFewReplicasError):
        StaticWorld(W_init=2, G_init=1).begin_step(0, [])
    assert issubclass(TooFewReplicasError, PolicyError)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(W_init=0, G_init=1), "W_init must be >= 1, got 0"),
        (dict(W_init=2, G_init=0), "G_init must be >= 1, got 0"),
        (dict(W_init=2, G_init=1, T=3), "T .* must be <= W_init=2, got 3"),
        (dict(W_init=2, G_init=1, T=0), "T must be >= 1, got 0"),
        (dict(W_init=2, G_init=1, min_replicas=3), "min_replicas must be <= W_init=2, got 3"),
        (dict(W_init=2, G_init=1, min_replicas=0), "min_replicas must be >= 1, got 0"),
        (dict(W_init=2, G_init=1.5), "G_init must be an integer"),
    ],
)
def test_bad_constructor_args(kwargs, match):
    # Bad settings raise the one configuration error type (a ValueError).
    with pytest.raises(ConfigurationError, match=match):
        StaticWorld(**kwargs)
    assert issubclass(ConfigurationError, ValueError)


def test_protocol_misuse_errors():
    pol = StaticWorld(W_init=3, G_init=2)
    with pytest.raises(PolicyError, match="begin_step"):
        pol.fail([0])
    with pytest.raises(PolicyError, match="begin_step"):
        pol.commit()
    plan = pol.begin_step(0, range(3))
    with pytest.raises(ReplicaNotLiveError, match="replica 5 is not live") as err:
        plan.for_replica(5)
    assert isinstance(err.value, KeyError)
    with pytest.raises(ValueError, match=r"replica index 9 is not in 0\.\.2") as misuse:
        pol.fail([9])
    assert not isinstance(misuse.value, ConfigurationError), "protocol misuse is not a settings error"
    pol.fail([2])
    pol.commit()
    with pytest.raises(ValueError, match="re-join") as misuse:
        pol.begin_step(1, range(3))
    assert not isinstance(misuse.value, ConfigurationError)
    with pytest.raises(ValueError, match="already committed"):
        pol.begin_step(0, [0, 1])


def test_state_dict_round_trip_and_mismatch():
    pol = StaticWorld(W_init=6, G_init=3, T=5)
    pol.begin_step(0, range(6))
    pol.fail([1, 4])
    pol.commit()
    state = json.loads(json.dumps(pol.state_dict()))
    other = StaticWorld(W_init=6, G_init=3, T=5)
    other.load_state_dict(state)
    assert other.live == (0, 2, 3, 5) and other.G_cur == pol.G_cur and other.next_step == 1
    assert other.begin_step(1, other.live) == pol.begin_step(1, pol.live)
    # A checkpoint of other settings: the fix is a setting, so it is a configuration error.
    with pytest.raises(ConfigurationError, match="T=5 but this run has T=6"):
        StaticWorld(W_init=6, G_init=3).load_state_dict(state)
    with pytest.raises(ConfigurationError, match="'static', not 'adaptive'"):
        AdaptiveWorld(6, 3).load_state_dict(state)


def test_make_policy():
    assert isinstance(make_policy("static", 4, 2), StaticWorld)
    assert make_policy("static", 4, 2, T=3).B == 6
    assert isinstance(make_policy("adaptive", 4, 2), AdaptiveWorld)
    with pytest.raises(ConfigurationError, match=r"unknown policy 'elastic'.*static, adaptive"):
        make_policy("elastic", 4, 2)
    with pytest.raises(ConfigurationError, match="T must equal W_init"):
        make_policy("adaptive", 4, 2, T=3)


def test_commit_record_as_dict_is_json_ready():
    pol = StaticWorld(W_init=3, G_init=1)
    pol.begin_step(2, range(3))
    pol.fail([1])
    d = pol.commit().as_dict()
    assert json.loads(json.dumps(d)) == d
    # Compact: the ids as one range, the membership on this first line, the loss as `died`.
    assert d["ids"] == [[6, 9]] and d["membership"] == 2 and d["died"] == [1] and d["faults"] == [1]
    full = next(resolve([d]))
    assert microbatch_ids(d) == [6, 7, 8] and full["roles"] == {"0": "major", "2": "major"} and full["replicas"] == [0, 2]
    # The next steady line refers to its own membership (a new live set) and stays small.
    pol.begin_step(3, (0, 2))
    pol.commit()
    d4 = pol.begin_step(4, (0, 2)) and pol.commit().as_dict()
    assert d4["membership"] == 3 and "members" not in d4 and "role_changes" not in d4


# ---------------------------------------------------------------------------------------
# AdaptiveWorld


def test_adaptive_world_drops_lost_ids():
    pol = AdaptiveWorld(W_init=4, G_init=3)
    assert pol.B == 12
    plan = pol.begin_step(0, range(4))
    assert plan.divisor == 12 and plan.plans[2].ids == (6, 7, 8)
    plan = pol.fail([2])
    assert plan.divisor == 9 and plan.committed_ids == (0, 1, 2, 3, 4, 5, 9, 10, 11)
    assert plan.G_ext == 0 and all(p.role is Role.MAJOR for p in plan.plans.values())
    rec = pol.commit()
    assert rec.committed == 9 < rec.B == 12 and rec.extra_microbatches == 0
    assert rec.microbatch_ids == (0, 1, 2, 3, 4, 5, 9, 10, 11)
    plan = pol.begin_step(1, [0, 3])
    assert plan.divisor == 6 and plan.committed_ids == (0, 1, 2, 9, 10, 11)
    rec = pol.commit()
    assert rec.committed == 6 and rec.microbatch_ids[0] == 12 and rec.faults == (1,)


@settings(max_examples=60, deadline=None)
@given(W=st.integers(1, 64), G=st.integers(1, 16), data=st.data())
def test_adaptive_divisor_is_committed(W, G, data):
    pol = AdaptiveWorld(W, G)
    plan = pol.begin_step(0, range(W))
    if W > 1:
        lost = data.draw(st.lists(st.integers(0, W - 1), max_size=W - 1, unique=True))
        plan = pol.fail(lost)
    rec = pol.commit()
    assert plan.divisor == rec.committed == len(plan.live) * G
    assert rec.committed <= pol.B
    for r in plan.live:
        assert plan.plans[r].ids == tuple(range(r * G, (r + 1) * G))


# ---------------------------------------------------------------------------------------
# hot re-join (reverse role adjustment)


def test_rejoin_reverse_role_adjustment():
    pol = StaticWorld(W_init=4, G_init=2, T=3)  # B=6: three majors and a spare
    plan = pol.begin_step(0, range(4))
    assert plan.plans[3].role is Role.MAJOR_SPARE and plan.plans[3].shadows == 0
    pol.fail([0, 1])  # 3 takes over 0's ids, 1's are replayed
    rec = pol.commit()
    assert rec.replicas == (2, 3) and rec.G_cur == 3 and rec.joined == ()
    assert pol.join([1]) == (1, 2, 3) and pol.joining == (1,) and pol.G_cur == 2
    plan = pol.begin_step(1, pol.live)
    # The joiner's first step: a spare; the replicas already live carry B as before.
    assert plan.G_cur == 3 and plan.contributors == (2, 3)
    assert plan.plans[1].role is Role.MAJOR_SPARE and plan.plans[1].shadows == 2
    check_exactly_once(plan)
    check_roles(plan)
    rec = pol.commit()
    assert rec.joined == (1,) and rec.faults == () and rec.G_cur == 2 and rec.as_dict()["joined"] == [1]
    plan = pol.begin_step(2, pol.live)  # then it contributes: G_cur back to G_init
    assert plan.G_cur == 2 and plan.contributors == (1, 2, 3)
    assert pol.commit().joined == ()
    pol.join([0])  # more than T live: the extra replica is a spare again
    plan = pol.begin_step(3, pol.live)
    assert plan.contributors == (1, 2, 3) and plan.plans[0].role is Role.MAJOR_SPARE
    pol.commit()
    plan = pol.begin_step(4, pol.live)
    assert plan.contributors == (0, 1, 2) and plan.plans[3].role is Role.MAJOR_SPARE and plan.G_cur == 2


def test_rejoin_without_probation_contributes_at_once():
    pol = StaticWorld(W_init=3, G_init=2, join_as_spare=False)  # B=6
    pol.begin_step(0, range(3))
    pol.fail([0])
    pol.commit()
    pol.join([0])
    plan = pol.begin_step(1, pol.live)
    assert plan.G_cur == 2 and plan.contributors == (0, 1, 2)
    # Ordered after the replicas already live: the joiner has the last block.
    assert plan.plans[0].ids == (4, 5) and plan.plans[1].ids == (0, 1)
    check_exactly_once(plan)
    plan = pol.fail([0])  # its loss in its first step is replayed
    assert len(plan.replayed) == 2
    rec = pol.commit()
    assert rec.joined == (0,) and rec.faults == (0,) and rec.extra_microbatches == 2


def test_join_replaces_a_loss_seen_between_steps():
    pol = StaticWorld(W_init=3, G_init=2)
    pol.begin_step(0, range(3))
    pol.commit()
    # Replica 1 died in a collective between steps; its replacement joins at the same boundary.
    with pytest.raises(ValueError, match=r"replica\(s\) \[1\] are already live.*pass it in lost="):
        pol.join([1])
    assert pol.join([1], lost=[1]) == (0, 1, 2)
    plan = pol.begin_step(1, [0, 1, 2])
    assert not plan.plans[1].contributes
    rec = pol.commit()
    assert rec.faults == (1,) and rec.joined == (1,) and rec.replicas == (0, 1, 2)
    # A joiner that dies before its first step begins is recorded as joined and lost.
    pol.begin_step(2, [0, 2])
    pol.commit()
    pol.join([1])
    rec = (pol.begin_step(3, [0, 2]), pol.commit())[1]
    assert rec.joined == (1,) and rec.faults == (1,) and rec.replicas == (0, 2)


def test_join_misuse():
    pol = StaticWorld(W_init=3, G_init=2)
    pol.begin_step(0, range(3))
    with pytest.raises(PolicyError, match=r"join\(\) called while step 0 is open.*after commit\(\)"):
        pol.join([1])
    pol.fail([2])
    pol.commit()
    with pytest.raises(ValueError, match=r"join\(\): replica index 3 is not in 0\.\.2"):
        pol.join([3])
    assert pol.join([]) == (0, 1) and pol.joining == ()
    pol = StaticWorld(W_init=3, G_init=2, min_replicas=2)
    pol.begin_step(0, range(3))
    pol.fail([2])
    pol.commit()
    with pytest.raises(TooFewReplicasError, match="min_replicas=2"):
        pol.join([2], lost=[0, 1])
    with pytest.raises(ConfigurationError, match="join_as_spare must be True or False"):
        StaticWorld(3, 2, join_as_spare="yes")  # type: ignore[arg-type]


def test_state_dict_carries_pending_joins():
    pol = StaticWorld(W_init=4, G_init=2)
    pol.begin_step(0, range(4))
    pol.fail([1, 3])
    pol.commit()
    before = json.loads(json.dumps(pol.state_dict()))
    pol.join([1, 3], lost=[2])
    after = json.loads(json.dumps(pol.state_dict()))
    assert after["joined"] == [1, 3] and after["lost"] == [2] and after["live"] == [0, 1, 3]
    # A joiner given the state before the join applies it too; one given it after does not: same plans.
    a = StaticWorld(W_init=4, G_init=2)
    a.load_state_dict(before)
    a.join([1, 3], lost=[2])
    b = StaticWorld(W_init=4, G_init=2)
    b.load_state_dict(after)
    assert a.G_cur == b.G_cur == pol.G_cur == 3
    want = pol.begin_step(1, [0, 1, 3])
    assert a.begin_step(1, [0, 1, 3]) == b.begin_step(1, [0, 1, 3]) == want
    assert a.commit() == b.commit() == pol.commit()
    # Every replica must plan a joiner's first step alike.
    with pytest.raises(ConfigurationError, match="join_as_spare=True but this run has join_as_spare=False"):
        StaticWorld(W_init=4, G_init=2, join_as_spare=False).load_state_dict(after)
    # A checkpoint from before re-join existed has no pending events.
    old = {k: v for k, v in before.items() if k not in ("joined", "lost", "join_as_spare")}
    c = StaticWorld(W_init=4, G_init=2)
    c.load_state_dict(old)
    assert c.joining == () and c.live == (0, 2)


def test_adaptive_batch_grows_back_on_rejoin():
    pol = AdaptiveWorld(W_init=3, G_init=2)
    pol.begin_step(0, range(3))
    pol.fail([1])
    assert pol.commit().committed == 4
    pol.join([1])
    plan = pol.begin_step(1, pol.live)
    assert plan.plans[1].ids == (2, 3) and plan.plans[1].contributes and plan.divisor == 6
    rec = pol.commit()
    assert rec.committed == 6 and rec.joined == (1,) and rec.microbatch_ids == tuple(range(6, 12))
    assert make_policy("adaptive", 3, 2, join_as_spare=False).name == "adaptive"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), join_as_spare=st.booleans(), data=st.data())
def test_random_failures_and_rejoins_keep_B_and_exactly_once(cfg, join_as_spare, data):
    W_init, T, G_init, min_rep = cfg

    def make() -> StaticWorld:
        return StaticWorld(W_init, G_init, T=T, min_replicas=min_rep, join_as_spare=join_as_spare)

    pol = make()
    twins = [make()]  # fed the same events; joiners' copies are added at each join
    B = pol.B
    lost: set[int] = set()
    step = 0
    for _ in range(data.draw(st.integers(1, 8))):
        # The boundary: lost replicas come back; a live one may be lost between steps and replaced at once.
        live = list(pol.live)
        joiners = data.draw(st.lists(st.sampled_from(sorted(lost)), unique=True)) if lost else []
        replaced: list[int] = []
        if len(live) > 1 and data.draw(st.booleans()):
            replaced = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live) - 1, unique=True))
        if joiners or replaced:
            event("join")
            before = json.loads(json.dumps(pol.state_dict()))
            for p in [pol, *twins]:
                p.join(joiners + replaced, lost=replaced)
            sent_before, sent_after = make(), make()
            sent_before.load_state_dict(before)
            sent_before.join(joiners + replaced, lost=replaced)
            sent_after.load_state_dict(json.loads(json.dumps(pol.state_dict())))
            twins = [twins[0], sent_before, sent_after]
        between: list[int] = []
        if len(pol.live) > 1 and data.draw(st.booleans()):
            between = data.draw(st.lists(st.sampled_from(pol.live), min_size=1, max_size=len(pol.live) - 1, unique=True))
        alive = [r for r in pol.live if r not in between]
        if len(alive) < min_rep:
            with pytest.raises(TooFewReplicasError):
                pol.begin_step(step, alive)
            return
        fresh = set(pol.joining)
        plan = pol.begin_step(step, alive)
        assert all(t.begin_step(step, alive) == plan for t in twins)
        check_exactly_once(plan)
        check_roles(plan)
        veterans = [r for r in plan.plans if r not in fresh]
        carriers = len(veterans) if join_as_spare and veterans else len(plan.plans)
        assert plan.G_cur == steady_quota(B, carriers, G_init) and plan.replayed == ()
        if join_as_spare and veterans:
            assert not any(plan.plans[r].contributes for r in fresh & set(plan.plans)), "a joiner contributes in its first step"
            if fresh & set(plan.plans):
                event("joiner starts as a spare")
        died: set[int] = set()
        for _ in range(data.draw(st.integers(0, 2))):
            victims = pick_victims(data, plan)
            if len([r for r in plan.plans if r not in victims]) < max(1, min_rep):
                with pytest.raises(TooFewReplicasError):
                    pol.fail(victims)
                return
            if fresh & set(victims):
                event("joiner lost in its first step")
            died |= set(victims) & set(plan.plans)
            plan = pol.fail(victims)
            assert all(t.fail(victims) == plan for t in twins)
            check_exactly_once(plan)
            check_roles(plan)
            check_boundary(plan)
        rec = pol.commit()
        assert all(t.commit() == rec for t in twins)
        assert rec.B == B == rec.committed and rec.microbatch_ids == tuple(range(step * B, step * B + B))
        assert set(rec.joined) == set(joiners) | set(replaced)
        assert set(rec.faults) == set(replaced) | set(between) | died
        assert rec.G_cur == steady_quota(B, len(rec.replicas), G_init)
        if len(rec.replicas) == W_init:
            event("every replica back")
            assert rec.G_cur == G_init
        lost = set(range(W_init)) - set(rec.replicas)
        step += 1
    # Everyone comes back: after the joiners' first step G_cur is G_init again, with T contributors.
    pol.join(sorted(lost))
    pol.begin_step(step, pol.live)
    assert pol.commit().G_cur == G_init
    plan = pol.begin_step(step + 1, pol.live)
    assert plan.G_cur == G_init and plan.live == tuple(range(W_init))
    assert plan.contributors == tuple(range(T)) and all(len(plan.plans[r].ids) == G_init for r in plan.contributors)
