"""The no-split-brain rule (lightning_recover.comm.quorum) over arbitrary clusters and cuts.

A cluster is hosts holding the ranks of W replicas x S shards. A failure is any mix of
ranks killed on live hosts, whole hosts lost, and a cut that splits the remaining hosts
into sides that cannot reach each other. Every side runs the rule on what it can see, as
each survivor does inside ``FaultTolerantComm.repair``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from harness.quorum_views import Cluster, clusters
from lightning_recover.comm.quorum import certain_losses, decide


@dataclass(frozen=True)
class Failure:
    killed: frozenset[int]  # ranks dead on hosts that stay up
    lost_hosts: frozenset[str]  # hosts gone with every rank on them
    sides: tuple[frozenset[str], ...]  # the live hosts, split by the cut


@st.composite
def failures(draw: st.DrawFn, cluster: Cluster) -> Failure:
    hosts = sorted(set(cluster.host_of.values()))
    lost = frozenset(h for h in hosts if draw(st.booleans()) and draw(st.booleans()))
    live = [h for h in hosts if h not in lost]
    side_of = {h: draw(st.integers(0, 2)) for h in live}
    sides = tuple(frozenset(h for h in live if side_of[h] == s) for s in sorted(set(side_of.values())))
    killed = frozenset(r for r in cluster.ranks() if cluster.host_of[r] in live and draw(st.integers(0, 4)) == 0)
    return Failure(killed, lost, sides)


def verdict_of_side(cluster: Cluster, failure: Failure, side: frozenset[str], leader: int):
    """What the survivors on ``side`` decide, from what they can see."""
    replica_of = cluster.replica_of()
    present = [r for r in cluster.ranks() if cluster.host_of[r] in side and r not in failure.killed]
    lost = sorted(set(cluster.ranks()) - set(present))
    complete = cluster.complete(present)
    certain = certain_losses(lost, present, cluster.host_of, replica_of)
    return decide(range(cluster.replicas), complete, certain, replica_of[leader])


@settings(max_examples=600, deadline=None)
@given(data=st.data())
def test_at_most_one_side_continues(data: st.DataObject) -> None:
    cluster = data.draw(clusters())
    failure = data.draw(failures(cluster))
    leader = data.draw(st.sampled_from(cluster.ranks()))
    going = [side for side in failure.sides if verdict_of_side(cluster, failure, side, leader).proceed]
    event(f"{len(failure.sides)} side(s), {len(going)} continue(s)")
    assert len(going) <= 1, f"split brain: sides {going} both continue"


@settings(max_examples=400, deadline=None)
@given(data=st.data(), one_host=st.booleans())
def test_real_deaths_next_to_a_survivor_never_stop_the_job(data: st.DataObject, one_host: bool) -> None:
    # No cut and no host lost, and every dead rank shares a host with a survivor (always so
    # on one host): every death is certain, so any complete replica goes on, however many
    # replicas died -- a one-host job behaves as it always did.
    cluster = data.draw(clusters())
    if one_host:
        cluster = Cluster(cluster.replicas, cluster.shards, {r: "node0" for r in cluster.host_of})
    killed = frozenset(data.draw(st.sets(st.sampled_from(cluster.ranks()))))
    kept_hosts = {cluster.host_of[r] for r in cluster.ranks() if r not in killed}
    assume(all(cluster.host_of[r] in kept_hosts for r in killed))
    hosts = frozenset(cluster.host_of.values())
    failure = Failure(killed, frozenset(), (hosts,))
    leader = data.draw(st.sampled_from(cluster.ranks()))
    verdict = verdict_of_side(cluster, failure, hosts, leader)
    event(f"{len(verdict.certain)} certain loss(es)")
    assert verdict.proceed == bool(verdict.survivors), verdict.reason
    assert verdict.contenders == ()


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_a_strict_majority_always_continues(data: st.DataObject) -> None:
    cluster = data.draw(clusters())
    failure = data.draw(failures(cluster))
    leader = data.draw(st.sampled_from(cluster.ranks()))
    for side in failure.sides:
        verdict = verdict_of_side(cluster, failure, side, leader)
        if 2 * len(verdict.survivors) > cluster.replicas:
            assert verdict.proceed, verdict.reason


def test_even_split_goes_to_the_leaders_side() -> None:
    cluster = Cluster(4, 1, {0: "a", 1: "a", 2: "b", 3: "b"})
    cut = Failure(frozenset(), frozenset(), (frozenset({"a"}), frozenset({"b"})))
    a = verdict_of_side(cluster, cut, frozenset({"a"}), leader=0)
    b = verdict_of_side(cluster, cut, frozenset({"b"}), leader=0)
    assert a.proceed and not b.proceed
    assert b.contenders == (0, 1) and "leader" in b.reason


def test_minority_host_cut_off_stops_and_majority_goes_on() -> None:
    cluster = Cluster(3, 1, {0: "a", 1: "b", 2: "c"})
    cut = Failure(frozenset(), frozenset(), (frozenset({"a", "b"}), frozenset({"c"})))
    assert verdict_of_side(cluster, cut, frozenset({"a", "b"}), leader=2).proceed
    alone = verdict_of_side(cluster, cut, frozenset({"c"}), leader=2)
    assert not alone.proceed and alone.contenders == (0, 1)


def test_half_lost_with_the_leader_on_an_unreachable_host_stops() -> None:
    # Two hosts, the leader's host gone: the survivors cannot tell a lost host from a cut.
    cluster = Cluster(2, 1, {0: "a", 1: "b"})
    gone = Failure(frozenset(), frozenset({"a"}), (frozenset({"b"}),))
    verdict = verdict_of_side(cluster, gone, frozenset({"b"}), leader=0)
    assert not verdict.proceed and verdict.contenders == (0,)


def test_a_killed_rank_next_to_a_survivor_is_certain() -> None:
    cluster = Cluster(2, 1, {0: "a", 1: "a"})
    verdict = verdict_of_side(cluster, Failure(frozenset({0}), frozenset(), (frozenset({"a"}),)), frozenset({"a"}), leader=0)
    assert verdict.proceed and verdict.certain == (0,) and verdict.contenders == ()


def test_bad_inputs_name_the_value() -> None:
    with pytest.raises(ValueError, match=r"survivor replica\(s\) \[5\]"):
        decide([0, 1], [5], [], 0)
    with pytest.raises(ValueError, match="leader's replica 7"):
        decide([0, 1], [0], [], 7)
    with pytest.raises(ValueError, match=r"lost rank\(s\) \[3\]"):
        certain_losses([3], [0], {0: "a"}, {0: 0})
