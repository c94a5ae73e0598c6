"""Hot re-join on FakeWorld: replacements merge at a step boundary and the step engine takes them back.

Each simulated rank runs the real :class:`StepEngine`, the real policies and the real
recovery callbacks on a :class:`FakeWorld`; lost replicas are replaced with
``FakeWorld.spawn`` and merged by the survivors at a step boundary, and a replacement
receives the leader's live state (the policy's state and a parameter vector) in the merge.
Gradients are integer-valued float64 tensors derived from ``(step, microbatch, shard)``
and every rank applies ``params -= grad``, so a missing or doubled microbatch, or a joiner
that got the wrong state, shows in the bits. After every run :func:`check_run` asserts:
every step commits ids 0..B-1 exactly once (static policy) with the same record on every
rank of every committing replica, joiners included; the gradients and the parameters equal
the fault-free run's bit for bit; the leader is the lowest live rank; the records' ``joined``
and ``joins`` agree; and the leader's ledger passes ``check_ledger`` against a fault-free
reference ledger.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_recover.audit.ledger_check import check_ledger
from lightning_recover.audit.ledger_writer import LedgerWriter
from lightning_recover.callbacks import BoundaryScheduler, EpochCheck, ReductionBuffers
from lightning_recover.comm.interface import PeerFailure
from lightning_recover.recovery.engine import StepEngine
from lightning_recover.recovery.hooks import HookCalls, RecoveryHooks
from lightning_recover.recovery.state import Join
from lightning_recover.testing.fake import FakeComm, FakeWorld
from lightning_recover.testing.fake_faults import Kill
from lightning_recover.workload.factory import make_policy
from lightning_recover.workload.policy import WorkloadPolicy

# The same simulated gradients and losses as the step-engine suite (test_engine.py), so the two compare.
from harness.engine_steps import BUCKET_NUMEL, SIZES, TIMEOUT_S, FullRecords, grad_of, loss_of


@dataclass(frozen=True)
class Spawn:
    """Replace lost ``replica`` in step ``step``: ``"after"`` it commits, or ``"during"`` it (in the
    survivors' first microbatch; the replacement is ready mid-step). Either way the survivors
    merge it at the boundary after ``step``: it takes part from step ``step + 1``."""

    replica: int
    step: int
    when: str = "after"


@dataclass(frozen=True)
class Scenario:
    replicas: int
    G: int = 2
    T: int | None = None
    shards: int = 1
    policy: str = "static"
    steps: int = 6
    kills: tuple[Kill, ...] = ()
    #: ``(rank, life, step, n)``: that incarnation of the rank dies computing its n-th microbatch of ``step``.
    crashes: tuple[tuple[int, int, int, int], ...] = ()
    spawns: tuple[Spawn, ...] = ()
    #: A world collective between steps (a death there is seen between steps).
    between: bool = False
    join_as_spare: bool = True

    @property
    def B(self) -> int:
        return (self.T or self.replicas) * self.G


@dataclass
class Committed:
    step: int
    record: dict[str, Any]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    led: bool


@dataclass
class RankLog:
    rank: int
    life: int
    commits: list[Committed] = field(default_factory=list)
    #: Resolves this rank's compact records to the full form the checks read.
    full: FullRecords = field(default_factory=FullRecords)
    #: (next_step, joined replicas) per on_replicas_joined
    joined_hook: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)


class JoinObserver(RecoveryHooks):
    def __init__(self, log: RankLog) -> None:
        self.log = log

    def on_replicas_joined(self, trainer: Any, pl_module: Any, joins: tuple[Join, ...], next_step: int) -> None:
        self.log.joined_hook.append((next_step, tuple(j.replica for j in joins)))


class Runner:
    def __init__(self, comm: FakeComm, job: Job) -> None:
        self.comm, self.sc, self.world, self.job = comm, job.sc, job.world, job
        self.grads = [torch.zeros(n, dtype=torch.float64) for n in SIZES]
        self.engine: StepEngine | None = None
        self.step, self.ran = -1, 0

    def start(self, engine: StepEngine, step: int) -> None:
        self.engine, self.step, self.ran = engine, step, 0
        for g in self.grads:
            g.zero_()

    def run_microbatch(self, offset: int) -> None:
        assert self.engine is not None
        self.ran += 1
        if (self.comm.rank, self.comm.life, self.step, self.ran) in self.sc.crashes:
            self.comm.die(f"fault injection in microbatch {offset} of step {self.step}")
        if self.ran == 1:
            for sp in self.sc.spawns:
                if sp.when == "during" and sp.step == self.step:
                    self.job.spawn(sp)
                    # The replacement is ready while this step is still open: it must wait for the boundary.
                    deadline = time.monotonic() + TIMEOUT_S
                    while sp.replica not in self.world.joining:
                        assert time.monotonic() < deadline, f"replacement of {sp.replica} never became ready"
                        time.sleep(0.005)
        for g, d in zip(self.grads, grad_of(self.step, offset, self.comm.shard)):
            g.add_(d)
        self.engine.record(offset, loss_of(self.step, offset))

    def local_grads(self) -> list[torch.Tensor]:
        return self.grads


@dataclass
class Job:
    """The simulated job: every incarnation of every rank logs here."""

    sc: Scenario
    world: FakeWorld
    logs: dict[tuple[int, int], RankLog] = field(default_factory=dict)

    def spawn(self, sp: Spawn) -> None:
        # Every survivor asks; the request makes it one replacement (a quick death must not be re-spawned).
        self.world.spawn(sp.replica, partial(joiner, job=self), request=sp)

    def new_policy(self) -> WorkloadPolicy:
        sc = self.sc
        if sc.policy == "static":
            return make_policy("static", sc.replicas, sc.G, T=sc.T, join_as_spare=sc.join_as_spare)
        return make_policy(sc.policy, sc.replicas, sc.G)


def original(comm: FakeComm, job: Job) -> RankLog:
    params = [torch.zeros(n, dtype=torch.float64) for n in SIZES]
    return run_steps(comm, job, job.new_policy(), params, admitted=())


def joiner(comm: FakeComm, job: Job) -> RankLog:
    """A replacement: wait for a merge, load the leader's state, take part from the next step."""
    adm = comm.join()
    policy = job.new_policy()
    policy.load_state_dict(adm.payload["policy"])
    params = [p.clone() for p in adm.payload["params"]]
    return run_steps(comm, job, policy, params, admitted=adm.joined)


def run_steps(comm: FakeComm, job: Job, policy: WorkloadPolicy, params: list[torch.Tensor], admitted: tuple[int, ...]) -> RankLog:
    sc = job.sc
    log = job.logs[(comm.rank, comm.life)] = RankLog(comm.rank, comm.life)
    callbacks: list[object] = [ReductionBuffers(), EpochCheck(), BoundaryScheduler(), JoinObserver(log)]
    engine = StepEngine(comm, policy, shards=sc.shards, hooks=HookCalls(lambda: callbacks))
    if admitted:
        engine.admit(admitted)  # the joiner applies the same join as the survivors, to the state it received
    runner = Runner(comm, job)
    for step in range(policy.next_step, sc.steps):
        state = engine.begin(step)
        runner.start(engine, step)
        engine.run(runner, state.mine.ids)
        engine.reduce_until_committed(runner)
        grads = [g.clone() for g in runner.grads]
        for p, g in zip(params, grads):
            p.sub_(g)
        record = engine.finish()
        log.commits.append(Committed(step, log.full(record), grads, [p.clone() for p in params], comm.is_leader))
        if sc.between:
            one, out = torch.ones(1, dtype=torch.float64), torch.empty(1, dtype=torch.float64)
            engine.run_collective(lambda: comm.allreduce([one], [out], across="world"))
        # The boundary: spawn what is due, then merge whatever is ready.
        due = [sp.replica for sp in sc.spawns if sp.step == step]
        for sp in sc.spawns:
            if sp.step == step and sp.when == "after":
                job.spawn(sp)
        payload = {"policy": policy.state_dict(), "params": params}
        while True:
            try:
                merged = comm.merge(payload, wait_for=due)
                break
            except PeerFailure:
                engine.repaired(comm.repair())
        if merged.joined:
            engine.admit([Join(p, transfer_s=0.0, pause_s=merged.seconds) for p in merged.joined])
    return log


@dataclass
class Outcome:
    sc: Scenario
    world: FakeWorld
    job: Job

    def committers(self, step: int) -> dict[tuple[int, int], Committed]:
        return {k: c for k, log in self.job.logs.items() for c in log.commits if c.step == step}

    def record(self, step: int) -> dict[str, Any]:
        return next(iter(self.committers(step).values())).record

    def final(self) -> dict[int, RankLog]:
        """The logs of the ranks alive at the end (the current incarnation of each)."""
        return {r: self.job.logs[(r, self.world.comm(r).life)] for r in range(self.world.world_size) if r not in self.world.dead}


def simulate(sc: Scenario) -> Outcome:
    world = FakeWorld(sc.replicas, sc.shards, BUCKET_NUMEL, kills=sc.kills, timeout=TIMEOUT_S)
    job = Job(sc, world)
    world.run(partial(original, job=job))
    return Outcome(sc, world, job)


_SHARED = (
    "step", "B", "committed", "microbatch_ids", "replicas", "roles", "faults",
    "extra_microbatches", "G_cur", "loss", "world_epoch", "policy", "divisor", "joined",
)  # fmt: skip


def reference_params(sc: Scenario, shard: int) -> list[list[torch.Tensor]]:
    """The fault-free run's parameters after each step (static policy: every id, every step)."""
    params = [torch.zeros(n, dtype=torch.float64) for n in SIZES]
    out = []
    for s in range(sc.steps):
        total = [sum(t) for t in zip(*(grad_of(s, m, shard) for m in range(sc.B)))]
        for p, t in zip(params, total):
            p.sub_(t.clone().div_(sc.B * sc.shards))
        out.append([p.clone() for p in params])
    return out


def check_run(out: Outcome, tmp_path: Path | None = None) -> None:
    sc, layout = out.sc, out.world.layout
    refs = {k: reference_params(sc, k) for k in range(sc.shards)}
    leader_lines = []
    for s in range(sc.steps):
        committers = out.committers(s)
        assert committers, f"step {s}: nobody committed"
        rec = next(iter(committers.values())).record
        for key, c in committers.items():
            assert {k: c.record[k] for k in _SHARED} == {k: rec[k] for k in _SHARED}, f"step {s}: {key} disagrees"
        # Every rank of every committing replica committed (one incarnation each), nobody else.
        ranks = sorted(r for r, _ in committers)
        assert ranks == sorted(r for p in rec["replicas"] for r in layout.ranks_of_replica(p)), (s, ranks, rec["replicas"])
        ids = [i - s * sc.B for i in rec["microbatch_ids"]]
        if sc.policy == "static":
            assert ids == list(range(sc.B)) and rec["divisor"] == sc.B == rec["B"]
        else:
            assert ids == sorted(p * sc.G + j for p in rec["replicas"] for j in range(sc.G))
            assert rec["divisor"] == len(rec["replicas"]) * sc.G == rec["committed"]
        assert rec["loss"] == sum(loss_of(s, m) for m in ids) / len(ids)
        for (r, life), c in committers.items():
            want = [sum(t) / (rec["divisor"] * sc.shards) for t in zip(*(grad_of(s, m, layout.shard_of(r)) for m in ids))]
            assert all(torch.equal(g, w) for g, w in zip(c.grads, want)), f"step {s}: rank {r}.{life} holds a wrong gradient"
            if sc.policy == "static":
                ref = refs[layout.shard_of(r)][s]
                assert all(torch.equal(p, q) for p, q in zip(c.params, ref)), f"step {s}: rank {r}.{life} left the fault-free trajectory"
            assert [j["replica"] for j in c.record["joins"]] == rec["joined"]
        leaders = [key for key, c in committers.items() if c.led]
        assert [r for r, _ in leaders] == [layout.rank_of(min(rec["replicas"]), 0)], (s, leaders)
        leader_lines.append(committers[leaders[0]].record)
        # A replica joins only where it was not live, or where its previous incarnation's loss is recorded too.
        if s > 0:
            prev = out.record(s - 1)
            for p in rec["joined"]:
                assert p not in prev["replicas"] or p in rec["faults"], (s, p)
    # The joiners of a step heard of their admission through the hook, as did everyone else live then.
    for log in out.job.logs.values():
        for next_step, joined in log.joined_hook:
            assert list(joined) == out.record(next_step)["joined"]
    if tmp_path is not None:
        with LedgerWriter(tmp_path / "ledger.jsonl") as w:
            for line in leader_lines:
                w.write(line)
        ref = simulate(Scenario(sc.replicas, sc.G, sc.T, sc.shards, sc.policy, sc.steps))
        with LedgerWriter(tmp_path / "reference.jsonl") as w:
            for s in range(sc.steps):
                w.write(ref.record(s))
        verdict = check_ledger(tmp_path / "ledger.jsonl", reference=tmp_path / "reference.jsonl" if sc.policy == "static" else None)
        assert verdict.ok, verdict.problems


def by_step(out: Outcome, key: str) -> list[Any]:
    return [out.record(s)[key] for s in range(out.sc.steps)]


# ---------------------------------------------------------------------- scenarios
def test_two_replicas_lost_at_different_steps_both_come_back(tmp_path: Path) -> None:
    # W=4, G=2 (B=8). Replica 1 dies in the reduce of step 1, replica 3 computing step 3;
    # replica 1's replacement joins after step 2, replica 3's after step 4.
    sc = Scenario(
        replicas=4, steps=7, kills=(Kill(1, "bucket", call=2, bucket=1),), crashes=((3, 0, 3, 1),),
        spawns=(Spawn(1, 2), Spawn(3, 4)),
    )  # fmt: skip
    out = simulate(sc)
    check_run(out, tmp_path)
    assert by_step(out, "faults") == [[], [1], [], [3], [], [], []]
    assert by_step(out, "joined") == [[], [], [], [1], [], [3], []]
    assert by_step(out, "replicas") == [[0, 1, 2, 3], [0, 2, 3], [0, 2, 3], [0, 1, 2], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3]]
    # G_cur (the quota for the live set at commit) rises with each loss and falls as replicas return.
    assert by_step(out, "G_cur") == [2, 3, 3, 3, 3, 2, 2]
    # A joiner's first step: a spare, the replicas already live carry B as before; then it contributes.
    assert out.record(3)["roles"]["1"] == "major_spare" and out.record(4)["roles"]["1"] == "major"
    assert out.record(5)["roles"]["3"] == "major_spare" and out.record(6)["roles"] == {str(p): "major" for p in range(4)}
    # Two repairs and two merges, each one world epoch.
    assert by_step(out, "world_epoch") == [0, 1, 1, 3, 3, 4, 4]
    assert sorted(out.final()) == [0, 1, 2, 3] and [out.world.comm(r).life for r in range(4)] == [0, 1, 0, 1]
    # The survivors measured each join's pause; the joiner's own entry has none.
    joins = {key: c.record["joins"] for key, c in out.committers(3).items()}
    assert joins.pop((1, 1)) == [{"replica": 1, "transfer_s": None, "pause_s": None, "ok": True}]
    assert sorted(joins) == [(0, 0), (2, 0)] and all(j[0]["replica"] == 1 and j[0]["pause_s"] >= 0 for j in joins.values())


@pytest.mark.parametrize("join_as_spare", [True, False])
def test_a_joiner_killed_right_after_joining(join_as_spare: bool, tmp_path: Path) -> None:
    # W=3. Replica 2 dies in step 0, its replacement joins after step 1 and dies in its first
    # microbatch of step 2; a second replacement joins after step 3.
    sc = Scenario(
        replicas=3, steps=5, crashes=((2, 0, 0, 1), (2, 1, 2, 1)), spawns=(Spawn(2, 1), Spawn(2, 3)),
        join_as_spare=join_as_spare,
    )  # fmt: skip
    out = simulate(sc)
    check_run(out, tmp_path)
    assert by_step(out, "faults") == [[2], [], [2], [], []]
    assert by_step(out, "joined") == [[], [], [2], [], [2]]
    assert [d.life for d in out.world.deaths] == [0, 1] and out.world.comm(2).life == 2
    # As a spare its death costs nothing; as a contributor its ids are replayed.
    assert out.record(2)["extra_microbatches"] == (0 if join_as_spare else 2)
    assert out.record(4)["replicas"] == [0, 1, 2]


def test_a_join_during_a_boundary_step_waits_for_the_boundary(tmp_path: Path) -> None:
    # W=4. Replica 1 dies in step 0. In step 2 its replacement is ready from the first
    # microbatch on, and replica 3 dies computing: a boundary step. The replacement is
    # admitted only after step 2 commits.
    sc = Scenario(replicas=4, steps=4, crashes=((1, 0, 0, 1), (3, 0, 2, 2)), spawns=(Spawn(1, 2, "during"),))
    out = simulate(sc)
    check_run(out, tmp_path)
    assert by_step(out, "faults") == [[1], [], [3], []]
    assert by_step(out, "joined") == [[], [], [], [1]]
    assert out.record(2)["replicas"] == [0, 2] and out.record(2)["extra_microbatches"] > 0
    assert out.record(3)["replicas"] == [0, 1, 2]


def test_admit_refuses_a_join_inside_a_step() -> None:
    world = FakeWorld(2, bucket_numel=BUCKET_NUMEL)
    engine = StepEngine(world.comm(0), make_policy("static", 2, 1))
    engine.begin(0)
    with pytest.raises(RuntimeError, match=r"admit\(\) during step 0: replicas join at a step boundary"):
        engine.admit([1])
    engine.abandon()
    with pytest.raises(ValueError, match=r"already live"):
        make_policy("static", 2, 1).join([1])
    with pytest.raises(ValueError, match=r"note_join\(\): replica 1 was not admitted"):
        engine.note_join(1, transfer_s=1.0)


def test_a_loss_between_steps_is_replaced_at_the_same_boundary(tmp_path: Path) -> None:
    # Rank 2 dies in the collective after step 1 (its 4th world allreduce: a loss reduction
    # and a between-steps collective per step); its replacement is merged at that boundary.
    sc = Scenario(replicas=3, steps=4, between=True, kills=(Kill(2, "world", call=4),), spawns=(Spawn(2, 1),))
    out = simulate(sc)
    check_run(out, tmp_path)
    assert by_step(out, "faults") == [[], [], [2], []]
    assert by_step(out, "joined") == [[], [], [2], []]
    assert by_step(out, "replicas") == [[0, 1, 2]] * 4
    assert by_step(out, "world_epoch") == [0, 0, 2, 2]  # the repair, then the merge


def test_deaths_around_the_merge(tmp_path: Path) -> None:
    # W=4. Replica 3 dies in step 0. Its first replacement dies starting up (entering join);
    # the leader dies entering the merge after step 1, so the survivors repair and merge
    # again: the second replacement of 3 (spawned after step 2) joins with nobody else.
    sc = Scenario(
        replicas=4, steps=5, crashes=((3, 0, 0, 1),),
        kills=(Kill(3, "join", life=1), Kill(0, "merge", call=2)),
        spawns=(Spawn(3, 1), Spawn(3, 2)),
    )  # fmt: skip
    out = simulate(sc)
    check_run(out, tmp_path)
    assert not out.world.unfired
    assert by_step(out, "faults") == [[3], [], [0], [], []]
    assert by_step(out, "joined") == [[], [], [], [3], []]
    assert out.record(4)["replicas"] == [1, 2, 3] and out.world.comm(3).life == 2


def test_shards_a_replica_of_two_ranks_rejoins(tmp_path: Path) -> None:
    sc = Scenario(replicas=3, shards=2, steps=4, kills=(Kill(3, "bucket", bucket=1),), spawns=(Spawn(1, 1),))
    out = simulate(sc)
    check_run(out, tmp_path)
    assert by_step(out, "joined") == [[], [], [1], []]
    assert sorted(out.final()) == list(range(6)) and out.world.comm(2).life == out.world.comm(3).life == 1


def test_adaptive_batch_grows_back(tmp_path: Path) -> None:
    sc = Scenario(replicas=3, policy="adaptive", steps=4, crashes=((1, 0, 0, 1),), spawns=(Spawn(1, 1),))
    out = simulate(sc)
    check_run(out, tmp_path)
    assert by_step(out, "committed") == [4, 4, 6, 6] and by_step(out, "B") == [6] * 4
    assert by_step(out, "joined") == [[], [], [1], []]


# ---------------------------------------------------------------------- random schedules
@st.composite
def rejoin_scenarios(draw: Any) -> Scenario:
    W = draw(st.integers(2, 4))
    policy = draw(st.sampled_from(["static", "static", "adaptive"]))
    T = None if policy == "adaptive" else draw(st.integers(1, W))
    steps = draw(st.integers(2, 5))
    crashes: list[tuple[int, int, int, int]] = []
    spawns: list[Spawn] = []
    # At most W - 1 replicas die at first, so one always carries on; each may come back.
    for p in draw(st.lists(st.integers(0, W - 1), unique=True, min_size=1, max_size=W - 1)):
        died = draw(st.integers(0, steps - 1))
        crashes.append((p, 0, died, 1))  # every live replica computes at least one microbatch
        if died + 1 < steps and draw(st.booleans()):
            back = draw(st.integers(died, steps - 2))
            when = "during" if back > died and draw(st.booleans()) else "after"
            spawns.append(Spawn(p, back, when))
            if back + 1 < steps and draw(st.booleans()):
                crashes.append((p, 1, back + 1, 1))  # the joiner dies in its first step
    return Scenario(
        replicas=W, G=draw(st.integers(1, 2)), T=T, policy=policy, steps=steps, crashes=tuple(crashes),
        spawns=tuple(spawns), between=draw(st.booleans()), join_as_spare=draw(st.booleans()),
    )  # fmt: skip


@settings(max_examples=30, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(rejoin_scenarios())
def test_random_failures_and_rejoins_keep_the_invariants(sc: Scenario) -> None:
    out = simulate(sc)
    check_run(out)
    # Every replacement whose step came was admitted at the boundary after it.
    for sp in sc.spawns:
        assert sp.replica in out.record(sp.step + 1)["joined"], (sp, out.record(sp.step + 1))
    assert out.final(), "no rank finished"
