"""What a workload policy decides: each replica's share of a step, and the record of its commit (ReCoVer's versatile workload).

A policy (:mod:`lightning_recover.workload.policy`) hands every rank the same
:class:`StepPlan` for a step -- each live replica's :class:`ReplicaPlan`: its :class:`Role`,
the step-local microbatch ids whose gradients it must hold when the step commits, whether
they count in the sum -- and, when the step commits, the :class:`CommitRecord` the leader's
ledger line is built from. The step engine reads these; nothing here changes them (the plans
are frozen, so a plan handed out stays the plan every rank agreed on).

Cost at scale: a live set's steady plan is a :class:`Membership`, built once per membership
change (O(W) at worst, in C-speed sorts), from which any replica's share is arithmetic
(O(log W)). A step's plan is that membership plus the few replicas a failure changed, so a
steady step costs O(1) per rank whatever the number of replicas, and its commit record holds
ranges and counts, not every id and role (the full form is computed only when asked for).

The errors of the workload protocol live here too, beside the plans that raise them:
:class:`PolicyError` (misuse of the protocol), :class:`TooFewReplicasError` (the live replicas
can no longer run the job) and :class:`ReplicaNotLiveError` (a plan asked about a replica that
is not in it). Pure Python: no torch, no MPI.
"""

from __future__ import annotations

import bisect
import enum
import heapq
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from lightning_recover.errors import RecoverError

__all__ = [
    "CommitRecord",
    "Membership",
    "PolicyError",
    "ReplicaNotLiveError",
    "ReplicaPlan",
    "Role",
    "StepPlan",
    "TooFewReplicasError",
    "expand_ranges",
    "ranges_of",
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



def ranges_of(sorted_ints: Sequence[int]) -> list[tuple[int, int]]:
    """The runs of a sorted sequence of distinct ints, as half-open ``(lo, hi)`` ranges.

    Bisects on contiguity, so k runs cost O(k log n) Python steps, not O(n): a live set of
    32k replicas with a few failures is a handful of comparisons."""
    out: list[tuple[int, int]] = []
    stack = [(0, len(sorted_ints))]
    while stack:
        a, b = stack.pop()
        if a >= b:
            continue
        if sorted_ints[b - 1] - sorted_ints[a] == b - 1 - a:
            lo, hi = sorted_ints[a], sorted_ints[b - 1] + 1
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
            continue
        mid = (a + b) // 2
        stack.append((mid, b))  # popped after the left half: runs come out in order
        stack.append((a, mid))
    return out


def expand_ranges(ranges: Iterable[Sequence[int]]) -> list[int]:
    """The ints of half-open ranges, in order (the inverse of :func:`ranges_of`)."""
    out: list[int] = []
    for lo, hi in ranges:
        out.extend(range(lo, hi))
    return out


@dataclass(frozen=True)
class Membership:
    """One live set's steady plan, from which every replica's share is arithmetic.

    The plan order is ``veterans`` then ``joiners`` (each sorted): position ``i`` below
    ``n_major`` is a major with ids ``[i*G, (i+1)*G)``, position ``n_major`` is the minor
    (``minor``) with ``[n_major*G, B)``, and each later position ``n_contrib + j`` is a spare
    shadowing the contributor at position ``j % n_contrib``. With ``fixed`` (AdaptiveWorld)
    every replica is a major owning ``[r*G, (r+1)*G)`` by its own index instead. Built once
    per membership change; it is also the record a ledger writes once per change
    (:meth:`to_json`) and every steady line refers to.
    """

    B: int
    G: int
    veterans: tuple[int, ...]
    joiners: tuple[int, ...] = ()
    n_major: int = 0
    minor: bool = False
    fixed: bool = False

    @property
    def n(self) -> int:
        return len(self.veterans) + len(self.joiners)

    @property
    def n_contrib(self) -> int:
        return self.n_major + int(self.minor)

    @cached_property
    def live(self) -> tuple[int, ...]:
        """The members, sorted (the plan order may differ when replicas joined)."""
        if not self.joiners:
            return self.veterans
        return tuple(heapq.merge(self.veterans, self.joiners))

    @cached_property
    def _sorted_by_role(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        # The contributors and the spares, each sorted by replica (the replay's tie order).
        order = (*self.veterans, *self.joiners) if self.joiners else self.veterans
        k = self.n_contrib
        return tuple(sorted(order[:k])), tuple(sorted(order[k:]))

    def contributors_sorted(self) -> tuple[int, ...]:
        return self._sorted_by_role[0]

    def spares_sorted(self) -> tuple[int, ...]:
        return self._sorted_by_role[1]

    def position(self, r: int) -> int | None:
        """Where replica ``r`` is in the plan order, or None if it is not a member."""
        for base, part in ((0, self.veterans), (len(self.veterans), self.joiners)):
            i = bisect.bisect_left(part, r)
            if i < len(part) and part[i] == r:
                return base + i
        return None

    def replica_at(self, i: int) -> int:
        nv = len(self.veterans)
        return self.veterans[i] if i < nv else self.joiners[i - nv]

    def __contains__(self, r: object) -> bool:
        return isinstance(r, int) and self.position(r) is not None

    def role_at(self, i: int) -> Role:
        if self.fixed or i < self.n_major:
            return Role.MAJOR
        if self.minor and i == self.n_major:
            return Role.MINOR
        return Role.MAJOR_SPARE if (i - self.n_contrib) % self.n_contrib < self.n_major else Role.MINOR_SPARE

    def base_at(self, i: int) -> range:
        """The steady ids of the contributor at position ``i`` (< n_contrib)."""
        if self.fixed:
            r = self.replica_at(i)
            return range(r * self.G, (r + 1) * self.G)
        if i < self.n_major:
            return range(i * self.G, (i + 1) * self.G)
        return range(self.n_major * self.G, self.B)

    def plan_of(self, r: int) -> ReplicaPlan:
        """Replica ``r``'s steady share; KeyError if it is not a member."""
        i = self.position(r)
        if i is None:
            raise KeyError(r)
        if self.fixed or i < self.n_contrib:
            return ReplicaPlan(r, self.role_at(i), tuple(self.base_at(i)), True, None)
        t = (i - self.n_contrib) % self.n_contrib
        return ReplicaPlan(r, self.role_at(i), tuple(self.base_at(t)), False, self.replica_at(t))

    def roles(self) -> dict[int, Role]:
        """Every member's steady role (O(W): for records and reports, never a step's hot path)."""
        order = (*self.veterans, *self.joiners)
        return {r: self.role_at(i) for i, r in enumerate(order)}

    def to_json(self) -> dict[str, Any]:
        """The record a ledger writes once per membership (ranges and counts, whatever W)."""
        return {
            "veterans": [list(x) for x in ranges_of(self.veterans)],
            "joiners": [list(x) for x in ranges_of(self.joiners)],
            "B": self.B,
            "G": self.G,
            "n_major": self.n_major,
            "minor": self.minor,
            "fixed": self.fixed,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Membership:
        return cls(
            B=int(d["B"]),
            G=int(d["G"]),
            veterans=tuple(expand_ranges(d["veterans"])),
            joiners=tuple(expand_ranges(d.get("joiners", ()))),
            n_major=int(d["n_major"]),
            minor=bool(d["minor"]),
            fixed=bool(d.get("fixed", False)),
        )


class _PlansView(Mapping[int, ReplicaPlan]):
    """Every live replica's plan, computed on access from the membership and the step's changes."""

    __slots__ = ("_m", "_changes", "_dead")

    def __init__(self, membership: Membership, changes: Mapping[int, ReplicaPlan], dead: frozenset[int]) -> None:
        self._m, self._changes, self._dead = membership, changes, dead

    def __getitem__(self, r: int) -> ReplicaPlan:
        if r in self._dead:
            raise KeyError(r)
        found = self._changes.get(r)
        return found if found is not None else self._m.plan_of(r)

    def __contains__(self, r: object) -> bool:
        return r not in self._dead and r in self._m

    def __iter__(self) -> Iterator[int]:
        return (r for r in self._m.live if r not in self._dead)

    def __len__(self) -> int:
        return self._m.n - len(self._dead)

    def __repr__(self) -> str:
        return repr(dict(self))


@dataclass(frozen=True, eq=False)
class StepPlan:
    """The plan of every live replica for one step, as all ranks agree on it.

    ``membership`` is the steady plan the step began with, ``changes`` the replicas whose
    share a failure changed, ``dead`` the members lost in the step: so a steady step's plan
    is O(1) to make, and ``plans`` computes any replica's share on access.
    """

    step: int
    B: int
    membership: Membership
    divisor: int
    G_cur: int
    G_ext: int
    # Step-local ids currently being replayed by survivors (the boundary step's lost set).
    replayed: tuple[int, ...] = ()
    changes: Mapping[int, ReplicaPlan] = field(default_factory=dict)
    dead: frozenset[int] = frozenset()

    @property
    def plans(self) -> Mapping[int, ReplicaPlan]:
        return _PlansView(self.membership, self.changes, self.dead)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepPlan):
            return NotImplemented
        scalars = (self.step, self.B, self.divisor, self.G_cur, self.G_ext, self.replayed)
        return scalars == (other.step, other.B, other.divisor, other.G_cur, other.G_ext, other.replayed) and dict(
            self.plans
        ) == dict(other.plans)

    __hash__ = None  # type: ignore[assignment]

    def for_replica(self, r: int) -> ReplicaPlan:
        try:
            return self.plans[r]
        except KeyError:
            raise ReplicaNotLiveError(
                f"replica {r} is not live in the plan of step {self.step} "
                f"(live: {_short(self.live)}); it has failed or was never part of the job"
            ) from None

    @property
    def live(self) -> tuple[int, ...]:
        if not self.dead:
            return self.membership.live
        return tuple(r for r in self.membership.live if r not in self.dead)

    def shadowing(self) -> dict[int, int]:
        """Every live spare -> the contributor it shadows: O(spares), not O(W)."""
        m, out = self.membership, {}
        if not m.fixed:
            for pos in range(m.n_contrib, m.n):
                r = m.replica_at(pos)
                if r not in self.changes and r not in self.dead:
                    out[r] = m.replica_at((pos - m.n_contrib) % m.n_contrib)
        for r, p in self.changes.items():
            if not p.contributes and p.shadows is not None:
                out[r] = p.shadows
        return out

    @property
    def contributors(self) -> tuple[int, ...]:
        plans = self.plans
        return tuple(r for r in plans if plans[r].contributes)

    @property
    def committed_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for p in self.plans.values():
            if p.contributes:
                ids.extend(p.ids)
        return tuple(sorted(ids))


def _short(replicas: Sequence[int], limit: int = 16) -> str:
    """A replica list for a message: all of a small one, the ends of a large one."""
    if len(replicas) <= limit:
        return str(list(replicas))
    return f"[{', '.join(map(str, replicas[:8]))}, ... ({len(replicas)} in all)]"


@dataclass(frozen=True)
class CommitRecord:
    """What a committed step applied; the ledger line is built from it.

    `faults` includes replicas found dead between the previous commit and this step's
    begin_step; `joined` the replicas admitted in that interval (a joiner that died before
    the step began is in both). `extra_microbatches` counts the replayed ids the committing
    replicas hold (the boundary step's B - C_cur); a replayer that died mid-replay is not
    counted.

    The record is compact: the committed ids as ranges, the step's :class:`Membership`
    (shared by every step of that membership, written to the ledger only by the first:
    ``defines``) and the roles a failure changed. ``microbatch_ids``, ``replicas`` and
    ``roles`` give the full form on demand (O(B) and O(W): tests and reports, not steps).
    """

    step: int
    B: int
    committed: int
    id_ranges: tuple[tuple[int, int], ...]
    membership: Membership
    #: The step whose line defines ``membership`` (the first step committed with it).
    membership_since: int
    faults: tuple[int, ...]
    extra_microbatches: int
    G_cur: int
    #: Replicas admitted by join() at the boundary before this step (see :mod:`lightning_recover.workload.policy`).
    joined: tuple[int, ...] = ()
    #: Live replicas whose role at the commit is not their role in ``membership``.
    role_changes: Mapping[int, Role] = field(default_factory=dict)
    #: Members of ``membership`` lost inside the step (the rest of ``faults`` were gone before it).
    died: tuple[int, ...] = ()

    @property
    def defines(self) -> bool:
        return self.membership_since == self.step

    @property
    def microbatch_ids(self) -> tuple[int, ...]:
        return tuple(expand_ranges(self.id_ranges))

    @property
    def replicas(self) -> tuple[int, ...]:
        if not self.died:
            return self.membership.live
        gone = set(self.died)
        return tuple(r for r in self.membership.live if r not in gone)

    @property
    def roles(self) -> dict[int, str]:
        gone = set(self.died)
        roles = {r: role for r, role in self.membership.roles().items() if r not in gone}
        roles.update(self.role_changes)
        return {r: roles[r].value for r in sorted(roles)}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields of the ledger line: ranges and counts, under 1 kB in a steady step.

        ``membership`` names the step whose line holds the membership (``members``);
        lines that change roles (a failure) list the changes in ``role_changes``.
        """
        d: dict[str, Any] = {
            "step": self.step,
            "B": self.B,
            "committed": self.committed,
            "ids": [list(x) for x in self.id_ranges],
            "membership": self.membership_since,
            "faults": list(self.faults),
            "extra_microbatches": self.extra_microbatches,
            "G_cur": self.G_cur,
            "joined": list(self.joined),
        }
        if self.defines:
            d["members"] = self.membership.to_json()
        if self.died:
            d["died"] = list(self.died)
        if self.role_changes:
            d["role_changes"] = {str(r): role.value for r, role in sorted(self.role_changes.items())}
        return d
