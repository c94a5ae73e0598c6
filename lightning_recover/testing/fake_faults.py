"""The simulated world's failure script and how a simulated rank ends: Kill, Died, RankDeath.

Role in the recovery protocol: fault injection for :class:`~lightning_recover.testing.fake.FakeWorld`.
A :class:`Kill` names the point of a rank's own communicator calls where it dies (a
reduction's bucket, a world allreduce, an agreement, a repair's round, a merge, a
replacement's join), so a test can drive the step engine through every failure point the
real protocol must survive. A simulated rank that ends, scripted or through the
replica-consistency gate or by crashing, unwinds with :class:`RankDeath` carrying its
:class:`Died`: a ``BaseException``, like the SIGKILL it stands for.

Plain records; no torch, no threads, no MPI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Died", "Kill", "KILL_POINTS", "RankDeath"]

#: Where a :class:`Kill` can strike (see its docstring).
KILL_POINTS = ("bucket", "world", "agree", "repair", "merge", "join")


@dataclass(frozen=True)
class Died:
    """How a simulated rank ended: ``killed`` (scripted), ``gate`` (its replica lost a member) or ``crashed``."""

    rank: int
    how: str
    where: str
    error: BaseException | None = field(default=None, compare=False)
    #: Which incarnation of the rank: 0 the original, n its n-th replacement (FakeWorld.spawn).
    life: int = 0


class RankDeath(BaseException):
    """Unwinds a simulated rank's thread: it was killed or left through the gate.

    A ``BaseException`` like the SIGKILL it stands for: ``except Exception`` in the code
    under test does not catch it.
    """

    def __init__(self, died: Died) -> None:
        self.died = died
        super().__init__(f"rank {died.rank} {died.how}: {died.where}")


@dataclass(frozen=True)
class Kill:
    """Kill ``rank`` at a point of its own communicator calls (each kind counted per rank, from 1).

    ``at="bucket"``: before bucket ``bucket`` of its ``call``-th reduction across replicas
    (one per reduction round: a repair's re-reduce is the next call). ``at="world"``:
    before its ``call``-th allreduce across the world (the engine's loss reduction, or a
    collective between steps). ``at="agree"``: entering its ``call``-th agreement, before
    it contributes. ``at="repair"``: inside its ``call``-th repair, in round ``round``,
    after the shrink and before the agreement (the real communicator's
    ``fault_hook("repair:shrunk")``). ``at="merge"``: entering its ``call``-th merge.
    ``at="join"``: a replacement entering join, before it is ready (a death in start-up).
    ``life`` picks the incarnation of ``rank`` (0 the original, 1 its first replacement, ...).

    ``mid=True`` (``bucket`` and ``world`` only): the rank dies *during* that collective,
    after its data went in: the ranks below it get the sum, the others PeerFailure, as
    when a real allreduce breaks after part of the world has its result.
    """

    rank: int
    at: str
    call: int = 1
    bucket: int = 0
    round: int = 1
    mid: bool = False
    life: int = 0

    def __post_init__(self) -> None:
        if self.at not in KILL_POINTS:
            raise ValueError(f"Kill.at must be one of {', '.join(KILL_POINTS)}, got {self.at!r}")
        for name in ("call", "round"):
            if getattr(self, name) < 1:
                raise ValueError(f"Kill.{name} counts from 1, got {getattr(self, name)}")
        if self.bucket < 0:
            raise ValueError(f"Kill.bucket is a bucket index (>= 0), got {self.bucket}")
        if self.mid and self.at not in ("bucket", "world"):
            raise ValueError(f"Kill.mid applies to a reduction (at='bucket' or 'world'), not at={self.at!r}")
        if self.life < 0:
            raise ValueError(f"Kill.life is an incarnation (0 the original rank), got {self.life}")
        if self.at == "join" and self.life == 0:
            raise ValueError("Kill(at='join') strikes a replacement: give life >= 1 (the original ranks never join)")
