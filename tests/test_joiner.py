"""What a replacement's script finds in its environment (lightning_recover.joiner.job_environment, rejoin.job_environ)."""

from __future__ import annotations

import pytest

from lightning_recover import joiner, rejoin


def seat(context: dict) -> rejoin.Seat:
    return rejoin.Seat(ranks=(2, 3), attempt=1, spawned_at=0.0, context=context)


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
    env = rejoin.job_environ()
    assert env["LR_RUN_STAMP"] == "stamp" and env["LIGHTNING_RECOVER_MPI_WAIT"] == "sleep"
    assert not any(k.startswith(("OMPI_", "PMIX_")) for k in env), env
