"""The communicator contract the step engine runs against (the collectives as in-step recovery sees them).

Two implementations keep it: :class:`lightning_recover.comm.communicator.FaultTolerantComm`
(ULFM MPI, real processes) and :class:`lightning_recover.testing.fake.FakeWorld`'s
per-replica handles (threads in one process, scripted failures) for fast tests.

The contract, for every survivor of a world epoch:

* ``allreduce`` SUM-reduces in buckets, tags each completed bucket with the current
  ``world_epoch`` and raises :class:`PeerFailure` when a peer died; it never hangs on a
  dead peer, and before raising it releases every peer blocked with it.
* ``agree(flag)`` returns the same answer on every survivor: the AND of the flags, and
  ``False`` everywhere if a failure was noticed meanwhile.
* ``repair()`` is called by every survivor after ``agree`` returned ``False``. It removes
  the dead (whole replicas only: a rank whose replica lost a member leaves through the
  replica-consistency gate and never returns from it), advances ``world_epoch`` by one and
  returns what was lost. A further death during the repair costs another round inside it.

Pure Python: no MPI, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_recover.comm.buckets import ReduceHandle
from lightning_recover.errors import RecoverError


class PeerFailure(RecoverError, RuntimeError):
    """A peer died (or the communicator was revoked because one did).

    ``lost_ranks`` are ORIGINAL world ranks known dead at this rank when the error was
    seen; the authoritative set comes from ``repair()``.
    """

    def __init__(self, lost_ranks: Sequence[int], where: str, error_class: int | None = None) -> None:
        self.lost_ranks = tuple(sorted(lost_ranks))
        self.where = where
        self.error_class = error_class
        super().__init__(f"peer failure during {where}; ranks known dead: {list(self.lost_ranks) or 'not yet known'}")


@dataclass(frozen=True)
class RepairResult:
    """What one repair did: the new world epoch and the ranks / replicas it removed."""

    world_epoch: int
    lost_ranks: tuple[int, ...]
    lost_replicas: tuple[int, ...]
    alive_replicas: tuple[int, ...]
    seconds: float
    rounds: int


class ReplicaComm(Protocol):
    """What the step engine needs from a fault-tolerant communicator (see the module docstring)."""

    rank: int  # original world rank, never changes
    replica: int
    shard: int
    world_epoch: int
    alive_replicas: tuple[int, ...]

    @property
    def members(self) -> tuple[int, ...]:
        """Original world ranks of the current world, ascending."""
        ...

    def plan(self, tensors: Sequence[Any]) -> ReduceHandle: ...

    def allreduce(
        self,
        tensors: Sequence[Any],
        out: Sequence[Any],
        *,
        handle: ReduceHandle | None = None,
        across: str = "replicas",
        on_bucket: Callable[[int], None] | None = None,
        after_bucket: Callable[[int], None] | None = None,
    ) -> ReduceHandle: ...

    def agree(self, flag: bool = True) -> bool: ...

    def repair(self) -> RepairResult: ...
