"""Versatile workload policies: who computes which microbatches of a step (ReCoVer's versatile workload); the protocol and its base class.

Every rank of every replica calls the same policy with the same membership events
(`begin_step`, `fail`, `commit`) and derives the same plan
(:class:`~lightning_recover.workload.step_plan.StepPlan`), with no communication: the plan
is a pure function of (W_init, T, G_init, live set, failure sequence). :class:`WorkloadPolicy`
is that protocol and the bookkeeping every policy shares (the live set, the faults and joins a
step records, state_dict); the policies are
:class:`~lightning_recover.workload.static_world.StaticWorld` (ReCoVer's policy made
exactly-once: constant B, spares, replay) and its ablation
:class:`~lightning_recover.workload.adaptive_world.AdaptiveWorld` (torchft-like), built by
config name with :func:`~lightning_recover.workload.factory.make_policy`. A policy says how
a live set's steady plan looks (its :class:`~lightning_recover.workload.step_plan.Membership`,
built once per membership change) and how a failure changes it; the base keeps the open
step as that membership plus the few replicas a failure changed (``_Slot``), so a steady
step costs O(1) and a failure O(what it changes). Settings are validated with
``_check_setting``: the base's internals, shared with its subclasses only.

Hot re-join (the paper's reverse role adjustment) is one more membership event,
``join(replicas, lost=())``, allowed only at a step boundary: after ``commit()`` and
before the next ``begin_step()`` (a step in progress never changes its contributors by a
join, so its exactly-once plan is untouched). Every rank, the joiners included, applies
the same ``join`` at the same boundary. A joiner takes the index of a replica that was
lost (indices stay in 0..W_init-1, so a job never has more than W_init replicas): it is
either already gone from the live set (its loss was seen by an earlier step), or its loss
was only seen between steps, by a repair outside any step; then pass it in ``lost`` too,
so the next step records that fault and the join both. The step that first includes the
joiners lists them in its record's ``joined``. B never changes; how each policy gives the
joiners work is in its own module.

The module is deliberately pure Python (no torch, no MPI) so it can be tested exhaustively.
Bad settings (sizes, T, min_replicas, the policy name, a checkpoint of other settings) raise
:class:`lightning_recover.config.ConfigurationError`; misuse of the protocol raises
ValueError or :class:`~lightning_recover.workload.step_plan.PolicyError`, and running out of
replicas :class:`~lightning_recover.workload.step_plan.TooFewReplicasError`.
"""

from __future__ import annotations

import abc
import itertools
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_recover.config import ConfigurationError
from lightning_recover.workload.step_plan import (
    CommitRecord,
    Membership,
    PolicyError,
    ReplicaPlan,
    Role,
    StepPlan,
    TooFewReplicasError,
)

__all__ = ["WorkloadPolicy"]


@dataclass
class _Slot:
    """A replica whose share a failure changed in the open step (frozen into ReplicaPlan on demand)."""

    role: Role
    base: Sequence[int]  # steady-state ids (own, inherited by promotion, or shadowed)
    contributes: bool
    shadows: int | None
    replay: list[int] = field(default_factory=list)

    def freeze(self, replica: int) -> ReplicaPlan:
        return ReplicaPlan(
            replica=replica,
            role=self.role,
            ids=tuple(sorted((*self.base, *self.replay))),
            contributes=self.contributes,
            shadows=self.shadows,
            extra=tuple(sorted(self.replay)),
        )

    @classmethod
    def of(cls, plan: ReplicaPlan) -> _Slot:
        return cls(plan.role, plan.ids, plan.contributes, plan.shadows)


def _as_int(value: Any) -> int | None:
    """`value` as an int if it is integral (numpy ints included, bools excluded), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_int(name: str, value: Any, minimum: int, fix: str, error: type[ValueError] = ValueError) -> int:
    """``value`` as an int >= minimum; ``error`` is ConfigurationError for a setting."""
    as_int = _as_int(value)
    if as_int is None:
        raise error(f"{name} must be an integer, got {value!r}; {fix}")
    value = as_int
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}; {fix}")
    return value


def _check_setting(name: str, value: Any, minimum: int, fix: str) -> int:
    return _check_int(name, value, minimum, fix, error=ConfigurationError)


class WorkloadPolicy(abc.ABC):
    """Common protocol: begin_step -> fail* -> commit, once per optimizer step."""

    name: str = ""
    B: int
    G_init: int
    W_init: int
    T: int
    min_replicas: int

    def __init__(self, W_init: int, G_init: int, T: int, min_replicas: int) -> None:
        self.W_init = W_init
        self.G_init = G_init
        self.T = T
        self.B = T * G_init
        self.min_replicas = min_replicas
        self._live: tuple[int, ...] = tuple(range(W_init))
        # The last `alive` tuple begin_step accepted: the same object again means the same live
        # set, so a steady step skips the O(W) validation (fail, join and load clear it).
        self._alive_seen: tuple[int, ...] | None = None
        self._next_step = 0
        self._step: int | None = None
        # The open step: the membership it began with (built once per membership change),
        # the members it lost, and the replicas whose share its failures changed.
        self._membership: Membership | None = None
        self._membership_since: int | None = None
        # A loaded state's membership line (the step that defines it), while that membership holds.
        self._since_hint: int | None = None
        self._dead: set[int] = set()
        self._changes: dict[int, _Slot] = {}
        self._faults: list[int] = []
        # Membership events between steps, recorded by the next step's commit.
        self._joined: set[int] = set()
        self._lost_between: set[int] = set()
        # steady_ids' last answer: (the alive object asked for, its membership).
        self._forecast: tuple[Sequence[int], Membership | None] | None = None

    # -- shared helpers -------------------------------------------------------------

    @staticmethod
    def _check_min_replicas(min_replicas: int, W_init: int) -> int:
        min_replicas = _check_setting(
            "min_replicas", min_replicas, 1, "set recover.min_replicas to at least 1"
        )
        if min_replicas > W_init:
            raise ConfigurationError(
                f"min_replicas must be <= W_init={W_init}, got {min_replicas}; "
                f"lower recover.min_replicas or start more replicas"
            )
        return min_replicas

    def _replica_set(self, replicas: Iterable[int], what: str) -> set[int]:
        try:
            fast = set(replicas)
        except TypeError:
            fast = None
        # Plain ints in range, checked at C speed (a live set of 100k replicas at a membership
        # change); anything else (numpy ints, a bad index) takes the loop that names it.
        if fast is not None and (not fast or ({*map(type, fast)} == {int} and min(fast) >= 0 and max(fast) < self.W_init)):
            return fast
        out: set[int] = set()
        for r in replicas:
            idx = _as_int(r)
            if idx is None or not 0 <= idx < self.W_init:
                raise ValueError(
                    f"{what}: replica index {r!r} is not in 0..{self.W_init - 1}; "
                    f"pass original replica indices (never renumbered after failures)"
                )
            out.add(idx)
        return out

    def _check_enough(self, live: Collection[int], context: str) -> None:
        if not live:
            raise TooFewReplicasError(
                f"{context}: all {self.W_init} replicas are lost, 0 left; "
                f"the job cannot continue, restart it from the last checkpoint"
            )
        if len(live) < self.min_replicas:
            raise TooFewReplicasError(
                f"{context}: only {len(live)} replica(s) left {sorted(live)}, "
                f"fewer than min_replicas={self.min_replicas}; restart from the last "
                f"checkpoint or lower recover.min_replicas"
            )

    def _require_open(self, call: str) -> int:
        if self._step is None:
            raise PolicyError(f"{call}() called with no step in progress; call begin_step() first")
        return self._step

    def _open(self, step: int, alive: Collection[int]) -> None:
        """Open ``step`` for ``alive``: O(1) when ``alive`` is the tuple the previous step began with."""
        step = _check_int("step", step, 0, "pass the optimizer step index")
        if step < self._next_step:
            raise ValueError(
                f"step {step} is already committed (next step is {self._next_step}); "
                f"begin_step() must not go back in time"
            )
        # Re-beginning an uncommitted step keeps the faults its aborted attempt saw.
        carried = set(self._faults) if self._step is not None else set()
        same = alive is self._alive_seen and not self._dead
        if same:
            self._faults = sorted(carried | self._lost_between)
        else:
            alive_set = self._replica_set(alive, f"begin_step({step})")
            rejoined = alive_set - set(self._live)
            if rejoined:
                raise ValueError(
                    f"begin_step({step}): replica(s) {sorted(rejoined)} are not live "
                    f"(live: {list(self._live)}); a re-joining replica must be admitted with "
                    f"join() after the previous commit(), else drop it from alive"
                )
            self._check_enough(alive_set, f"begin_step({step})")
            # Replicas found dead between steps are recorded as faults of the step that saw them.
            self._faults = sorted(carried | (set(self._live) - alive_set) | self._lost_between)
            live = tuple(sorted(alive_set))
            if live != self._live:
                self._membership, self._since_hint = None, None
            self._live = live
            self._alive_seen = alive if isinstance(alive, tuple) else None
        self._lost_between = set()
        self._step = step
        if self._dead:
            self._membership = None  # an aborted attempt lost members: plan the survivors afresh
        self._dead, self._changes = set(), {}
        if self._membership is None:
            # A resumed policy refers to the line that already holds its membership, as the
            # run it resumes would: every rank writes the same ledger line.
            self._membership, self._membership_since = self._steady_membership(self._live, self._joined), self._since_hint
            self._since_hint = None

    @abc.abstractmethod
    def _steady_membership(self, live: tuple[int, ...], joined: Collection[int]) -> Membership:
        """The steady plan of ``live`` (sorted), ``joined`` being the joiners of this boundary."""

    def _slot(self, r: int) -> _Slot:
        """Replica ``r``'s share in the open step, as a slot a failure may change."""
        found = self._changes.get(r)
        if found is None:
            assert self._membership is not None
            found = self._changes[r] = _Slot.of(self._membership.plan_of(r))
        return found

    def _lose(self, lost: Collection[int]) -> list[int]:
        """Mark newly lost members dead; repeated reports of a dead replica are ignored."""
        step = self._require_open("fail")
        assert self._membership is not None
        lost_set = self._replica_set(lost, f"fail() in step {step}")
        newly = sorted(r for r in lost_set if r not in self._dead and r in self._membership)
        if not newly:
            return []
        survivors = tuple(itertools.filterfalse(lost_set.__contains__, self._live))
        self._check_enough(survivors, f"step {step}: after losing {newly}")
        self._dead.update(newly)
        self._live = survivors
        self._alive_seen = None
        self._faults = sorted({*self._faults, *newly})
        return newly

    def _step_plan(self, divisor: int, G_cur: int) -> StepPlan:
        """The open step's plan: its membership, the changed shares, the dead."""
        assert self._step is not None and self._membership is not None
        replayed = tuple(sorted(i for r, s in self._changes.items() if r not in self._dead for i in s.replay)) if self._changes else ()
        W_cur = self._membership.n - len(self._dead)
        changes = {r: s.freeze(r) for r, s in self._changes.items() if r not in self._dead}
        return StepPlan(
            step=self._step,
            B=self.B,
            membership=self._membership,
            divisor=divisor,
            G_cur=G_cur,
            G_ext=-(-len(replayed) // W_cur) if replayed else 0,
            replayed=replayed,
            changes=changes,
            dead=frozenset(self._dead),
        )

    def _record(self, id_ranges: Sequence[tuple[int, int]], committed: int, extra: int, G_cur: int) -> CommitRecord:
        """Close the open step and return its record; the next step reuses the membership if nothing changed."""
        step = self._require_open("commit")
        m = self._membership
        assert m is not None
        if self._membership_since is None:
            self._membership_since = step
        role_changes = {}
        for r, slot in self._changes.items():
            if r not in self._dead and slot.role is not m.role_at(m.position(r)):  # type: ignore[arg-type]
                role_changes[r] = slot.role
        record = CommitRecord(
            step=step,
            B=self.B,
            committed=committed,
            id_ranges=tuple((step * self.B + lo, step * self.B + hi) for lo, hi in id_ranges),
            membership=m,
            membership_since=self._membership_since,
            faults=tuple(self._faults),
            extra_microbatches=extra,
            G_cur=G_cur,
            joined=tuple(sorted(self._joined)),
            role_changes=role_changes,
            died=tuple(sorted(self._dead)),
        )
        if self._dead or self._joined:
            # The next step plans a new live set, or the joiners as veterans.
            self._membership = None
        self._next_step = step + 1
        self._step = None
        self._dead, self._changes = set(), {}
        self._faults = []
        self._joined = set()
        return record

    def join(self, replicas: Collection[int], *, lost: Collection[int] = ()) -> tuple[int, ...]:
        """Admit ``replicas`` at a step boundary; returns the live replicas after the join.

        Call it after ``commit()`` (or before the first ``begin_step``) and before the next
        ``begin_step``, on every rank, joiners included. A joiner takes the index of a lost
        replica. ``lost``: replicas found dead since the last event this policy saw (a repair
        between steps) -- they are removed first and recorded as faults of the next step, so
        a replacement may take such an index at the same boundary. A joiner also dead by the
        next ``begin_step`` is simply missing from its ``alive``: recorded as joined and lost.
        """
        if self._step is not None:
            raise PolicyError(
                f"join() called while step {self._step} is open; replicas join at a step "
                f"boundary: call join() after commit() and before the next begin_step()"
            )
        gone = self._replica_set(lost, "join(lost=...)") & set(self._live)
        new = self._replica_set(replicas, "join()")
        already = sorted(new & (set(self._live) - gone))
        if already:
            raise ValueError(
                f"join(): replica(s) {already} are already live (live: {list(self._live)}); "
                f"a joiner takes a lost replica's index -- if that replica's loss was seen "
                f"only between steps, pass it in lost= as well"
            )
        live = (set(self._live) - gone) | new
        self._check_enough(live, f"join({sorted(new)}, lost={sorted(gone)})")
        self._live = tuple(sorted(live))
        self._alive_seen, self._membership, self._since_hint = None, None, None
        self._lost_between |= gone
        self._joined |= new
        self._after_membership_change()
        return self._live

    def _after_membership_change(self) -> None:
        """Hook for derived quantities of the live set (StaticWorld's G_cur)."""

    @property
    def joining(self) -> tuple[int, ...]:
        """Replicas admitted since the last commit (the next record's ``joined``)."""
        return tuple(sorted(self._joined))

    @property
    def live(self) -> tuple[int, ...]:
        """Live replicas (original indices), as of the latest event."""
        return self._live

    @property
    def next_step(self) -> int:
        return self._next_step

    @property
    def current_plan(self) -> StepPlan:
        self._require_open("current_plan")
        return self._plan()

    def steady_ids(self, alive: Sequence[int], replica: int) -> tuple[int, ...]:
        """The ids ``replica`` computes in a later step that begins with ``alive`` and no failure.

        The data feed's forecast (it loads the next steps' samples ahead). A fresh policy's
        answer: the joiners of this boundary are veterans by then. Kept for the last live
        tuple, so asking again with the communicator's unchanged tuple costs O(log W)."""
        cached = self._forecast
        # Kept only for a tuple: a list asked for again may have changed in place.
        if cached is None or cached[0] is not alive or not isinstance(alive, tuple):
            live = tuple(sorted(alive))
            # A step that begins with fewer than min_replicas never runs: nothing to load for it.
            m = self._steady_membership(live, ()) if live and len(live) >= self.min_replicas else None
            cached = self._forecast = (alive, m)
        m = cached[1]
        if m is None or replica not in m:
            return ()
        return m.plan_of(replica).ids

    def _common_state(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "W_init": self.W_init,
            "G_init": self.G_init,
            "T": self.T,
            "B": self.B,
            "min_replicas": self.min_replicas,
            "live": list(self._live),
            "next_step": self._next_step,
            # Between-step membership events not yet committed (a state handed to a joiner
            # at the boundary of its join carries them, so its next record is everyone's).
            "joined": sorted(self._joined),
            "lost": sorted(self._lost_between),
            # The ledger line holding the membership the next step reuses (None: it plans a new one).
            "membership_since": self._membership_since if self._membership is not None else None,
        }

    def _load_common(self, d: Mapping[str, Any]) -> None:
        # A checkpoint that does not match this run's settings: the fix is a setting.
        if d.get("policy") != self.name:
            raise ConfigurationError(
                f"policy state is for {d.get('policy')!r}, not {self.name!r}; "
                f"resume with recover.policy={d.get('policy')!r} or start fresh"
            )
        for key in ("W_init", "G_init", "T", "B"):
            if d.get(key) != getattr(self, key):
                raise ConfigurationError(
                    f"policy state has {key}={d.get(key)!r} but this run has "
                    f"{key}={getattr(self, key)}; B must stay constant across a resume, "
                    f"configure the run with the checkpoint's {key}"
                )
        live = self._replica_set(d["live"], "load_state_dict")
        self._check_enough(live, "load_state_dict")
        self._live = tuple(sorted(live))
        self._next_step = _check_int("next_step", d["next_step"], 0, "the state is corrupt")
        self._step = None
        self._alive_seen, self._membership, self._membership_since = None, None, None
        since = d.get("membership_since")
        self._since_hint = since if _as_int(since) is not None else None
        self._dead, self._changes = set(), {}
        self._faults = []
        # Absent from checkpoints written before hot re-join existed: no pending events.
        self._joined = self._replica_set(d.get("joined", ()), "load_state_dict (joined)")
        self._lost_between = self._replica_set(d.get("lost", ()), "load_state_dict (lost)")
        if not self._joined <= live | self._lost_between:
            raise ValueError(
                f"policy state lists joined replicas {sorted(self._joined - live)} that are neither "
                f"live {sorted(live)} nor lost; the state is corrupt"
            )

    # -- protocol -------------------------------------------------------------------

    @abc.abstractmethod
    def begin_step(self, step: int, alive: Collection[int]) -> StepPlan:
        """Steady-state plan for `alive`; must precede fail()/commit() in every step."""

    @abc.abstractmethod
    def fail(self, lost: Collection[int]) -> StepPlan:
        """These replicas died mid-step; returns the cumulative updated plan."""

    @abc.abstractmethod
    def commit(self) -> CommitRecord:
        """The step is applied; close it and advance the quotas."""

    @abc.abstractmethod
    def _plan(self) -> StepPlan: ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state between steps.

        An open step's plan is not saved: after a load, begin_step(next_step, alive) re-runs
        that step from its steady-state plan for the replicas live at the last event. Joins
        and between-step losses since the last commit are kept (the next record lists them).
        """
        return self._common_state()

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self._load_common(d)
