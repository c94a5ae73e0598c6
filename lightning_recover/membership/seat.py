"""A replacement's seat: the logical ranks it takes over, and what it carries of the job it joins.

The survivors (:mod:`lightning_recover.membership.recruiter`) describe each spawn in a
:class:`Seat` -- JSON in the replacement's argv, or sent over a warm standby's link -- and a
replacement process keeps it, with the communicators it was merged into, as its
:class:`Joining`; the strategy finds it with :func:`seat` (None on a rank of the original
launch). A replacement takes the *logical ranks* of a lost replica: the layout never changes.

A replacement's program sees the job it joins, not its spawn: the joiner sets
``OMPI_COMM_WORLD_SIZE`` and ``OMPI_COMM_WORLD_RANK`` to the job's size and the logical rank
taken over, and the survivors' ``LR_*`` / ``LIGHTNING_RECOVER_*`` variables
(:func:`job_environ`), before the script runs; ``MPI.COMM_WORLD`` stays the spawn's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["ORPHANS_PORT", "Joining", "Seat", "job_environ", "seat"]

#: The survivors' environment variables a replacement takes over (see :func:`job_environ`).
FORWARDED_ENV_PREFIXES = ("LR_", "LIGHTNING_RECOVER_")
#: A seat's context key, set when the orphans of a re-formed replica spawn its missing ranks
#: (salvage with re-join): the port the replica connects to the survivors on, all its ranks at once.
ORPHANS_PORT = "orphans_port"


@dataclass(frozen=True)
class Seat:
    """What a replacement is told when it is spawned (JSON in its argv)."""

    #: Logical rank of each process, in the order of the replacements' own communicator (a spawn's
    #: world; a re-formed replica's orphans, then the ranks they spawned).
    ranks: tuple[int, ...]
    attempt: int
    #: Wall-clock time the spawn started (the replacement's start-up time is measured from it).
    spawned_at: float
    #: What the survivors' setup broadcast that a replacement cannot take part in (logger versions).
    context: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"ranks": list(self.ranks), "attempt": self.attempt, "spawned_at": self.spawned_at, "context": self.context})

    @classmethod
    def from_json(cls, text: str) -> Seat:
        d = json.loads(text)
        return cls(tuple(int(r) for r in d["ranks"]), int(d["attempt"]), float(d["spawned_at"]), dict(d.get("context", {})))


@dataclass
class Joining:
    """This process is a replacement: its seat and the communicator it was merged into."""

    seat: Seat
    #: The children's own world (the replacements of this attempt), for their replica-local setup.
    children: MPI.Intracomm
    #: Survivors first, then the replacements; becomes the world at admission. A standby has
    #: none until :func:`~lightning_recover.membership.handshake.connect` (its script runs
    #: first), and makes a new one after each attempt the survivors' own repair dropped.
    merged: MPI.Intracomm | None
    #: A standby's link: the leader that spawned it (rank 0), then its own processes.
    link: MPI.Intracomm | None = None

    @property
    def rank(self) -> int:
        """This process's logical rank."""
        return self.seat.ranks[self.children.Get_rank()]


_joining: Joining | None = None


def seat() -> Joining | None:
    """The seat this process was spawned into, or None for a rank of the original launch."""
    return _joining


def _set_joining(joining: Joining) -> None:
    global _joining
    _joining = joining


def job_environ() -> dict[str, str]:
    """This survivor's variables named ``LR_*`` or ``LIGHTNING_RECOVER_*``, for the seat of a replacement.

    The job's own settings, which the survivors may have resolved while running (for one,
    ``examples/pretrain.py`` fixes ``LR_RUN_STAMP``, its run directory, once rank 0's start
    time is known): a replacement starts later and from mpiexec's environment, and would
    otherwise resolve them differently (another run directory, another checkpoint dir).
    The joiner sets them before the script runs (:mod:`lightning_recover.cli.joiner`)."""
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
