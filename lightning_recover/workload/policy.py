"""Versatile workload policies: who computes which microbatches of a step (layer 3).

Every rank of every replica calls the same policy with the same membership events
(`begin_step`, `fail`, `commit`) and derives the same plan, with no communication: the
plan is a pure function of (W_init, T, G_init, live set, failure sequence).

`StaticWorld` is ReCoVer's policy made exactly-once: each step sums the gradients of
exactly B = T * G_init microbatches with fixed step-local ids 0..B-1, whatever fails.
A lost contributor is replaced by the spare that shadows it (no extra compute), or its ids
are replayed by the survivors (a boundary step). `AdaptiveWorld` is the ablation that
behaves like torchft: lost ids are dropped and the step divides by what survived.

Hot re-join (the paper's reverse role adjustment) is one more membership event,
``join(replicas, lost=())``, allowed only at a step boundary: after ``commit()`` and
before the next ``begin_step()`` (a step in progress never changes its contributors by a
join, so its exactly-once plan is untouched). Every rank, the joiners included, applies
the same ``join`` at the same boundary. A joiner takes the index of a replica that was
lost (indices stay in 0..W_init-1, so a job never has more than W_init replicas): it is
either already gone from the live set (its loss was seen by an earlier step), or its loss
was only seen between steps, by a repair outside any step; then pass it in ``lost`` too,
so the next step records that fault and the join both. The step that first includes the
joiners lists them in its record's ``joined``. B never changes; the steady plan of the
enlarged live set re-balances the roles: G_cur falls back towards G_init as replicas
return, and once more than T are live the extra ones are spares again.

A joiner's first step: with ``StaticWorld(join_as_spare=True)`` (the default) the
replicas admitted at a boundary are spares for the step that follows it, shadowing a
contributor, and the replicas that were already live carry the step exactly as they
would have without the join; from the next step on the joiners contribute. Dying in
that first step then costs no replay, and a contributor lost in it is covered by the
joiner at no extra compute. With ``join_as_spare=False`` the joiners contribute at once
when the live replicas before them cannot carry B at G_init (they are ordered after the
replicas already live, so they are the spares when more than T are live).
`AdaptiveWorld` has no spares: a joiner computes its own ids at once, the batch grows back.

The module is deliberately pure Python (no torch, no MPI) so it can be tested exhaustively.
Bad settings (sizes, T, min_replicas, the policy name, a checkpoint of other settings) raise
:class:`lightning_recover.config.ConfigurationError`; misuse of the protocol raises
ValueError or :class:`PolicyError`, and running out of replicas :class:`TooFewReplicasError`.
"""

from __future__ import annotations

import abc
import enum
import heapq
import operator
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_recover.config import POLICY_NAMES, ConfigurationError
from lightning_recover.errors import RecoverError

__all__ = [
    "AdaptiveWorld",
    "CommitRecord",
    "PolicyError",
    "ReplicaNotLiveError",
    "ReplicaPlan",
    "Role",
    "StaticWorld",
    "StepPlan",
    "TooFewReplicasError",
    "WorkloadPolicy",
    "POLICY_NAMES",
    "make_policy",
    "steady_quota",
]


class Role(str, enum.Enum):
    """What a replica does in a step; spares compute but contribute nothing until promoted."""

    MAJOR = "major"
    MINOR = "minor"
    MAJOR_SPARE = "major_spare"
    MINOR_SPARE = "minor_spare"

    @property
    def is_spare(self) -> bool:
        return self in (Role.MAJOR_SPARE, Role.MINOR_SPARE)


class PolicyError(RecoverError, RuntimeError):
    """Base class of the errors a workload policy raises at run time."""


class TooFewReplicasError(PolicyError):
    """The live replicas can no longer run the job (none left, or fewer than the minimum)."""


class ReplicaNotLiveError(PolicyError, KeyError):
    """A plan was asked for a replica that is not live in it."""

    def __str__(self) -> str:
        # KeyError would repr() the message; keep it readable.
        return str(self.args[0]) if self.args else ""


class _FrozenMap(Mapping[int, "ReplicaPlan"]):
    """Read-only mapping that, unlike MappingProxyType, survives copy.deepcopy and pickle."""

    __slots__ = ("_d",)

    def __init__(self, d: dict[int, ReplicaPlan]) -> None:
        self._d = d

    def __getitem__(self, key: int) -> ReplicaPlan:
        return self._d[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return repr(self._d)

    def __getstate__(self) -> dict[int, ReplicaPlan]:
        return self._d

    def __setstate__(self, d: dict[int, ReplicaPlan]) -> None:
        self._d = d


@dataclass(frozen=True)
class ReplicaPlan:
    """One replica's share of a step.

    `ids` are the step-local microbatch offsets whose gradients this replica must hold in
    its accumulator when the step commits; for a spare they are the ids of the contributor
    it shadows (computed so that a promotion costs nothing).
    """

    replica: int
    role: Role
    ids: tuple[int, ...]
    contributes: bool
    shadows: int | None
    # The replayed (boundary-step) ids among `ids`; empty in the steady state.
    extra: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """The plan of every live replica for one step, as all ranks agree on it."""

    step: int
    B: int
    plans: Mapping[int, ReplicaPlan]
    divisor: int
    G_cur: int
    G_ext: int
    # Step-local ids currently being replayed by survivors (the boundary step's lost set).
    replayed: tuple[int, ...] = ()

    def for_replica(self, r: int) -> ReplicaPlan:
        try:
            return self.plans[r]
        except KeyError:
            raise ReplicaNotLiveError(
                f"replica {r} is not live in the plan of step {self.step} "
                f"(live: {sorted(self.plans)}); it has failed or was never part of the job"
            ) from None

    @property
    def live(self) -> tuple[int, ...]:
        return tuple(sorted(self.plans))

    @property
    def contributors(self) -> tuple[int, ...]:
        return tuple(r for r in sorted(self.plans) if self.plans[r].contributes)

    @property
    def committed_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for p in self.plans.values():
            if p.contributes:
                ids.extend(p.ids)
        return tuple(sorted(ids))


@dataclass(frozen=True)
class CommitRecord:
    """What a committed step applied; the ledger line is built from it.

    `faults` includes replicas found dead between the previous commit and this step's
    begin_step; `joined` the replicas admitted in that interval (a joiner that died before
    the step began is in both). `extra_microbatches` counts the replayed ids the committing
    replicas hold (the boundary step's B - C_cur); a replayer that died mid-replay is not
    counted.
    """

    step: int
    B: int
    committed: int
    microbatch_ids: tuple[int, ...]
    replicas: tuple[int, ...]
    roles: dict[int, str]
    faults: tuple[int, ...]
    extra_microbatches: int
    G_cur: int
    #: Replicas admitted by join() at the boundary before this step (see the module docstring).
    joined: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields (lists, string keys) for a ledger line."""
        return {
            "step": self.step,
            "B": self.B,
            "committed": self.committed,
            "microbatch_ids": list(self.microbatch_ids),
            "replicas": list(self.replicas),
            "roles": {str(r): role for r, role in sorted(self.roles.items())},
            "faults": list(self.faults),
            "extra_microbatches": self.extra_microbatches,
            "G_cur": self.G_cur,
            "joined": list(self.joined),
        }


def steady_quota(B: int, W_cur: int, G_init: int) -> int:
    """Smallest G >= G_init with W_cur * G >= B: the per-replica quota that keeps B constant."""
    if W_cur < 1:
        raise TooFewReplicasError(f"no live replicas left to carry B={B}")
    return max(G_init, -(-B // W_cur))


@dataclass
class _Slot:
    """Mutable per-replica state while a step is open (frozen into ReplicaPlan on demand)."""

    role: Role
    base: tuple[int, ...]  # steady-state ids (own, inherited by promotion, or shadowed)
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
        self._next_step = 0
        self._step: int | None = None
        self._slots: dict[int, _Slot] = {}
        self._faults: list[int] = []
        # Membership events between steps, recorded by the next step's commit.
        self._joined: set[int] = set()
        self._lost_between: set[int] = set()

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

    def _open(self, step: int, alive: Collection[int]) -> list[int]:
        step = _check_int("step", step, 0, "pass the optimizer step index")
        if step < self._next_step:
            raise ValueError(
                f"step {step} is already committed (next step is {self._next_step}); "
                f"begin_step() must not go back in time"
            )
        alive_set = self._replica_set(alive, f"begin_step({step})")
        rejoined = alive_set - set(self._live)
        if rejoined:
            raise ValueError(
                f"begin_step({step}): replica(s) {sorted(rejoined)} are not live "
                f"(live: {list(self._live)}); a re-joining replica must be admitted with "
                f"join() after the previous commit(), else drop it from alive"
            )
        self._check_enough(alive_set, f"begin_step({step})")
        # Replicas found dead between steps are recorded as faults of the step that saw them;
        # re-beginning an uncommitted step keeps the faults its aborted attempt saw.
        carried = set(self._faults) if self._step is not None else set()
        self._faults = sorted(carried | (set(self._live) - alive_set) | self._lost_between)
        self._lost_between = set()
        self._live = tuple(sorted(alive_set))
        self._step = step
        return list(self._live)

    def _lose(self, lost: Collection[int]) -> tuple[list[int], dict[int, _Slot]]:
        """Remove newly lost replicas; repeated reports of a dead replica are ignored."""
        step = self._require_open("fail")
        lost_set = self._replica_set(lost, f"fail() in step {step}")
        newly = sorted(lost_set & set(self._slots))
        if not newly:
            return [], {}
        survivors = [r for r in self._live if r not in lost_set]
        self._check_enough(survivors, f"step {step}: after losing {newly}")
        dead = {r: self._slots.pop(r) for r in newly}
        self._live = tuple(survivors)
        self._faults = sorted({*self._faults, *newly})
        return newly, dead

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
    def step_open(self) -> bool:
        return self._step is not None

    @property
    def next_step(self) -> int:
        return self._next_step

    @property
    def current_plan(self) -> StepPlan:
        self._require_open("current_plan")
        return self._plan()

    def _frozen_plans(self) -> Mapping[int, ReplicaPlan]:
        return _FrozenMap({r: self._slots[r].freeze(r) for r in sorted(self._slots)})

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
        self._slots = {}
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


class AdaptiveWorld(WorkloadPolicy):
    """Ablation (torchft-like): fixed ownership, no spares, no replay, divide by survivors."""

    name = "adaptive"

    def __init__(self, W_init: int, G_init: int, min_replicas: int = 1) -> None:
        W_init = _check_setting("W_init", W_init, 1, "start at least one replica")
        G_init = _check_setting("G_init", G_init, 1, "set recover.grad_accum to a positive integer")
        min_replicas = self._check_min_replicas(min_replicas, W_init)
        super().__init__(W_init, G_init, W_init, min_replicas)
        self.G_cur = G_init

    def _own(self, r: int) -> _Slot:
        G = self.G_init
        return _Slot(Role.MAJOR, tuple(range(r * G, (r + 1) * G)), True, None)

    def begin_step(self, step: int, alive: Collection[int]) -> StepPlan:
        live = self._open(step, alive)
        self._slots = {r: self._own(r) for r in live}
        return self._plan()

    def fail(self, lost: Collection[int]) -> StepPlan:
        self._lose(lost)  # their ids are simply dropped
        return self._plan()

    def _plan(self) -> StepPlan:
        assert self._step is not None
        return StepPlan(
            step=self._step,
            B=self.B,
            plans=self._frozen_plans(),
            divisor=len(self._slots) * self.G_init,
            G_cur=self.G_init,
            G_ext=0,
        )

    def commit(self) -> CommitRecord:
        step = self._require_open("commit")
        plan = self._plan()
        ids = plan.committed_ids
        record = CommitRecord(
            step=step,
            B=self.B,
            committed=len(ids),
            microbatch_ids=tuple(step * self.B + i for i in ids),
            replicas=plan.live,
            roles={r: p.role.value for r, p in plan.plans.items()},
            faults=tuple(self._faults),
            extra_microbatches=0,
            G_cur=self.G_init,
            joined=tuple(sorted(self._joined)),
        )
        self._next_step = step + 1
        self._step = None
        self._slots = {}
        self._faults = []
        self._joined = set()
        return record


def make_policy(
    name: str,
    W_init: int,
    G_init: int,
    T: int | None = None,
    min_replicas: int = 1,
    *,
    join_as_spare: bool = True,
) -> WorkloadPolicy:
    """Build a policy by its config name ("static" or "adaptive"); ``join_as_spare`` is static's only."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "static":
        return StaticWorld(W_init, G_init, T=T, min_replicas=min_replicas, join_as_spare=join_as_spare)
    if key == "adaptive":
        if T is not None and T != W_init:
            raise ConfigurationError(
                f"AdaptiveWorld has no spares, so T must equal W_init={W_init}, got T={T}; "
                f"leave recover.target_replicas unset for the adaptive policy"
            )
        return AdaptiveWorld(W_init, G_init, min_replicas=min_replicas)
    raise ConfigurationError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)} (recover.policy)")
