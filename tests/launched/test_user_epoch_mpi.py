"""An outside user's run under faults: its best checkpoint under leader loss, its epoch-level values (issue 34, points 3 and 1).

``tests/workers/epoch_user.py`` is a user's LightningModule (a tiny causal LM, AdamW,
``self.log(on_epoch=True, sync_dist=True)``, a MeanMetric and a Perplexity updated in
``training_step``, validation, ``ModelCheckpoint(monitor="val_loss", save_last=True)``) on 3
ranks, 2 steps per epoch, 2 epochs. The runs start at once (they mostly wait on imports):

* ``free``: fault-free, the reference;
* ``save_async`` / ``save_sync``: the leader (rank 0) SIGKILLed while it writes the best
  checkpoint of epoch 0 (the checkpoint fault point: its shards written, nothing renamed
  yet), with ``checkpoint_async_save`` on and off.

What the user keeps is asserted: the ``best_model_path`` and ``last_model_path`` every
survivor reports exist, load, and hold the fault-free run's weights; no DCP ``.tmp`` folder
is left.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from harness.mpirun import MPIJob, run_mpi

pytestmark = pytest.mark.mpi
SCRIPT = "tests/workers/epoch_user.py"
BASE = ["--samples", "24", "--epochs", "2"]
LEADER_IN_SAVE = [{"step": 2, "rank": 0, "phase": "checkpoint", "kind": "kill"}]
RUNS: dict[str, list[str]] = {
    "free": ["--async-save", "0"],
    "save_async": ["--async-save", "1", "--faults", json.dumps(LEADER_IN_SAVE)],
    "save_sync": ["--async-save", "0", "--faults", json.dumps(LEADER_IN_SAVE)],
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MPIJob]:
    tmp = tmp_path_factory.mktemp("user_epoch")
    with ThreadPoolExecutor(len(RUNS)) as pool:
        futures = {
            name: pool.submit(run_mpi, 3, [SCRIPT, *BASE, *args, "--ckpt-dir", str(tmp / name / "ck")], tmp / name, timeout=400)
            for name, args in RUNS.items()
        }
        return {name: f.result() for name, f in futures.items()}


def weights(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]


@pytest.mark.parametrize("name", ["save_async", "save_sync"])
def test_the_best_checkpoint_of_a_leader_lost_while_saving_exists_and_loads(jobs: dict[str, MPIJob], name: str) -> None:
    job, free = jobs[name], jobs["free"]
    assert job.returncode == 0 and free.returncode == 0, job.describe()
    results, reference = job.results(), free.results()[0]
    assert sorted(results) == [1, 2] and all(r["faults"] == 1 for r in results.values()), job.describe()
    assert "rank 0 at step 2 checkpoint" in job.stderr, job.describe()
    for rank, r in results.items():
        for key in ("best_model_path", "last_model_path"):
            assert Path(r[key]).name == Path(reference[key]).name, (rank, key, r[key], reference[key])
            assert Path(r[key]).is_file(), (rank, key, job.describe())
            got, want = weights(r[key]), weights(reference[key])
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), (rank, key)
    ck = job.outdir / "ck"
    assert not [p for p in ck.rglob("*") if p.name.endswith(".tmp")], sorted(ck.rglob("*"))
    assert "was lost while it saved" in job.stderr and "writes it now" in job.stderr, job.describe()
