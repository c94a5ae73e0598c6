"""How step collectives wait (lightning_recover.comm.mpi_wait): the oversubscription rule, the override, the TCP cap, the loop."""

from __future__ import annotations

import pytest

from lightning_recover.comm import mpi_wait


def test_oversubscribed_compares_the_hosts_ranks_with_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert mpi_wait.oversubscribed()
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    assert not mpi_wait.oversubscribed()
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE")
    assert not mpi_wait.oversubscribed()  # not launched by Open MPI: the plain blocking wait


def test_the_environment_overrides_the_local_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    assert mpi_wait.local_choice()
    monkeypatch.setenv("LIGHTNING_RECOVER_MPI_WAIT", "spin")
    assert not mpi_wait.local_choice()
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    monkeypatch.setenv("LIGHTNING_RECOVER_MPI_WAIT", "Sleep")
    assert mpi_wait.local_choice()
    monkeypatch.setenv("LIGHTNING_RECOVER_MPI_WAIT", "yield")
    with pytest.raises(ValueError, match="LIGHTNING_RECOVER_MPI_WAIT must be auto, spin or sleep, got 'yield'; unset it"):
        mpi_wait.local_choice()


def test_the_world_waits_one_way_polite_if_any_member_would(monkeypatch: pytest.MonkeyPatch) -> None:
    # A blocking and a non-blocking collective never match: every member must adopt one choice.
    monkeypatch.setattr(mpi_wait, "_agreed", None)
    monkeypatch.setenv("LIGHTNING_RECOVER_MPI_WAIT", "spin")
    assert not mpi_wait.polite()  # no world yet: this rank's own choice
    assert mpi_wait.agree([False, True, False]) and mpi_wait.polite()  # the local choice no longer counts
    assert not mpi_wait.agree(iter([False, False])) and not mpi_wait.polite()


def test_the_sleeps_cap_drops_once_a_member_is_reached_over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    # A spawned replacement is another MPI job (its own PMIx namespace): Open MPI reaches it over
    # TCP, where every hop of a collective waits for its receiver's next test.
    monkeypatch.setattr(mpi_wait, "_agreed", None)
    monkeypatch.setattr(mpi_wait, "_max_pause", mpi_wait.MAX_PAUSE_S)
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-host-1@1")
    job = mpi_wait.reach()
    assert job.endswith("/prterun-host-1@1")
    monkeypatch.setenv("PMIX_NAMESPACE", "prterun-host-1@2")
    spawned = mpi_wait.reach()
    mpi_wait.agree([True] * 4, [job] * 4)
    assert mpi_wait.max_pause() == mpi_wait.MAX_PAUSE_S  # one job, one host: shared memory
    mpi_wait.agree([True] * 4, iter([job, job, spawned, spawned]))
    assert mpi_wait.max_pause() == mpi_wait.MAX_PAUSE_TCP_S < mpi_wait.MAX_PAUSE_S
    pauses: list[float] = []
    monkeypatch.setattr(mpi_wait.time, "sleep", pauses.append)
    mpi_wait.wait(Request(mpi_wait.SPIN_TESTS + 30))
    assert max(pauses) == mpi_wait.MAX_PAUSE_TCP_S
    mpi_wait.agree([True, True], ["other-host/prterun-host-1@1", job])  # another host: TCP as well
    assert mpi_wait.max_pause() == mpi_wait.MAX_PAUSE_TCP_S
    mpi_wait.agree([True, True], [job, job])  # the spawned members left: shared memory again
    assert mpi_wait.max_pause() == mpi_wait.MAX_PAUSE_S


class Request:
    """An MPI request stand-in that completes (or fails) at its n-th test."""

    def __init__(self, n: int, error: Exception | None = None) -> None:
        self.n, self.tests, self.error = n, 0, error

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.tests += 1
        if self.tests == self.n and self.error is not None:
            raise self.error
        return self.tests >= self.n


def test_wait_tests_until_done_and_sleeps_with_bounded_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mpi_wait, "_max_pause", mpi_wait.MAX_PAUSE_S)
    pauses: list[float] = []
    monkeypatch.setattr(mpi_wait.time, "sleep", pauses.append)
    req = Request(mpi_wait.SPIN_TESTS + 20)
    mpi_wait.wait(req)
    assert req.tests == mpi_wait.SPIN_TESTS + 20
    assert len(pauses) == 19  # no sleep during the first burst, one per failed test after it
    assert pauses[0] == 0.0 and all(mpi_wait.MIN_PAUSE_S <= p <= mpi_wait.MAX_PAUSE_S for p in pauses[1:])
    assert pauses[-1] == mpi_wait.MAX_PAUSE_S
    quick = Request(1)
    mpi_wait.wait(quick)
    assert quick.tests == 1


def test_wait_raises_what_the_test_raises() -> None:
    with pytest.raises(RuntimeError, match="peer died"):
        mpi_wait.wait(Request(3, RuntimeError("peer died")))
