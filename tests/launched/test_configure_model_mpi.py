"""``configure_model`` with the replica's ``device_mesh``: a user who shards the model keeps their sharding.

Two launched 2x2 jobs (2 replicas x 2 shard ranks) of the same tiny GPT: one left to the
strategy's default wrapping, one sharded by the user in ``configure_model`` over
``self.device_mesh``. Both must train the same trajectory: the user's FSDP units also sum
inside the replica, so the reduced gradients are the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_recover.ledger import read_ledger
from harness.mpirun import MPIJob, run_mpi

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/mesh_worker.py"
STEPS = 2


def launch(out: Path, *extra: str) -> MPIJob:
    job = run_mpi(4, [WORKER, "--shards", "2", "--steps", str(STEPS), *extra], out, timeout=180)
    assert job.returncode == 0, job.describe()
    assert len(job.results()) == 4, job.describe()
    return job


def test_user_sharding_in_configure_model_matches_default_wrapping(tmp_path: Path) -> None:
    default = launch(tmp_path / "default")
    user = launch(tmp_path / "user", "--user-shard")
    for res in user.results().values():
        assert res["mesh_seen"] == {"size": 2, "names": ["data_parallel"], "by_name": 2}, res
        assert res["units"] == ["", "blocks.0.mlp", "blocks.1.mlp"], "the user's FSDP units are kept, not rewrapped"
        assert res["global_step"] == STEPS
    for res in default.results().values():
        assert res["strategy_mesh_size"] == 2
        assert res["units"] == ["", "blocks.0", "blocks.1"], "the default wrapping: one unit per block, then the root"
    default_losses = [line["loss"] for line in read_ledger(default.outdir / "ledger.jsonl")]
    user_losses = [line["loss"] for line in read_ledger(user.outdir / "ledger.jsonl")]
    assert len(default_losses) == len(user_losses) == STEPS
    assert user_losses == pytest.approx(default_losses, rel=1e-5)
    # The reduced gradient (not only Adam's scale-free update) must match: a user's unit that
    # averaged inside the replica instead of summing would halve it.
    default_norms = {r["rank"]: r["grad_norms"] for r in default.results().values()}
    for res in user.results().values():
        assert len(res["grad_norms"]) == STEPS
        assert res["grad_norms"] == pytest.approx(default_norms[res["rank"]], rel=1e-5)
