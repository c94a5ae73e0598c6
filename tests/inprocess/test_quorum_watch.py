"""The quorum watch (lightning_recover.comm.quorum_watch): when it leaves, when it must not, and why leaving early is sound."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from harness.quorum_views import Cluster, clusters, view_verdict
from lightning_recover.comm.quorum_watch import QuorumWatch


class Reads:
    """A scripted ``verdict()``: one answer per read, then the last one again."""

    def __init__(self, *answers: tuple[object, str] | None) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self) -> tuple[object, str] | None:
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_leaves_on_the_second_no_quorum_of_one_world() -> None:
    watch = QuorumWatch(Reads(None, (3, "why"), (3, "why")), lambda why: None)
    assert [watch.poll(), watch.poll(), watch.poll()] == [None, None, "why"]


def test_a_new_world_between_two_reads_starts_over() -> None:
    # A repair that went on (epoch 3 -> 4) between the reads: the first verdict was of a world that is gone.
    watch = QuorumWatch(Reads((3, "old"), (4, "new"), (4, "new")), lambda why: None)
    assert [watch.poll(), watch.poll(), watch.poll()] == [None, None, "new"]


def test_a_quorum_between_two_reads_starts_over() -> None:
    watch = QuorumWatch(Reads((3, "x"), None, (3, "x"), (3, "x")), lambda why: None)
    assert [watch.poll() for _ in range(4)] == [None, None, None, "x"]


def test_no_read_while_the_world_changes_or_after_stop() -> None:
    reads = Reads((3, "x"))
    watch = QuorumWatch(reads, lambda why: None)
    assert watch.poll() is None
    with watch.changing():
        assert watch.poll() is None and reads.calls == 1  # skipped, not read
    assert watch.poll() is None  # the change reset what the first read found
    assert watch.poll() == "x"
    watch.stop()
    assert watch.poll() is None and reads.calls == 3


def test_the_thread_calls_leave_once_with_the_reason() -> None:
    left: list[str] = []
    done = threading.Event()
    watch = QuorumWatch(Reads((1, "side lost")), lambda why: (left.append(why), done.set()), period_s=0.01)
    watch.start()
    watch.start()  # idempotent: one thread
    assert done.wait(5)
    time.sleep(0.05)
    assert left == ["side lost"]


def test_bad_period_names_the_value() -> None:
    with pytest.raises(ValueError, match="period_s must be a positive number of seconds, got 0"):
        QuorumWatch(lambda: None, lambda why: None, period_s=0)


@settings(max_examples=600, deadline=None)
@given(data=st.data())
def test_no_quorum_on_fewer_deaths_means_no_quorum_on_more(data: st.DataObject) -> None:
    # The watch judges the deaths a rank knows of so far; every repair after it knows of at
    # least those (ULFM never revives a rank). Leaving early is sound only if no later view
    # of the same world can let the side go on.
    cluster: Cluster = data.draw(clusters())
    ranks = cluster.ranks()
    dead = data.draw(st.sets(st.sampled_from(ranks), min_size=1))
    known = data.draw(st.sets(st.sampled_from(sorted(dead)), min_size=1))
    leader = data.draw(st.sampled_from(ranks))
    early, later = view_verdict(cluster, known, leader), view_verdict(cluster, dead, leader)
    event(f"early view: {'goes on' if early.proceed else 'stops'}; later: {'goes on' if later.proceed else 'stops'}")
    if not early.proceed:
        assert not later.proceed, f"known {sorted(known)}: {early.reason}; all {sorted(dead)}: {later.reason}"
