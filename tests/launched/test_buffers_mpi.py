"""Launched jobs (real SIGKILLs): after fit every surviving rank holds the same buffers as the leader.

A tiny BatchNorm classifier (tests/workers/bn_worker.py): 2 x 2 fault-free (the shard ranks
of one replica see different halves of each microbatch) and 4 x 1 with a non-leader replica
killed mid-run (survivors replay its microbatches unevenly). Each rank also records its
buffers at every commit *before* BufferSync ran, which shows that its own data moved them
away from the other ranks' (so the equality after fit is the sync's doing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_recover.audit.ledger import read_ledger
from lightning_recover.audit.ledger_check import check_ledger
from harness.mpirun import MPIJob, run_mpi

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/bn_worker.py"
STEPS = 4
# Replica 2 of 4x1 / replica 1 of 2x2 (world rank 2 in both) dies in a forward of step 1.
KILL = [{"step": 1, "rank": 2, "phase": "forward", "kind": "kill"}]


def launch(out: Path, shards: int, faults: list[dict] | None = None) -> MPIJob:
    argv = [WORKER, "--steps", str(STEPS), "--shards", str(shards), "--faults", json.dumps(faults or [])]
    job = run_mpi(4, argv, out, timeout=240)
    assert job.returncode == 0, job.describe()
    return job


def per_rank(job: MPIJob, stem: str) -> dict[int, dict]:
    return {int(f.stem[len(stem) :]): torch.load(f) for f in sorted(job.outdir.glob(f"{stem}*.pt"))}


def assert_bitwise_equal(tensors: dict[int, dict[str, torch.Tensor]], what: str) -> None:
    ranks = sorted(tensors)
    first = tensors[ranks[0]]
    for rank in ranks[1:]:
        assert tensors[rank].keys() == first.keys()
        for k, v in first.items():
            assert torch.equal(tensors[rank][k], v), f"rank {rank}'s {what} {k} differs from rank {ranks[0]}'s"


def check_buffers(job: MPIJob, survivors: list[int]) -> None:
    results = job.results()
    assert sorted(results) == survivors, job.describe()
    assert all(r["global_step"] == STEPS for r in results.values())
    buffers, presync, params = per_rank(job, "buffers"), per_rank(job, "presync"), per_rank(job, "params")
    assert sorted(buffers) == survivors and sorted(params) == survivors
    assert "blocks.1.1.num_batches_tracked" in buffers[0]
    assert_bitwise_equal(buffers, "buffer")
    assert_bitwise_equal(params, "parameter")
    # From the leader: what rank 0 (leading throughout) held before the last sync.
    last = STEPS - 1
    for k, v in buffers[0].items():
        assert torch.equal(v, presync[0][last][k]), f"{k} after fit is not the leader's"
    # Each rank's own data moved its statistics elsewhere: without the sync they would differ.
    before = {rank: presync[rank][last]["blocks.0.1.running_mean"] for rank in survivors}
    assert len({tuple(v.tolist()) for v in before.values()}) == len(survivors), before
    assert not torch.equal(buffers[0]["blocks.0.1.running_mean"], torch.zeros(16)), "the statistics never moved"


def test_fault_free_2x2_every_rank_holds_the_leaders_buffers(tmp_path: Path) -> None:
    # The two shard ranks of one replica see different halves of each microbatch, so their
    # statistics differ before the sync as much as the replicas' do.
    check_buffers(launch(tmp_path, 2), [0, 1, 2, 3])


def test_non_leader_killed_4x1_survivors_hold_the_leaders_buffers(tmp_path: Path) -> None:
    job = launch(tmp_path, 1, KILL)
    survivors = [0, 1, 3]
    check_buffers(job, survivors)
    ledger = read_ledger(job.outdir / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(STEPS))
    assert ledger[1]["faults"] == [2]
    assert check_ledger(job.outdir / "ledger.jsonl").ok
    # The replay of replica 2's microbatches ran on some survivors only: their forward
    # counts differed before that step's sync, so integer buffers need the sync too.
    counts = {r: int(per_rank(job, "presync")[r][1]["blocks.0.1.num_batches_tracked"]) for r in survivors}
    assert len(set(counts.values())) > 1, counts
