"""Which side of a cut may go on training: the no-split-brain rule of every repair.

After a failure the survivors shrink to the ranks they can still reach. On one host that
set is exact: a rank missing from it has died. Across hosts it is not: a partitioned or
frozen host's ranks are declared dead by Open MPI's heartbeat detector while they live
on, and they shrink to a world of their own on their side of the cut. Both sides must
never keep training and writing, so every repair asks :func:`decide` first, and only the
side it allows continues; the other side leaves through the replica-consistency gate.

The rule, over *replicas* (the fault unit; a replica with a rank missing is gone):

* A lost replica is **certain** when one of its lost ranks ran on a host where a survivor
  runs: that survivor fences it (SIGKILL by pid, :meth:`FaultTolerantComm._fence`), so it
  can never be part of another world. A process that exited on a reachable host, a rank
  hung behind SIGSTOP on one, and every loss on a single-host job are certain.
* Every other lost replica is a **contender**: it may be alive behind a cut and may be
  repairing into a world of its own right now.
* The survivors continue iff they outnumber the contenders, or tie with them and hold the
  previous world's leader (world rank 0 is unique, so at most one side of a tie holds it).

Why this never lets two sides continue: take sides A and B of one cut. Every replica
alive on A ran on A's hosts, where B has no survivor, so all of them are contenders for
B (and vice versa): ``|contenders(B)| >= |survivors(A)|``. If both continued,
``|A| >= |contenders(A)| >= |B| >= |contenders(B)| >= |A|``, so all are equal, and both
would need the one previous leader. The property tests check it over arbitrary cuts.

What it costs: losing exactly half of the replicas, the leader among them, to a cause no
survivor can verify (a whole host lost, or partitioned, with half the job on it) stops the
other half too -- a relaunch from the newest checkpoint (``lightning-recover launch
--supervise``) takes over. Real deaths on hosts that still hold a survivor continue as
before, however many replicas they take.

Pure Python: no MPI, no torch. Ranks are logical ranks; hosts are host names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["QuorumVerdict", "certain_losses", "decide"]


@dataclass(frozen=True)
class QuorumVerdict:
    """The outcome of :func:`decide`; the same on every survivor given the same inputs."""

    proceed: bool
    survivors: tuple[int, ...]
    certain: tuple[int, ...]
    contenders: tuple[int, ...]
    leader_replica: int
    reason: str


def certain_losses(
    lost_ranks: Iterable[int],
    surviving_ranks: Iterable[int],
    host_of: Mapping[int, str],
    replica_of: Mapping[int, int],
) -> tuple[int, ...]:
    """The replicas with a lost rank on a host that still holds a surviving rank.

    Such a rank is fenced by a survivor on its host, so its replica is gone for certain.
    ``host_of`` and ``replica_of`` must know every rank given.
    """
    lost = sorted(set(lost_ranks))
    unknown = [r for r in lost if r not in host_of or r not in replica_of]
    if unknown:
        raise ValueError(f"no host or replica known for lost rank(s) {unknown}; pass every rank of the previous world")
    reachable = {host_of[r] for r in surviving_ranks}
    return tuple(sorted({replica_of[r] for r in lost if host_of[r] in reachable}))


def decide(
    previous: Iterable[int],
    survivors: Iterable[int],
    certain: Iterable[int],
    leader_replica: int,
) -> QuorumVerdict:
    """May ``survivors`` (complete replicas after the shrink) continue as the next world?

    ``previous``: the replicas of the world before the failure; ``certain``: lost replicas
    known dead (:func:`certain_losses`); ``leader_replica``: the replica of the previous
    world's rank 0.
    """
    before = set(previous)
    alive = set(survivors)
    if not alive <= before:
        raise ValueError(f"survivor replica(s) {sorted(alive - before)} were not in the previous world {sorted(before)}")
    if leader_replica not in before:
        raise ValueError(f"the previous leader's replica {leader_replica} is not in the previous world {sorted(before)}")
    dead = (before - alive) & set(certain)
    contenders = before - alive - dead
    kept = len(alive)
    leader = leader_replica in alive
    if not alive:
        proceed, why = False, "no complete replica survived"
    elif kept > len(contenders):
        proceed, why = True, f"{kept} surviving replica(s) outnumber the {len(contenders)} that may live on elsewhere"
    elif kept == len(contenders) and leader:
        proceed, why = True, f"{kept} surviving replica(s) tie with {len(contenders)} elsewhere and hold the leader's replica {leader_replica}"
    elif kept == len(contenders):
        proceed, why = False, (
            f"{kept} surviving replica(s) tie with {len(contenders)} unreachable replica(s) "
            f"{sorted(contenders)} and the leader's replica {leader_replica} is on the other side"
        )
    else:
        proceed, why = False, (
            f"only {kept} replica(s) survive and {len(contenders)} unreachable replica(s) {sorted(contenders)} "
            "may still be training"
        )
    return QuorumVerdict(proceed, tuple(sorted(alive)), tuple(sorted(dead)), tuple(sorted(contenders)), leader_replica, why)
