"""The first step's wait for warm standbys (WarmStandbys.await_warm), against a fake leader: no MPI.

``tend`` is what the leader runs at every poll; here a fake one makes standbys warm, or
forgets them, after a number of polls, as the real one does when they say WARM or die.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_recover.membership import standby as standby_module
from lightning_recover.membership.standby import Standby, WarmStandbys


class FakeLeader(WarmStandbys):
    """WarmStandbys with a scripted ``tend``: poll k -> standbys that become warm / are forgotten."""

    def __init__(self, shards: int, standbys: int, *, warm_at: dict[int, int], lost_at: dict[int, int] | None = None,
                 leader: bool = True) -> None:
        self.comm = SimpleNamespace(is_leader=leader)  # type: ignore[assignment]
        self.shards, self.standbys = shards, standbys
        self.pool = [Standby(n) for n in range(1, standbys + 1)]
        self.seated = []
        self.warm_at, self.lost_at = warm_at, lost_at or {}
        self.polls = 0

    def tend(self, *, training: bool = True) -> None:
        assert not training, "the wait tends the standbys as during set-up"
        self.polls += 1
        for sb in list(self.pool):
            if self.warm_at.get(sb.number) == self.polls:
                sb.warm = set(range(1, self.shards + 1))
            if self.lost_at.get(sb.number) == self.polls:
                self.pool.remove(sb)


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(standby_module, "STANDBY_WAIT_POLL_S", 0.001)


def test_waits_until_every_standby_is_warm_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    leader = FakeLeader(2, 2, warm_at={1: 3, 2: 7})
    leader.await_warm(60.0)
    assert leader.polls == 7
    assert "2 warm standby(s) ready" in capsys.readouterr().err


def test_a_standby_that_dies_is_not_waited_for(capsys: pytest.CaptureFixture[str]) -> None:
    leader = FakeLeader(1, 2, warm_at={1: 2}, lost_at={2: 4})
    leader.await_warm(60.0)
    assert leader.polls == 4 and [sb.number for sb in leader.pool] == [1]
    assert "1 warm standby(s) ready" in capsys.readouterr().err


def test_a_standby_that_never_warms_costs_at_most_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    leader = FakeLeader(2, 2, warm_at={1: 1})
    leader.await_warm(0.2)
    err = capsys.readouterr().err
    assert "1 standby(s) not warm after 0.2 s (recover.rejoin.standbys_wait_s): training starts" in err
    assert "ready" not in err


def test_progress_is_shown_during_a_long_wait(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(standby_module, "STANDBY_WAIT_SHOW_S", 0.05)
    leader = FakeLeader(1, 1, warm_at={})
    leader.await_warm(0.3)
    err = capsys.readouterr().err
    assert "waiting for 1 standby(s) to be warm" in err and "of at most 0.3 s" in err


@pytest.mark.parametrize(("leader", "standbys", "limit"), [(False, 2, 60.0), (True, 0, 60.0), (True, 2, 0.0)])
def test_no_wait_off_the_leader_without_standbys_or_with_a_zero_limit(leader: bool, standbys: int, limit: float) -> None:
    fake = FakeLeader(1, standbys, warm_at={}, leader=leader)
    fake.await_warm(limit)
    assert fake.polls == 0
