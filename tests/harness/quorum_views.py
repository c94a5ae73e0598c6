"""Clusters for the quorum rule's property tests: W replicas x S shards placed on hosts, and one rank's view of its deaths."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from hypothesis import strategies as st

from lightning_recover.comm.quorum import QuorumVerdict, certain_losses, decide


@dataclass(frozen=True)
class Cluster:
    replicas: int
    shards: int
    host_of: dict[int, str]  # rank -> host

    def replica_of(self) -> dict[int, int]:
        return {r: r // self.shards for r in self.host_of}

    def ranks(self) -> list[int]:
        return sorted(self.host_of)

    def complete(self, present: Iterable[int]) -> list[int]:
        """The replicas all of whose ranks are in ``present``."""
        here = set(present)
        return [q for q in range(self.replicas) if all(r in here for r in range(q * self.shards, (q + 1) * self.shards))]


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    replicas = draw(st.integers(1, 6))
    shards = draw(st.integers(1, 3))
    hosts = [f"node{i}" for i in range(draw(st.integers(1, 4)))]
    placement = {r: draw(st.sampled_from(hosts)) for r in range(replicas * shards)}
    return Cluster(replicas, shards, placement)


def view_verdict(cluster: Cluster, dead: Iterable[int], leader: int) -> QuorumVerdict:
    """The rule on a view that knows ``dead`` are gone and takes every other rank for alive and reachable,
    as the repair (and the quorum watch) of ``FaultTolerantComm`` compute it."""
    lost = sorted(set(dead))
    present = [r for r in cluster.ranks() if r not in lost]
    certain = certain_losses(lost, present, cluster.host_of, cluster.replica_of())
    return decide(range(cluster.replicas), cluster.complete(present), certain, cluster.replica_of()[leader])
