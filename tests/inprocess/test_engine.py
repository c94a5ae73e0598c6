"""The step engine on FakeWorld: every failure point of the recovery protocol, in seconds.

Each simulated rank runs the real :class:`StepEngine` with the real policies and the real
recovery callbacks (ReductionBuffers, EpochCheck, BoundaryScheduler, called with
``trainer=None``) on a :class:`FakeWorld`. Gradients of step-local microbatch ``m`` are
integer-valued float64 tensors derived from ``(step, m, shard)``, so every sum is exact
and a missing or doubled microbatch shows in the bits. After every run the invariants of
the protocol are checked (:func:`check_protocol`): every rank of every committing replica
holds the same gradient, equal to the sum of exactly the committed ids over the divisor;
the ledger records agree; each lost replica is reported once with its world epoch; the
stale-bucket counts match the buckets observed; the leader is the lowest live rank.

These complement the MPI tests in test_strategy_mpi.py / test_communicator_mpi.py, which
run the same protocol over ULFM in real processes.
"""

from __future__ import annotations

import time

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_recover.callbacks import BoundaryScheduler, EpochCheck, RecoveryCallback, ReductionBuffers
from lightning_recover.comm.interface import RepairResult
from lightning_recover.recovery.engine import Probes, StepEngine
from lightning_recover.recovery.hooks import HookCalls, StepCollectives
from lightning_recover.recovery.state import StepState
from lightning_recover.testing.fake import FakeComm, FakeWorld
from lightning_recover.testing.fake_faults import Died, Kill
from lightning_recover.workload.factory import make_policy
from lightning_recover.workload.step_plan import TooFewReplicasError

# The simulated gradients and losses, shared with test_engine_join.py so the two suites compare.
from harness.engine_steps import BUCKET_NUMEL, SIZES, TIMEOUT_S, FullRecords, grad_of, loss_of

#: With BUCKET_NUMEL=2 the two gradient tensors of SIZES make NB=4 buckets, one of them shared.
NB = 4


# ---------------------------------------------------------------------- the simulated job
@dataclass(frozen=True)
class Scenario:
    replicas: int
    G: int = 2
    T: int | None = None
    shards: int = 1
    policy: str = "static"
    steps: int = 1
    kills: tuple[Kill, ...] = ()
    #: ``(rank, step, n)``: the rank dies in its own code while computing its n-th microbatch of ``step``.
    crashes: tuple[tuple[int, int, int], ...] = ()
    #: A world collective between steps (like a checkpoint barrier), run through ``run_collective``.
    between: bool = False
    #: A world collective inside the step, in the first microbatch (like ``self.log(..., sync_dist=True)``).
    sync_in_step: bool = False
    min_replicas: int = 1
    #: Overlap the first reduction round with the last planned microbatch (its "backward"
    #: makes the gradient tensors final one by one, last tensor first).
    overlap: bool = False

    @property
    def B(self) -> int:
        return (self.T or self.replicas) * self.G


@dataclass
class Committed:
    step: int
    record: dict[str, Any]
    grads: list[torch.Tensor]
    ran: list[int]  # the microbatch offsets this rank computed in the step, in order
    alive: tuple[int, ...]
    led: bool  # this rank was the leader (it would write the ledger line)


@dataclass
class RankLog:
    """What one simulated rank saw; kept even when the rank dies later."""

    commits: list[Committed] = field(default_factory=list)
    #: Resolves this rank's compact records to the full form the checks read.
    full: FullRecords = field(default_factory=FullRecords)
    #: ("start", step, bucket) | ("bucket", step, bucket, world_epoch)
    #: | ("repair", step | None, commits so far, RepairResult, in the in-step sync)
    events: list[tuple[Any, ...]] = field(default_factory=list)
    in_sync: bool = False
    #: What a test's runner noted (kept out of ``events``, whose kinds the invariants read).
    notes: list[tuple[Any, ...]] = field(default_factory=list)

    def repairs(self) -> list[RepairResult]:
        return [e[3] for e in self.events if e[0] == "repair"]


class Observer(RecoveryCallback):
    """A user's recovery callback: records what the hooks report."""

    def __init__(self, log: RankLog) -> None:
        self.log = log

    def on_bucket_reduced(self, trainer: Any, pl_module: Any, step: StepState, index: int, world_epoch: int) -> None:
        self.log.events.append(("bucket", step.step, index, world_epoch))

    def on_world_repaired(self, trainer: Any, pl_module: Any, repair: RepairResult, step: StepState | None) -> None:
        self.log.events.append(("repair", None if step is None else step.step, len(self.log.commits), repair, self.log.in_sync))


class RecordingProbes(Probes):
    """Sees each bucket start (the point where fault injection strikes in production)."""

    def __init__(self, log: RankLog) -> None:
        self.log = log

    def fault_point(self, phase: str, *, step: int, microbatch: int | None = None, bucket: int | None = None) -> None:
        assert phase == "reduce", phase
        self.log.events.append(("start", step, bucket))


class Runner:
    """The strategy's part: computes microbatch gradients into the accumulator."""

    def __init__(self, comm: FakeComm, sc: Scenario, log: RankLog) -> None:
        self.comm, self.sc, self.log = comm, sc, log
        self.grads = [torch.zeros(n, dtype=torch.float64) for n in SIZES]
        self.engine: StepEngine | None = None
        self.step = -1
        self.ran: list[int] = []
        #: The last planned microbatch, whose backward overlaps the reduction (None: none left).
        self.final: int | None = None

    def start(self, engine: StepEngine, step: int) -> None:
        self.engine, self.step, self.ran = engine, step, []
        for g in self.grads:
            g.zero_()

    def run_microbatch(self, offset: int) -> None:
        assert self.engine is not None
        self.ran.append(offset)
        if (self.comm.rank, self.step, len(self.ran)) in self.sc.crashes:
            self.comm.die(f"fault injection in microbatch {offset} of step {self.step}")
        self.engine.record(offset, loss_of(self.step, offset))
        self._forward_sync()
        # "Backward": the last parameters' gradients are made first.
        inflight = self.engine.start_overlap(self) if offset == self.final else None
        grads = grad_of(self.step, offset, self.comm.shard)
        for i in reversed(range(len(self.grads))):
            self.grads[i].add_(grads[i])
            if inflight is not None:
                self.engine.gradient_ready(i, self.grads[i])
        if inflight is not None:
            inflight.all_ready()

    def _forward_sync(self) -> None:
        if self.sc.sync_in_step and len(self.ran) == 1:
            # Once per step on every rank (each replica runs at least one planned microbatch):
            # a world collective per microbatch would not be SPMD, replicas run different counts.
            one, out = torch.ones(1, dtype=torch.float64), torch.empty(1, dtype=torch.float64)
            comm = self.comm
            self.log.in_sync = True
            self.engine.run_collective(lambda: comm.allreduce([one], [out], across="world"))
            self.log.in_sync = False

    def local_grads(self) -> list[torch.Tensor]:
        return self.grads


def train(comm: FakeComm, sc: Scenario, logs: dict[int, RankLog], runner_cls: type[Runner] = Runner) -> RankLog:
    """One simulated rank's training loop, as the strategy drives the engine."""
    log = logs[comm.rank] = RankLog()
    policy = make_policy(sc.policy, sc.replicas, sc.G, T=sc.T, min_replicas=sc.min_replicas)
    callbacks: list[object] = [ReductionBuffers(), EpochCheck(), BoundaryScheduler(), Observer(log)]
    engine = StepEngine(
        comm, policy, shards=sc.shards, hooks=HookCalls(lambda: callbacks), probes=RecordingProbes(log), overlap=sc.overlap
    )
    runner = runner_cls(comm, sc, log)
    for step in range(sc.steps):
        state = engine.begin(step)
        runner.start(engine, step)
        planned = state.mine.ids
        runner.final = planned[-1]
        engine.run(runner, planned)
        runner.final = None
        engine.reduce_until_committed(runner)
        grads = [g.clone() for g in runner.grads]
        alive = comm.alive_replicas
        record = engine.finish()
        log.commits.append(Committed(step, log.full(record), grads, list(runner.ran), alive, comm.is_leader))
        if sc.between:
            one, out = torch.ones(1, dtype=torch.float64), torch.empty(1, dtype=torch.float64)
            engine.run_collective(lambda: comm.allreduce([one], [out], across="world"))
    return log


@dataclass
class Outcome:
    sc: Scenario
    world: FakeWorld
    results: dict[int, RankLog | Died]
    logs: dict[int, RankLog]

    @property
    def dead(self) -> dict[int, Died]:
        return {r: v for r, v in self.results.items() if isinstance(v, Died)}

    @property
    def survivors(self) -> list[int]:
        return [r for r, v in self.results.items() if isinstance(v, RankLog)]

    def records(self, step: int) -> list[dict[str, Any]]:
        return [log.commits[step].record for log in self.logs.values() if len(log.commits) > step]

    def record(self, step: int) -> dict[str, Any]:
        return self.records(step)[0]

    def repairs(self) -> list[tuple[int, tuple[int, ...], int]]:
        """(world epoch, lost replicas, rounds) of every repair, as the first survivor saw them."""
        return [(r.world_epoch, r.lost_replicas, r.rounds) for r in self.logs[self.survivors[0]].repairs()]


def simulate(sc: Scenario, *, raise_errors: bool = True, runner_cls: type[Runner] = Runner) -> Outcome:
    world = FakeWorld(sc.replicas, sc.shards, BUCKET_NUMEL, kills=sc.kills, timeout=TIMEOUT_S)
    logs: dict[int, RankLog] = {}
    results = world.run(partial(train, sc=sc, logs=logs, runner_cls=runner_cls), raise_errors=raise_errors)
    return Outcome(sc, world, results, logs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the invariants
_SHARED_FIELDS = (
    "step", "B", "committed", "microbatch_ids", "replicas", "roles", "faults",
    "extra_microbatches", "G_cur", "loss", "world_epoch", "policy", "divisor",
)  # fmt: skip


def check_protocol(out: Outcome) -> None:
    """Assert the recovery protocol's invariants on a finished simulation."""
    sc, layout = out.sc, out.world.layout
    dead_replicas = {layout.replica_of(r) for r in out.dead}
    # Replicas go whole: a rank is dead exactly when its replica is.
    for r in range(layout.world_size):
        assert (r in out.dead) == (layout.replica_of(r) in dead_replicas), (r, out.dead)
    for r in out.survivors:
        assert [c.step for c in out.logs[r].commits] == list(range(sc.steps)), f"rank {r} did not commit every step"

    for s in range(sc.steps):
        committers = {r: log.commits[s] for r, log in out.logs.items() if len(log.commits) > s}
        if not committers:
            continue
        rec = next(iter(committers.values())).record
        for r, c in committers.items():
            mine, first = ({k: x[k] for k in _SHARED_FIELDS} for x in (c.record, rec))
            assert mine == first, f"step {s}: rank {r} disagrees"
        replicas = rec["replicas"]
        # Every rank of every committing replica committed, and nobody else.
        expected = {r for p in replicas for r in layout.ranks_of_replica(p)}
        assert set(committers) == expected, f"step {s}: ranks {sorted(committers)} committed, the record's replicas {replicas} have {sorted(expected)}"
        assert all(c.alive == tuple(replicas) for c in committers.values())
        ids = [i - s * rec["B"] for i in rec["microbatch_ids"]]
        if sc.policy == "static":
            assert ids == list(range(sc.B)), f"step {s}: ids {ids} are not 0..{sc.B - 1} exactly once"
            assert rec["divisor"] == sc.B
        else:
            assert ids == sorted(p * sc.G + j for p in replicas for j in range(sc.G))
            assert rec["divisor"] == len(replicas) * sc.G
        assert rec["committed"] == len(ids)
        assert rec["loss"] == sum(loss_of(s, m) for m in ids) / len(ids)
        for r, c in committers.items():
            want = [sum(t) / (rec["divisor"] * sc.shards) for t in zip(*(grad_of(s, m, layout.shard_of(r)) for m in ids))]
            assert all(torch.equal(g, w) for g, w in zip(c.grads, want)), f"step {s}: rank {r} holds a wrong gradient"
        leaders = [r for r, c in committers.items() if c.led]
        assert leaders == [layout.rank_of(min(replicas), 0)], f"step {s}: leaders {leaders}, live replicas {replicas}"

    # Repairs: the same sequence everywhere, world epochs 1, 2, ..., each lost replica once.
    seen: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for r, log in out.logs.items():
        reps = log.repairs()
        assert [x.world_epoch for x in reps] == list(range(1, len(reps) + 1)), (r, reps)
        lost = [p for x in reps for p in x.lost_replicas]
        assert len(lost) == len(set(lost)), f"rank {r} was told twice of a lost replica: {reps}"
        for x in reps:
            assert seen.setdefault(x.world_epoch, (x.lost_replicas, x.alive_replicas)) == (x.lost_replicas, x.alive_replicas)
            assert x.lost_replicas and set(x.lost_replicas) <= dead_replicas
        if r in out.survivors:
            assert set(lost) == dead_replicas, f"rank {r} was told of {sorted(lost)}, dead: {sorted(dead_replicas)}"
            epoch = len(reps)
            assert out.world.comm(r).world_epoch == epoch
        for c in log.commits:
            s, rec = c.step, c.record
            in_step = [e[3] for e in log.events if e[0] == "repair" and e[1] == s]
            in_sync = [e[3] for e in log.events if e[0] == "repair" and e[1] == s and e[4]]
            before = [e[3] for e in log.events if e[0] == "repair" and e[1] is None and e[2] == s]
            assert rec["faults"] == sorted(p for x in before + in_step for p in x.lost_replicas), (r, s, rec["faults"])
            repairs_so_far = [e for e in log.events if e[0] == "repair" and (e[2] <= s if e[1] is None else e[1] <= s)]
            assert rec["world_epoch"] == len(repairs_so_far)
            # One failed round per repair; one pause per recovered collective: the step's reduction,
            # its in-step sync, and the collective between the steps (the next step's record carries it).
            assert len(rec["detects_s"]) == len(before) + len(in_step)
            recovered = (before, in_sync, [x for x in in_step if x not in in_sync])
            assert len(rec["pauses_s"]) == sum(1 for x in recovered if x)
            assert rec["stale_buckets"] == _observed_stale(log, s), (r, s)
            if sc.policy == "adaptive":
                assert rec["extra_microbatches"] == 0


def _observed_stale(log: RankLog, step: int) -> int:
    """Stale buckets as seen through the hooks: completed under a world epoch a repair left behind."""
    last: dict[int, int | None] = {}
    stale = 0
    for e in log.events:
        if e[1] != step:
            continue
        if e[0] == "start":
            last[e[2]] = None  # being (re)reduced: pending, not stale, if the round fails now
        elif e[0] == "bucket":
            last[e[2]] = e[3]
        else:
            stale += sum(1 for ep in last.values() if ep is not None and ep != e[3].world_epoch)
    return stale


def run_checked(sc: Scenario) -> Outcome:
    out = simulate(sc)
    check_protocol(out)
    assert not out.world.unfired, f"scripted kills never fired: {out.world.unfired}"
    return out


# ---------------------------------------------------------------------- scenarios
@pytest.mark.parametrize("T", [3, 2, 1])
def test_fault_free_steps_sum_every_microbatch_once(T: int) -> None:
    # With T < 3 the spares compute their shadow's ids but must send nothing.
    out = run_checked(Scenario(replicas=3, T=T, steps=3))
    assert not out.dead and out.repairs() == []
    roles = {str(p): "major" if p < T else "major_spare" for p in range(3)}
    assert out.record(0)["roles"] == roles
    assert [out.record(s)["world_epoch"] for s in range(3)] == [0, 0, 0]
    assert all(out.record(s)["stale_buckets"] == 0 for s in range(3))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("victim", [0, 1, 2])
@pytest.mark.parametrize("bucket", range(NB))
def test_failure_before_every_bucket(victim: int, bucket: int, overlap: bool) -> None:
    out = run_checked(Scenario(replicas=3, kills=(Kill(victim, "bucket", bucket=bucket),), overlap=overlap))
    assert out.dead == {victim: out.dead[victim]} and out.dead[victim].how == "killed"
    assert out.repairs() == [(1, (victim,), 1)]
    rec = out.record(0)
    assert rec["replicas"] == [p for p in range(3) if p != victim]
    assert rec["faults"] == [victim] and rec["world_epoch"] == 1
    assert rec["extra_microbatches"] == 2  # the lost replica's G=2 ids, replayed
    # The buckets completed before the failure were reduced with the dead replica: all redone.
    assert all(r["stale_buckets"] == bucket for r in out.records(0))


class SlowBackward(Runner):
    """In the overlapped microbatch, makes the first parameter's gradient only once bucket 0 was reduced."""

    def run_microbatch(self, offset: int) -> None:
        if offset != self.final:
            return super().run_microbatch(offset)
        assert self.engine is not None
        self.ran.append(offset)
        inflight = self.engine.start_overlap(self)
        assert inflight is not None
        grads = grad_of(self.step, offset, self.comm.shard)
        self.grads[1].add_(grads[1])
        self.engine.gradient_ready(1, self.grads[1])
        # Bucket 0 holds only tensor 1's first elements (plane order is reversed): it must be
        # reduced across the replicas while tensor 0 is still "being computed".
        deadline = time.monotonic() + TIMEOUT_S
        while not any(e[0] == "bucket" and e[1] == self.step and e[2] == 0 for e in list(self.log.events)):
            assert time.monotonic() < deadline, "bucket 0 was not reduced while backward was still running"
            time.sleep(0.001)
        self.log.notes.append(("overlapped", self.step))
        self.grads[0].add_(grads[0])
        self.engine.gradient_ready(0, self.grads[0])
        inflight.all_ready()
        self.engine.record(offset, loss_of(self.step, offset))


@pytest.mark.parametrize("T", [3, 2])
def test_overlap_reduces_buckets_while_backward_still_runs(T: int) -> None:
    out = run_checked(Scenario(replicas=3, T=T, steps=2, overlap=True))
    assert not out.dead
    assert all(r["overlapped"] for s in range(2) for r in out.records(s))
    assert not any(r["overlapped"] for r in simulate(Scenario(replicas=3, T=T, steps=2)).records(0))
    out = simulate(Scenario(replicas=3, T=T, steps=2, overlap=True), runner_cls=SlowBackward)
    check_protocol(out)
    for log in out.logs.values():
        assert log.notes == [("overlapped", 0), ("overlapped", 1)]


def test_overlap_failure_mid_backward_is_recovered_synchronously() -> None:
    # Replica 1 dies in bucket 1 of the overlapped round (its third bucket to start is never
    # reached): the survivors' helper threads see the failure, the main threads repair after
    # their backward and redo every bucket, synchronously.
    out = run_checked(Scenario(replicas=3, steps=2, overlap=True, kills=(Kill(1, "bucket", bucket=1, mid=True),)))
    assert out.repairs() == [(1, (1,), 1)]
    assert out.record(0)["extra_microbatches"] == 2 and out.record(1)["world_epoch"] == 1


def test_a_death_in_the_middle_of_a_bucket_leaves_part_of_the_world_with_its_sum() -> None:
    # Rank 1 dies inside bucket 2: rank 0 got the sum (3 buckets complete), rank 2 did not (2).
    out = run_checked(Scenario(replicas=3, kills=(Kill(1, "bucket", bucket=2, mid=True),)))
    assert out.repairs() == [(1, (1,), 1)]
    assert out.logs[0].commits[0].record["stale_buckets"] == 3
    assert out.logs[2].commits[0].record["stale_buckets"] == 2


@pytest.mark.parametrize("victim", [0, 2])
def test_a_death_in_the_middle_of_the_loss_reduction(victim: int) -> None:
    # Part of the world finished the round and votes to commit; the agreement must still say no.
    out = run_checked(Scenario(replicas=3, kills=(Kill(victim, "world", mid=True),)))
    assert out.repairs() == [(1, (victim,), 1)]
    assert all(r["stale_buckets"] == NB for r in out.records(0))


def test_failure_in_the_loss_reduction_makes_every_bucket_stale() -> None:
    out = run_checked(Scenario(replicas=3, kills=(Kill(1, "world"),)))
    assert out.repairs() == [(1, (1,), 1)]
    assert all(r["stale_buckets"] == NB for r in out.records(0))


def test_failure_during_agreement() -> None:
    out = run_checked(Scenario(replicas=3, kills=(Kill(2, "agree"),)))
    assert out.repairs() == [(1, (2,), 1)]
    rec = out.record(0)
    assert rec["replicas"] == [0, 1] and rec["stale_buckets"] == NB and rec["extra_microbatches"] == 2


def test_failure_during_repair_costs_a_round_not_an_epoch() -> None:
    out = run_checked(Scenario(replicas=4, kills=(Kill(1, "bucket", bucket=2), Kill(3, "repair"))))
    # One repair, two rounds: both replicas reported once, in world epoch 1.
    assert out.repairs() == [(1, (1, 3), 2)]
    rec = out.record(0)
    assert rec["replicas"] == [0, 2] and rec["faults"] == [1, 3] and rec["world_epoch"] == 1
    assert rec["extra_microbatches"] == 4 and rec["stale_buckets"] == 2


def test_deaths_in_two_repair_rounds() -> None:
    kills = (Kill(0, "agree"), Kill(3, "repair", round=1), Kill(4, "repair", round=2))
    out = run_checked(Scenario(replicas=5, G=1, kills=kills))
    assert out.repairs() == [(1, (0, 3, 4), 3)]
    assert out.record(0)["replicas"] == [1, 2]


def test_cascade_while_the_extra_microbatches_run() -> None:
    # Replica 1 dies in the reduce; replica 2 dies computing its first replayed microbatch.
    sc = Scenario(replicas=4, kills=(Kill(1, "bucket", bucket=1),), crashes=((2, 0, 3),))
    out = run_checked(sc)
    assert out.repairs() == [(1, (1,), 1), (2, (2,), 1)]
    rec = out.record(0)
    assert rec["replicas"] == [0, 3] and rec["faults"] == [1, 2] and rec["world_epoch"] == 2
    # Bucket 0 went stale at the first repair; the second failure came before any bucket completed.
    assert all(r["stale_buckets"] == 1 for r in out.records(0))
    assert rec["extra_microbatches"] == 4  # replicas 1 and 2's ids, replayed by 0 and 3


def test_cascade_during_the_re_reduce() -> None:
    sc = Scenario(replicas=4, kills=(Kill(1, "bucket", bucket=3), Kill(2, "bucket", call=2, bucket=2)))
    out = run_checked(sc)
    assert out.repairs() == [(1, (1,), 1), (2, (2,), 1)]
    assert all(r["stale_buckets"] == 3 + 2 for r in out.records(0))
    assert out.record(0)["replicas"] == [0, 3]


def test_spare_promotion_needs_no_extra_microbatches() -> None:
    # W=3, T=2: replica 2 is a spare shadowing replica 0 (the leader), which dies.
    out = run_checked(Scenario(replicas=3, T=2, kills=(Kill(0, "bucket", bucket=1),)))
    rec = out.record(0)
    assert rec["replicas"] == [1, 2] and rec["roles"] == {"1": "major", "2": "major"}
    assert rec["extra_microbatches"] == 0
    for r in out.survivors:
        assert len(out.logs[r].commits[0].ran) == 2, "a survivor computed more than its G microbatches"
    assert out.logs[2].commits[0].ran == [0, 1]  # the spare's shadow work became the sum's


def test_losing_a_spare_changes_nothing_in_the_sum() -> None:
    out = run_checked(Scenario(replicas=3, T=2, kills=(Kill(2, "bucket", bucket=0),)))
    rec = out.record(0)
    assert rec["replicas"] == [0, 1] and rec["extra_microbatches"] == 0 and rec["faults"] == [2]


def test_spare_turned_replayer_drops_its_shadow_work() -> None:
    # Replica 1 has no spare; the replay of its ids (2, 3) goes to replica 0 and spare 2.
    out = run_checked(Scenario(replicas=3, T=2, kills=(Kill(1, "bucket", bucket=2),)))
    rec = out.record(0)
    assert rec["replicas"] == [0, 2] and rec["extra_microbatches"] == 2
    assert out.logs[2].commits[0].ran == [0, 1, 3]  # shadowed 0, 1; then reset and replayed 3
    assert out.logs[0].commits[0].ran == [0, 1, 2]


@pytest.mark.parametrize("shards", [1, 2])
def test_loss_of_the_leader_hands_the_ledger_over(shards: int) -> None:
    # Rank 0 (replica 0) dies in the reduce of step 1 (its second reduction call).
    out = run_checked(Scenario(replicas=3, shards=shards, steps=3, kills=(Kill(0, "bucket", call=2, bucket=0),)))
    leaders = {s: [r for r, log in out.logs.items() if len(log.commits) > s and log.commits[s].led] for s in range(3)}
    assert leaders == {0: [0], 1: [shards], 2: [shards]}
    assert [out.record(s)["world_epoch"] for s in range(3)] == [0, 1, 1]


def test_adaptive_policy_divides_by_what_survived() -> None:
    sc = Scenario(replicas=3, policy="adaptive", kills=(Kill(1, "bucket", bucket=2),))
    out = run_checked(sc)
    rec = out.record(0)
    assert rec["microbatch_ids"] == [0, 1, 4, 5] and rec["divisor"] == 4 and rec["extra_microbatches"] == 0
    # The static policy, same failure: all six ids, divided by six.
    static = run_checked(Scenario(replicas=3, kills=(Kill(1, "bucket", bucket=2),)))
    assert static.record(0)["microbatch_ids"] == list(range(6)) and static.record(0)["divisor"] == 6


def test_a_failure_in_every_step() -> None:
    # W=5, G=1 (B=5). Step 0: replica 1 in the reduce; step 1: replica 3 at its first
    # agreement of the step (its third: step 0 took two rounds); step 2: replica 4 while
    # computing; step 3: none. Two replicas then carry B=5 with G_cur=3.
    kills = (Kill(1, "bucket", bucket=0), Kill(3, "agree", call=3))
    out = run_checked(Scenario(replicas=5, G=1, steps=4, kills=kills, crashes=((4, 2, 1),)))
    assert [out.record(s)["faults"] for s in range(4)] == [[1], [3], [4], []]
    assert [out.record(s)["world_epoch"] for s in range(4)] == [1, 2, 3, 3]
    assert out.record(3)["G_cur"] == 3 and out.record(3)["replicas"] == [0, 2]


def test_shards_a_replica_leaves_whole_through_the_gate() -> None:
    # Rank 3 is shard 1 of replica 1; its partner, rank 2, must leave through the gate.
    out = run_checked(Scenario(replicas=3, shards=2, kills=(Kill(3, "bucket", bucket=1),)))
    assert out.dead[3].how == "killed" and out.dead[2].how == "gate"
    assert out.repairs() == [(1, (1,), 1)]
    assert out.record(0)["replicas"] == [0, 2] and sorted(out.survivors) == [0, 1, 4, 5]


def test_shards_a_crash_in_compute() -> None:
    out = run_checked(Scenario(replicas=3, shards=2, steps=2, crashes=((4, 1, 2),)))
    assert out.dead[4].how == "killed" and out.dead[5].how == "gate"
    assert out.record(1)["faults"] == [2] and out.record(1)["replicas"] == [0, 1]


def test_failure_between_steps_is_reported_once_and_counted_in_the_next_step() -> None:
    # Rank 2's second world allreduce is the collective after step 0.
    out = run_checked(Scenario(replicas=3, steps=2, between=True, kills=(Kill(2, "world", call=2),)))
    rep = [e for e in out.logs[0].events if e[0] == "repair"]
    assert [(e[1], e[2], e[3].lost_replicas, e[3].world_epoch) for e in rep] == [(None, 1, (2,), 1)]
    rec = out.record(1)
    assert rec["faults"] == [2] and rec["replicas"] == [0, 1] and rec["stale_buckets"] == 0 and rec["extra_microbatches"] == 0


def test_a_collective_inside_the_step_without_failures() -> None:
    out = run_checked(Scenario(replicas=3, steps=2, sync_in_step=True))
    assert out.repairs() == [] and [out.record(s)["world_epoch"] for s in range(2)] == [0, 0]


def test_a_replica_lost_in_a_collective_inside_the_step_is_replanned() -> None:
    # Rank 1 dies in the metric sync of its first microbatch (its first world allreduce).
    out = run_checked(Scenario(replicas=3, sync_in_step=True, kills=(Kill(1, "world", call=1),)))
    assert out.repairs() == [(1, (1,), 1)]
    rec = out.record(0)
    assert rec["replicas"] == [0, 2] and rec["faults"] == [1] and rec["extra_microbatches"] == 2


class _Voter(RecoveryCallback):
    """Votes its replica's index (+1) in on_before_reduce; notes the totals on_before_commit sees."""

    def __init__(self, replica: int, seen: list[dict[str, float]]) -> None:
        self.replica, self.seen = replica, seen

    def on_before_reduce(self, trainer: Any, pl_module: Any, step: StepState, collectives: StepCollectives) -> None:
        step.requests.votes["v"] = float(self.replica + 1)

    def on_before_commit(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        self.seen.append(dict(step.requests.vote_totals))


@pytest.mark.parametrize("overlap", [False, True])
def test_on_before_commit_sees_the_steps_summed_votes(overlap: bool) -> None:
    # BufferSync decides in on_before_commit whether to broadcast from these sums; read before
    # the engine had set them, every step looked like a buffer change (a broadcast per step).
    seen: dict[int, list[dict[str, float]]] = {}
    sc = Scenario(replicas=3, steps=2, overlap=overlap)

    def train_voting(comm: FakeComm) -> None:
        policy = make_policy("static", sc.replicas, sc.G)
        cbs: list[object] = [ReductionBuffers(), EpochCheck(), BoundaryScheduler(), _Voter(comm.replica, seen.setdefault(comm.rank, []))]
        engine = StepEngine(comm, policy, hooks=HookCalls(lambda: cbs), overlap=sc.overlap)
        runner = Runner(comm, sc, RankLog())
        for step in range(sc.steps):
            state = engine.begin(step)
            runner.start(engine, step)
            runner.final = state.mine.ids[-1]
            engine.run(runner, state.mine.ids)
            engine.reduce_until_committed(runner)
            engine.finish()

    FakeWorld(sc.replicas, 1, BUCKET_NUMEL, timeout=TIMEOUT_S).run(train_voting)
    assert seen == {r: [{"v": 6.0}, {"v": 6.0}] for r in range(3)}


def test_below_min_replicas_the_survivors_stop_with_the_policy_error() -> None:
    out = simulate(Scenario(replicas=2, min_replicas=2, kills=(Kill(1, "bucket", bucket=1),)), raise_errors=False)
    died = out.results[0]
    assert isinstance(died, Died) and isinstance(died.error, TooFewReplicasError)
    assert "min_replicas=2" in str(died.error)


def test_a_stale_bucket_is_never_committed() -> None:
    # The commit rule holds on its own: a step whose reduction is from an older world epoch is refused.
    world = FakeWorld(1, bucket_numel=BUCKET_NUMEL)
    comm = world.comm(0)
    state = StepState(step=0, replica=0, plan=make_policy("static", 1, 1).begin_step(0, [0]), started_at=0.0, world_epoch=1)
    state.reduction.handle = comm.plan([torch.zeros(n) for n in SIZES])
    for b in state.reduction.handle.buckets:
        b.world_epoch = 1
    EpochCheck().on_before_commit(None, None, state)
    state.reduction.handle.buckets[2].world_epoch = 0
    with pytest.raises(RuntimeError, match=r"\(2, 0\).*world epoch 1"):
        EpochCheck().on_before_commit(None, None, state)


# ---------------------------------------------------------------------- random schedules
_POINTS = ("bucket", "world", "agree", "repair", "compute")


@st.composite
def scenarios(draw: Callable[..., Any]) -> Scenario:
    W = draw(st.integers(2, 5))
    policy = draw(st.sampled_from(["static", "static", "adaptive"]))
    T = W if policy == "adaptive" else draw(st.integers(1, W))
    G = draw(st.integers(1, 3))
    shards = draw(st.sampled_from([1, 2])) if W <= 3 else 1
    steps = draw(st.integers(1, 3))
    # At most W - 1 replicas are hit, so at least one replica always finishes.
    victims = draw(st.lists(st.integers(0, W - 1), unique=True, min_size=1, max_size=W - 1))
    kills: list[Kill] = []
    crashes: list[tuple[int, int, int]] = []
    for p in victims:
        rank = p * shards + draw(st.integers(0, shards - 1))
        point = draw(st.sampled_from(_POINTS))
        if point == "compute":
            crashes.append((rank, draw(st.integers(0, steps - 1)), draw(st.integers(1, G + 2))))
        else:
            # Reductions and agreements: one per step and one more per failure; repairs: one per failure.
            call = draw(st.integers(1, 2 if point == "repair" else steps + 1))
            mid = point in ("bucket", "world") and draw(st.booleans())
            bucket, rnd = draw(st.integers(0, NB - 1)), draw(st.integers(1, 2))
            kills.append(Kill(rank, point, call=call, bucket=bucket, round=rnd, mid=mid))
    return Scenario(
        replicas=W, G=G, T=None if policy == "adaptive" else T, shards=shards, policy=policy, steps=steps,
        kills=tuple(kills), crashes=tuple(crashes), between=draw(st.booleans()), sync_in_step=draw(st.booleans()),
        overlap=draw(st.booleans()),
    )  # fmt: skip


@settings(max_examples=120, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_failure_schedules_keep_the_invariants(sc: Scenario) -> None:
    out = simulate(sc)
    check_protocol(out)
    hit = {k.rank // sc.shards for k in sc.kills} | {c[0] // sc.shards for c in sc.crashes}
    dead_replicas = {r // sc.shards for r in out.dead}
    assert dead_replicas <= hit, f"replicas {sorted(dead_replicas - hit)} died without a scripted failure"
    assert {k.rank // sc.shards for k in out.world.fired} <= dead_replicas
    assert out.survivors, "no replica finished"



def test_the_overlap_helper_thread_is_reused_across_steps() -> None:
    # A thread per step cost a start-up hand-shake on every step's path; one helper serves every round.
    import threading

    from lightning_recover.recovery.overlap import HelperThread

    helper = HelperThread()
    ran: list[int | None] = []
    for _ in range(3):
        assert helper.idle
        done = helper.submit(lambda: ran.append(threading.get_ident()))
        assert done.wait(10)
    assert len(ran) == 3 and len(set(ran)) == 1 and ran[0] != threading.get_ident()
    gate = threading.Event()
    done = helper.submit(lambda: gate.wait(10))
    assert not helper.idle
    with pytest.raises(RuntimeError, match="still running"):
        helper.submit(lambda: None)
    gate.set()
    assert done.wait(10)


def test_only_the_planned_run_defers_the_in_replica_sync_and_its_last_backward_overlaps() -> None:
    # The strategy's backward asks the engine: (sync inside the replica now, start the overlapped reduction).
    world = FakeWorld(1, bucket_numel=BUCKET_NUMEL)
    engine = StepEngine(world.comm(0), make_policy("static", 1, 3))
    state = engine.begin(0)
    ids = state.mine.ids
    assert len(ids) == 3 and engine.start_planned() == ids[0]
    assert engine.before_backward(ids[0], sync_every_microbatch=False) == (False, False)
    assert engine.before_backward(ids[1], sync_every_microbatch=True) == (True, False)
    assert engine.before_backward(ids[2], sync_every_microbatch=False) == (True, True)
    assert state.work.microbatches_run == 3
    state.replan_pending = True  # a repair re-planned the step: every backward syncs, none starts the overlap
    assert engine.before_backward(ids[2], sync_every_microbatch=False) == (True, False)
    assert engine.before_backward(ids[0], sync_every_microbatch=False) == (True, False)

    ran: list[int] = []

    class Runner:
        def run_microbatch(self, offset: int) -> None:
            ran.append(offset)

        def local_grads(self) -> list[torch.Tensor]:
            return []

    engine.run_planned(Runner())
    assert ran == [], "a re-planned step leaves what is missing to the boundary step"
    state.replan_pending = False
    engine.run_planned(Runner())
    assert ran == list(ids[1:])
    # The planned run is over: recovery microbatches always sync, and never start the overlap.
    assert engine.before_backward(ids[2], sync_every_microbatch=False) == (True, False)
