"""The user's DataLoader workers load the planned microbatches in a launched job, through a replica loss.

One 4-replica job with ``num_workers=2, persistent_workers=True`` and rank 2 SIGKILLed in
the middle of step 1 (the survivors replay its microbatches and re-plan the stream): the
batches come from worker processes forked after MPI_Init, the user's worker_init_fn ran,
the trajectory is the single-process reference's, the killed rank's workers are gone and
Open MPI said nothing about fork.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_recover.audit.ledger import read_ledger
from lightning_recover.audit.ledger_check import check_ledger
from harness.mpirun import run_mpi

pytestmark = pytest.mark.mpi
STEPS = 4
WORKERS = 2


def test_workers_load_the_plan_through_a_replica_loss(tmp_path: Path) -> None:
    from reference import reference_run

    argv = ["--steps", str(STEPS), "--num-workers", str(WORKERS), "--persistent-workers"]
    faults = [{"step": 1, "rank": 2, "phase": "forward", "microbatch": 1, "kind": "kill"}]
    job = run_mpi(4, ["tests/workers/train_worker.py", *argv, "--faults", json.dumps(faults)], tmp_path, timeout=240)
    assert job.returncode == 0, job.describe()
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(STEPS)), job.describe()
    assert ledger[1]["faults"] == [2] and ledger[1]["extra_microbatches"] == 2
    assert check_ledger(tmp_path / "ledger.jsonl").ok

    # The trajectory of a single process accumulating the same B microbatches.
    ref_losses, ref_params = reference_run(argv, 4)
    assert [line["loss"] for line in ledger] == pytest.approx(ref_losses, rel=1e-4)
    params = {int(f.stem[6:]): torch.load(f) for f in sorted(tmp_path.glob("params*.pt"))}
    assert sorted(params) == [0, 1, 3]
    for p in params.values():
        for k in ref_params:
            torch.testing.assert_close(p[k], ref_params[k], rtol=1e-4, atol=1e-4)

    results = job.results()
    loads = [tuple(int(x) for x in f.name.split("-")) for f in (tmp_path / "loads").iterdir()]
    inits = [tuple(int(x) for x in f.name.split("-")) for f in (tmp_path / "inits").iterdir()]
    for rank, res in results.items():
        pid = res["pid"]
        workers = {child for parent, child in loads if parent == pid}
        assert len(workers) >= WORKERS, f"rank {rank} (pid {pid}): batches loaded by {workers}, not by its workers"
        assert {child for parent, child, _ in inits if parent == pid} >= workers, "worker_init_fn did not run in every worker"
        assert res["dead_ranks_loaders"] == [], f"the killed rank's loader workers are still running: {res}"
    # W=3 after the loss: replicas 0 and 1 replay one of ids 4, 5 each (loaded directly) and
    # compute 3 microbatches a step from step 2 on (their stream is re-planned); replica 3
    # keeps ids 6, 7, so its stream runs on untouched.
    feeds = {rank: res["feed"] for rank, res in results.items()}
    for rank in (0, 1):
        assert feeds[rank]["direct"] == 1 and feeds[rank]["restarts"] == 1, feeds
        assert feeds[rank]["streamed"] == 2 + 2 + 3 + 3, feeds  # steps 0, 1 (own ids), 2, 3
    assert feeds[3] == {"streamed": 8, "direct": 0, "dropped": 0, "restarts": 0}, feeds
    assert "fork" not in job.stderr.lower(), job.describe()
