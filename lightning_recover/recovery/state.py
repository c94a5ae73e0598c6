"""The per-step state of the recovery protocol: one optimizer step's state, split by owner.

:class:`StepState` is created by :meth:`StepEngine.begin` and dropped after the commit, so
nothing of a step leaks into the next. It holds what the engine decides (the plan, the world
epoch, whether the reduction is agreed) and one small part per owner: :class:`StepWork` (what
this replica computed), :class:`StepFailures` (what failures cost the step), :class:`Reduction`
(the buffers and rounds of the gradient reduction) and :class:`StepRequests` (what recovery
callbacks ask of the engine: the boundary schedule, a redo, votes). :class:`Join` is
one replica admitted at a step boundary (hot re-join), as the next step's ledger line
records it. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_recover.comm.buckets import ReduceHandle
from lightning_recover.workload.step_plan import ReplicaPlan, StepPlan


@dataclass(frozen=True)
class Join:
    """One replica admitted at a step boundary, as the ledger's ``joins`` lists it.

    The timings are what the communicator measured, None where it did not.
    """

    replica: int
    #: Seconds the live state (model, optimizer, loop counters, policy) took to reach the joiner.
    transfer_s: float | None = None
    #: Seconds the survivors were blocked by this join (merge + transfer), the join's cost to them.
    pause_s: float | None = None
    #: Processes spawned to seat it: the replica's S ranks, fewer when salvage's orphans filled the rest, 0 for
    #: orphans alone (None: not known).
    spawned: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"replica": self.replica, "transfer_s": self.transfer_s, "pause_s": self.pause_s}
        if self.spawned is not None:
            out["spawned"] = self.spawned
        return out


@dataclass(frozen=True)
class Schedule:
    """What a replica computes after a repair: optionally drop its accumulator, then ``run``."""

    reset: bool  # discard the accumulator (it holds ids this replica no longer owns)
    run: tuple[int, ...]  # step-local microbatch ids to compute now, in order


@dataclass
class StepWork:
    """What this replica computed in the step (the engine records it as the strategy runs microbatches)."""

    #: Step-local microbatch ids whose gradients are in this replica's accumulator.
    computed: list[int] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    #: Values logged per microbatch for a cross-replica sum at commit (see :mod:`~.step_values`).
    logged: dict[int, dict[str, tuple[float, float, float, float]]] = field(default_factory=dict)
    #: Microbatches this replica ran so far in the step (fault injection counts by it).
    microbatches_run: int = 0
    #: The step's loss, summed over its B microbatches at the commit.
    loss: float | None = None
    #: The logged values summed over the step's B microbatches (every live rank the same).
    logged_totals: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)


@dataclass
class StepFailures:
    """What failures cost the step, as its ledger line records it (the engine's repairs fill it)."""

    lost_replicas: list[int] = field(default_factory=list)
    #: Seconds from the first failed round to the commit, per recovered failure.
    pauses: list[float] = field(default_factory=list)
    #: Seconds blocked in each failed round (reduce + agreement): bounds how long a hang went unseen.
    detects: list[float] = field(default_factory=list)
    #: Buckets reduced under an older world epoch and reduced again (EpochCheck counts them).
    stale_buckets_redone: int = 0


@dataclass
class Reduction:
    """The step's gradient reduction: the buffers (ReductionBuffers sets ``send`` and ``out``) and its rounds."""

    local: list[Any] = field(default_factory=list)  # the accumulated, pre-reduction gradients (rollback copy)
    send: list[Any] = field(default_factory=list)  # what this replica contributes (zeros for a spare)
    out: list[Any] = field(default_factory=list)  # the reduced sums
    handle: ReduceHandle | None = None
    #: Reduce this step's first round during the last backward (when the engine overlaps);
    #: an ``on_before_overlap`` callback sets it False to see the whole local gradient first.
    overlap: bool = True
    #: The overlapped first round while it runs (:class:`~.overlap.OverlappedReduction`).
    inflight: Any = None
    #: The first round did start during the last backward (the ledger's ``overlapped``).
    overlapped: bool = False


@dataclass
class StepRequests:
    """What the recovery callbacks ask of the engine in this step; the engine acts on it."""

    #: Set by ``on_boundary_step`` (BoundaryScheduler): the extra microbatches this replica runs.
    schedule: Schedule | None = None
    #: Set by an ``on_before_reduce`` callback (CorruptionCheck): recompute these ids from a fresh
    #: accumulator before reducing (every rank sets it, () where nothing is redone; the hook runs again).
    redo: tuple[int, ...] | None = None
    #: Set by ``on_before_reduce`` callbacks on every rank (the same keys everywhere): numbers
    #: summed over every live rank with the step's loss; the sums are in ``vote_totals`` at commit.
    votes: dict[str, float] = field(default_factory=dict)
    vote_totals: dict[str, float] = field(default_factory=dict)


@dataclass
class StepState:
    """One optimizer step of one replica, from plan to commit: what the engine decides, and one part per owner."""

    step: int
    replica: int
    plan: StepPlan
    started_at: float
    #: The membership generation the step is being reduced in (bumped by every repair).
    world_epoch: int
    #: The reduction of this step was agreed: later repairs no longer change what it commits.
    agreed: bool = False
    #: A repair in a collective inside the step (e.g. a metric sync in training_step)
    #: re-planned it; the extra microbatches run before the reduction.
    replan_pending: bool = False
    work: StepWork = field(default_factory=StepWork)
    failures: StepFailures = field(default_factory=StepFailures)
    reduction: Reduction = field(default_factory=Reduction)
    requests: StepRequests = field(default_factory=StepRequests)

    #: (plan, this replica's share of it): ``mine`` is read per gradient, the plan changes only at a repair.
    _mine: tuple[StepPlan, ReplicaPlan] | None = field(default=None, repr=False)

    @property
    def mine(self) -> ReplicaPlan:
        """This replica's share of the current plan."""
        if self._mine is None or self._mine[0] is not self.plan:
            self._mine = (self.plan, self.plan.for_replica(self.replica))
        return self._mine[1]

    @property
    def recovery_s(self) -> float:
        return sum(self.failures.pauses)
