"""Salvage at the communicator's level: a broken replica's live ranks wait as orphans and re-form a replica.

Real mpiexec, real SIGKILLs (``tests/workers/salvage_worker.py``): 3 replicas x 2 shards, shard 0
of replica 1 killed in step 1, shard 1 of replica 2 in step 3. No process is spawned; the job
ends with 2 whole replicas, the orphans seated as replica 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def test_two_broken_replicas_reform_one_whole_replica_from_orphans(tmp_path: Path) -> None:
    job = run_mpi(6, ["tests/workers/salvage_worker.py"], tmp_path / "out", timeout=120)
    results = job.results()
    assert sorted(results) == [0, 1, 3, 4], job.describe()
    assert [r for r, res in results.items() if res["orphaned"]] == [3, 4], job.describe()
    assert results[3]["orphan_lost"] == [2] and results[4]["orphan_lost"] == [5]
    # Launch rank 4 (shard 0 of replica 2) takes the seat of rank 2 (shard 0 of replica 1); rank 3 keeps its own.
    assert results[4]["seated_as"] == 2 and results[3]["seated_as"] == 3
    for launch, res in results.items():
        assert res["members"] == [0, 1, 2, 3] and res["alive_replicas"] == [0, 1], (launch, res)
        assert res["exact"], f"launch rank {launch}: wrong sums over the re-formed world\n{job.describe()}"
    assert {res["world_epoch"] for res in results.values()} == {3}, "two repairs and one growth"
    assert results[0]["reformed_at_step"] == 3 and results[0]["reformed_in_s"] < 10
    assert "spawn" not in job.stderr.lower(), job.describe()
