"""Where a replacement's start-up time goes, from the loss to its first step.

Each replacement prints one line as its first step starts, from the milestones it reached
(:data:`MILESTONES`, recorded by :func:`mark` in this process, put together by
:func:`breakdown`): spawn to Python, MPI and merge, (standby) imports and wait, the script's
imports and set-up, model and optimizer, (standby) merge, the wait for a step boundary, the
growth and transfer, and the total since the loss. The leader's "re-joined" line says how
long after the loss. Nothing here takes part in the protocol: it only measures it.
"""

from __future__ import annotations

import time

__all__ = ["MILESTONES", "breakdown", "mark"]

#: Wall-clock times (``time.time()``) of this replacement's start-up milestones, see :func:`mark`.
_marks: dict[str, float] = {}

#: The milestones of a replacement, in order, with what the time up to each went to.
MILESTONES: tuple[tuple[str, str], ...] = (
    ("python", "spawn to Python"),
    ("merged", "MPI start and merge"),
    ("warm", "standby imports"),
    ("seated", "standby waiting for a loss"),
    ("strategy", "script imports and set-up"),
    ("ready", "model, optimizer, Lightning set-up"),
    ("connected", "standby merge"),
    ("go", "waiting for a step boundary"),
    ("state", "world growth and state transfer"),
    ("first_step", "Lightning's restore, first step begins"),
)


def mark(milestone: str) -> None:
    """Record when this replacement reached ``milestone`` (one of :data:`MILESTONES`; a repeat keeps the latest)."""
    if milestone not in dict(MILESTONES):
        raise ValueError(f"unknown re-join milestone {milestone!r}; use one of {[m for m, _ in MILESTONES]}")
    _marks[milestone] = time.time()


def breakdown(spawned_at: float, lost_at: float | None) -> str:
    """Where this replacement's start-up time went, one phrase per milestone reached, for its log line
    (a standby counts from its own spawn, not from its seat's)."""
    parts, prev = [], _marks.get("spawned", spawned_at)
    for key, what in MILESTONES:
        if key in _marks:
            parts.append(f"{what} {_marks[key] - prev:.2f} s")
            prev = _marks[key]
    since = f"; {prev - lost_at:.2f} s after the loss" if lost_at is not None else ""
    return ", ".join(parts) + since
