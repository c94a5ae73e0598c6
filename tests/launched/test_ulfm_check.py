"""Start-up checks of the communicator: an MPI whose fault tolerance does not work is refused (a trial
revoke, not hasattr), and the bound on one repair is read from the environment."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from lightning_recover.comm.ulfm import _library_has_agree


class _Error(Exception):
    def __init__(self, error_class: int) -> None:
        self.error_class = error_class

    def Get_error_class(self) -> int:
        return self.error_class


def _fake_mpi(*, revoke_works: bool) -> SimpleNamespace:
    """mpi4py's stand-ins where the library has no MPIX calls: Agree answers, Revoke does nothing."""
    revoked = {"yes": False}

    class Comm:
        def Agree(self, flag: int) -> int:
            return flag

        def Dup(self) -> Comm:
            return Comm()

        def Set_errhandler(self, handler: object) -> None:
            pass

        def Revoke(self) -> None:
            revoked["yes"] = revoke_works

        def Barrier(self) -> None:
            if revoked["yes"]:
                raise _Error(77)

        def Free(self) -> None:
            pass

    return SimpleNamespace(COMM_SELF=Comm(), Exception=_Error, ERR_REVOKED=77, ERRORS_RETURN=object())


def test_an_mpi_whose_revoke_does_nothing_is_refused() -> None:
    assert not _library_has_agree(_fake_mpi(revoke_works=False))  # MPICH through mpi4py's fallbacks


def test_an_mpi_whose_revoke_revokes_is_accepted() -> None:
    assert _library_has_agree(_fake_mpi(revoke_works=True))


def test_the_pip_open_mpi_passes_the_trial_revoke() -> None:
    code = "from mpi4py import MPI; from lightning_recover.comm.ulfm import _library_has_agree; print(_library_has_agree(MPI))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr


def test_the_repair_bound_reads_the_environment(monkeypatch) -> None:
    import pytest

    from lightning_recover.comm.repair_bound import DEFAULT_REPAIR_TIMEOUT_S, ENV_REPAIR_TIMEOUT, repair_timeout

    monkeypatch.delenv(ENV_REPAIR_TIMEOUT, raising=False)
    assert repair_timeout() == DEFAULT_REPAIR_TIMEOUT_S
    monkeypatch.setenv(ENV_REPAIR_TIMEOUT, "12.5")
    assert repair_timeout() == 12.5
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv(ENV_REPAIR_TIMEOUT, bad)
        with pytest.raises(ValueError, match=f"{ENV_REPAIR_TIMEOUT}='{bad}' must be a positive number"):
            repair_timeout()


def test_a_section_that_outlasts_its_bound_ends_the_rank_and_one_in_time_does_not() -> None:
    import time

    from lightning_recover.comm.repair_bound import RepairBound

    left: list[str] = []
    bound = RepairBound(1.5, left.append)
    with bound.within("the agreement at world epoch 3"):
        time.sleep(0.2)
    time.sleep(2.5)
    assert left == [], "a section that ended in time never ends the rank"
    with bound.within("the repair after world epoch 3"):
        with bound.within("an agreement inside it"):  # an inner section keeps the outer deadline
            deadline = time.monotonic() + 10
            while not left and time.monotonic() < deadline:
                time.sleep(0.1)
    assert left and left[0].startswith("the repair after world epoch 3 did not finish within 1.5 s"), left
    assert "LIGHTNING_RECOVER_REPAIR_TIMEOUT" in left[0]
