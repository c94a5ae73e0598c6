"""What a replacement's script finds in its environment (lightning_recover.cli.joiner.job_environment, seat.job_environ)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_recover.cli import joiner
from lightning_recover.membership import milestones
from lightning_recover.membership.seat import Seat, job_environ


def seat(context: dict) -> Seat:
    return Seat(ranks=(2, 3), attempt=1, spawned_at=0.0, context=context)


def test_replacement_sees_the_jobs_world_and_its_logical_rank() -> None:
    s = seat({"world_size": 4, "environ": {"LR_RUN_STAMP": "2030-01-02/03-04-05"}})
    # The second process of a 2-process spawn replaces logical rank 3 of the 4-rank job.
    env = joiner.job_environment(s, 1)
    assert env == {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3", "LR_RUN_STAMP": "2030-01-02/03-04-05"}
    assert joiner.job_environment(s, 0)["OMPI_COMM_WORLD_RANK"] == "2"


def test_the_world_variables_win_over_forwarded_ones() -> None:
    # A survivor's own OMPI_* is never forwarded, but a seat that carried one must not rename the world.
    s = seat({"world_size": 4, "environ": {"OMPI_COMM_WORLD_SIZE": "2"}})
    assert joiner.job_environment(s, 0)["OMPI_COMM_WORLD_SIZE"] == "4"


@pytest.mark.parametrize("world", [None, 0, "4", True])
def test_a_seat_without_the_jobs_size_is_refused_naming_the_value(world: object) -> None:
    with pytest.raises(SystemExit, match=f"world_size={world!r}.*one version on every node"):
        joiner.job_environment(seat({} if world is None else {"world_size": world}), 0)


def test_survivors_forward_only_the_jobs_own_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LR_RUN_STAMP", "stamp")
    monkeypatch.setenv("LIGHTNING_RECOVER_MPI_WAIT", "sleep")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("PMIX_RANK", "0")
    env = job_environ()
    assert env["LR_RUN_STAMP"] == "stamp" and env["LIGHTNING_RECOVER_MPI_WAIT"] == "sleep"
    assert not any(k.startswith(("OMPI_", "PMIX_")) for k in env), env


def test_a_standby_imports_only_installed_packages_the_script_imports_at_its_top_level(tmp_path: Path) -> None:
    """Nothing of the user's own code runs before a standby has its seat: modules next to the
    script, relative imports and imports inside functions are left to the script."""
    (tmp_path / "mymodel.py").write_text("raise SystemExit('must not be imported by a standby')\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import json, torch\n"
        "import mymodel\n"
        "from lightning.pytorch import Trainer\n"
        "from . import sibling\n"
        "def main():\n"
        "    import numpy\n"
    )
    names = joiner.installed_imports(str(script))
    assert names == ["json", "torch", "lightning.pytorch"]
    assert joiner.installed_imports(str(tmp_path / "missing.py")) == []


def test_the_breakdown_names_each_phase_reached_and_the_time_since_the_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(milestones, "_marks", {"python": 101.0, "merged": 101.5, "strategy": 104.0, "ready": 104.5, "go": 105.0})
    line = milestones.breakdown(100.0, lost_at=99.0)
    assert line == ("spawn to Python 1.00 s, MPI start and merge 0.50 s, script imports and set-up 2.50 s, "
                    "model, optimizer, Lightning set-up 0.50 s, waiting for a step boundary 0.50 s; 6.00 s after the loss")
    with pytest.raises(ValueError, match="unknown re-join milestone 'nap'"):
        milestones.mark("nap")


def test_standby_count_is_validated_naming_the_value() -> None:
    from lightning_recover.config import ConfigurationError, RecoverConfig, RejoinConfig

    assert RecoverConfig(rejoin=RejoinConfig(enabled=True, standbys=2)).rejoin.standbys == 2
    assert RecoverConfig.build(rejoin=True, rejoin_standbys=2).rejoin.standbys == 2  # the short form
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigurationError, match=r"rejoin\.standbys.*set recover\.rejoin\.standbys"):
            RejoinConfig(standbys=bad)
        with pytest.raises(ConfigurationError, match=r"rejoin\.standbys.*set recover\.rejoin\.standbys"):
            RecoverConfig.build(rejoin_standbys=bad)


def test_standby_wait_is_validated_naming_the_value_and_the_fix() -> None:
    from lightning_recover.config import ConfigurationError, RecoverConfig, RejoinConfig

    assert RecoverConfig().rejoin.standbys_wait_s == 60.0
    assert RejoinConfig(standbys_wait_s=0).standbys_wait_s == 0.0
    for bad in (-1, float("nan"), float("inf"), "10", True):
        with pytest.raises(ConfigurationError, match=r"rejoin\.standbys_wait_s.*set recover\.rejoin\.standbys_wait_s"):
            RecoverConfig(rejoin={"standbys_wait_s": bad})


def test_a_replacement_keeps_mpi_progress_until_it_is_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Open MPI's heartbeat detector (without its thread) hears from a process only inside MPI calls: a
    # replacement importing torch for seconds would be declared dead. The keep-alive probes until admitted.
    import threading

    admitted = threading.Event()
    probes: list[int] = []

    def probe() -> bool:
        probes.append(1)
        if len(probes) == 3:
            admitted.set()
        return False

    monkeypatch.setattr(joiner, "is_admitted", admitted.is_set)
    monkeypatch.setattr(joiner, "KEEP_ALIVE_S", 0.01)
    t = threading.Thread(target=joiner._keep_alive, args=(probe,), daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive() and len(probes) == 3


def test_the_keep_alive_stops_quietly_when_mpi_goes_away(monkeypatch: pytest.MonkeyPatch) -> None:
    def gone() -> bool:
        raise RuntimeError("MPI finalized")

    monkeypatch.setattr(joiner, "is_admitted", lambda: False)
    joiner._keep_alive(gone)  # returns instead of raising in a daemon thread
