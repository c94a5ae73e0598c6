"""FSDP2's in-replica collectives on MPI (recover.replica_plane=mpi): sums, bytes, and a mate's death.

Real mpiexec jobs; the fault is a real SIGKILL. The end-to-end checks
(training on the MPI replica plane gives the reference losses, through kills in every
phase and a SIGSTOPped mate) are in tests/launched/test_strategy_mpi.py, whose 2x2 jobs run on it by default.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.mpirun import run_mpi

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/replica_plane_worker.py"


def test_gathers_and_sums_match_the_references(tmp_path: Path) -> None:
    job = run_mpi(4, [WORKER, "values"], tmp_path / "out", timeout=90, env={"LR_SHARDS": "2"})
    results = job.results()
    assert sorted(results) == [0, 1, 2, 3], job.describe()
    for rank, res in results.items():
        assert res["gather_fp32"] and res["gather_bf16"] and res["gather_int64"], (rank, res)
        assert res["scatter_fp32_SUM_err"] < 1e-4 and res["scatter_fp32_AVG_err"] < 1e-4, (rank, res)
        assert res["scatter_bf16_equals_fp32_sum_rounded"], (rank, res)
        assert "SUM or AVG" in res["max_refused"] and "replica_plane=torch" in res["max_refused"], res
        assert res["calls"] == 6


def test_a_dead_mate_releases_the_replica_and_spares_the_others(tmp_path: Path) -> None:
    job = run_mpi(4, [WORKER, "kill"], tmp_path / "out", timeout=90, env={"LR_SHARDS": "2"})
    results = job.results()
    assert sorted(results) == [0, 1, 2], job.describe()
    for rank in (0, 1):  # the other replica never noticed
        assert results[rank]["error"] is None and results[rank]["gathers_after"] == 200, results[rank]
    mate = results[2]
    assert mate["error"] is not None and "replica-mate died" in mate["error"], mate
    assert mate["gathers_after"] == 0 and mate["seconds"] < 5, mate


def test_every_mate_of_a_replica_of_three_is_released(tmp_path: Path) -> None:
    # Open MPI's all-gather on 3 ranks lets both survivors see the death themselves; the
    # revoke is for algorithms where a mate waits only on live ranks (larger S).
    job = run_mpi(3, [WORKER, "kill"], tmp_path / "out", timeout=90, env={"LR_SHARDS": "3"})
    results = job.results()
    assert sorted(results) == [0, 1], job.describe()
    for res in results.values():
        assert res["error"] is not None and "replica-mate died" in res["error"], res
        assert res["seconds"] < 5, res
