"""What a workload policy decides: each replica's share of a step, and the record of its commit (layer 3).

A policy (:mod:`lightning_recover.workload.policy`) hands every rank the same
:class:`StepPlan` for a step -- each live replica's :class:`ReplicaPlan`: its :class:`Role`,
the step-local microbatch ids whose gradients it must hold when the step commits, whether
they count in the sum -- and, when the step commits, the :class:`CommitRecord` the leader's
ledger line is built from. The step engine reads these; nothing here changes them (the plans
are frozen, so a plan handed out stays the plan every rank agreed on).

The errors of the workload protocol live here too, beside the plans that raise them:
:class:`PolicyError` (misuse of the protocol), :class:`TooFewReplicasError` (the live replicas
can no longer run the job) and :class:`ReplicaNotLiveError` (a plan asked about a replica that
is not in it). Pure Python: no torch, no MPI.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_recover.errors import RecoverError

__all__ = [
    "CommitRecord",
    "PolicyError",
    "ReplicaNotLiveError",
    "ReplicaPlan",
    "Role",
    "StepPlan",
    "TooFewReplicasError",
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
    #: Replicas admitted by join() at the boundary before this step (see :mod:`lightning_recover.workload.policy`).
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
