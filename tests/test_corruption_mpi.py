"""Silent data corruption, launched (issue 13): a real bit flip in one rank's state, found by the
replicas' fingerprint comparison, repaired in place or evicted; with two replicas, a clear stop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mpirun import MPIJob, run_mpi

from lightning_recover.ledger import check_ledger

pytestmark = pytest.mark.mpi


def corrupt(step: int, rank: int, target: str) -> dict:
    return {"step": step, "rank": rank, "phase": "optimizer", "kind": "corrupt", "target": target}


def launch(tmp_path: Path, nprocs: int, argv: list[str], faults: list[dict]) -> MPIJob:
    return run_mpi(nprocs, ["tests/workers/train_worker.py", *argv, "--faults", json.dumps(faults)], tmp_path, timeout=180)


def ledger(job: MPIJob) -> list[dict]:
    return [json.loads(line) for line in (job.outdir / "ledger.jsonl").read_text().splitlines()]


def assert_fault_free_trajectory(job: MPIJob, argv: list[str], replicas: int) -> dict[int, dict]:
    """The ledger equals the one-process reference and every finished rank holds the reference's weights, bitwise alike."""
    from reference import reference_run

    ref_losses, ref_params = reference_run(argv, replicas)
    ref = job.outdir / "reference.jsonl"
    ref.write_text("".join(json.dumps({"step": i, "loss": v}) + "\n" for i, v in enumerate(ref_losses)))
    verdict = check_ledger(job.outdir / "ledger.jsonl", reference=str(ref), rtol=1e-4)
    assert verdict.ok, verdict.problems
    results = job.results()
    params = {r: torch.load(job.outdir / f"params{r}.pt") for r in results}
    first = next(iter(params.values()))
    for r, p in params.items():
        assert all(torch.equal(first[k], p[k]) for k in first), f"rank {r} differs"
    for k, v in ref_params.items():
        torch.testing.assert_close(first[k], v, rtol=1e-4, atol=1e-4)
    return results


def test_bit_flip_in_parameters_is_found_at_once_and_repaired_in_place(tmp_path: Path) -> None:
    argv = ["--steps", "8", "--sdc-every", "1", "--sdc-action", "repair"]
    job = launch(tmp_path, 4, argv, [corrupt(3, 2, "params")])
    assert job.returncode == 0, job.describe()
    results = assert_fault_free_trajectory(job, argv, 4)
    assert sorted(results) == [0, 1, 2, 3] and all(r["alive"] == [0, 1, 2, 3] for r in results.values())
    events = [(rec["step"], e) for rec in ledger(job) for e in rec.get("sdc", [])]
    assert events == [(3, {"step": 3, "replicas": [2], "shards": [0], "what": "parameters+optimizer state", "lag_steps": 1, "action": "repair"})]
    assert "silent data corruption after step 3: replica(s) [2] differ in shard(s) [0]" in job.stderr
    assert sum(r["sdc_detections"] for r in results.values()) == 4  # every rank saw the one corruption, once


def test_corrupted_optimizer_state_of_a_sharded_replica_is_evicted(tmp_path: Path) -> None:
    """2 shards x 3 replicas would not fit 2 cores well: 3 replicas x 1 shard, evict; then 2 replicas go on."""
    argv = ["--steps", "8", "--sdc-every", "2", "--sdc-action", "evict"]
    job = launch(tmp_path, 3, argv, [corrupt(2, 1, "optimizer")])
    assert job.returncode == 0, job.describe()
    results = assert_fault_free_trajectory(job, argv, 3)
    assert sorted(results) == [0, 2]
    records = ledger(job)
    assert [e["replicas"] for rec in records for e in rec.get("sdc", [])] == [[1]]
    assert records[3]["sdc"][0]["action"] == "evict" and records[3]["sdc"][0]["lag_steps"] == 2
    assert 1 in records[4]["faults"]  # evicted: the next step recovers as from any failure
    assert "silent data corruption after step 3: this replica's state is the odd one out; evicted" in job.stderr


def test_two_replicas_that_differ_stop_with_a_clear_error(tmp_path: Path) -> None:
    argv = ["--steps", "8", "--sdc-every", "1"]
    job = launch(tmp_path, 2, argv, [corrupt(2, 1, "grads")])
    assert job.returncode != 0, job.describe()
    assert "SilentDataCorruptionError" in job.stderr
    assert "without a majority no replica can be trusted over another; relaunch from the newest checkpoint" in job.stderr
    records = ledger(job)
    assert len(records) == 3 and records[2]["sdc"][0]["action"] == "stop"
