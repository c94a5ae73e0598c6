"""Launched jobs (real SIGKILLs): after fit every surviving rank holds the same buffers as the leader.

A tiny BatchNorm classifier (tests/workers/bn_worker.py) on 4 replicas x 1 shard and on
2 x 2, fault-free and with a non-leader replica killed mid-run. Each rank also records its
buffers at every commit *before* BufferSync ran, which shows that its own data moved them
away from the other ranks' (so the equality after fit is the sync's doing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightning_recover.ledger import check_ledger, read_ledger
from mpirun import MPIJob, run_mpi

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/bn_worker.py"
STEPS = 4
TOPOLOGIES = {"4x1": 1, "2x2": 2}
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


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MPIJob]:
    return {name: launch(tmp_path_factory.mktemp(f"bn{name}"), shards) for name, shards in TOPOLOGIES.items()}


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_fault_free_every_rank_holds_the_leaders_buffers(fault_free: dict[str, MPIJob], topology: str) -> None:
    # 2x2: the two shard ranks of one replica see different halves of each microbatch,
    # so their statistics differ before the sync as much as the replicas' do.
    check_buffers(fault_free[topology], [0, 1, 2, 3])


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_non_leader_killed_survivors_hold_the_leaders_buffers(
    tmp_path: Path, fault_free: dict[str, MPIJob], topology: str
) -> None:
    shards = TOPOLOGIES[topology]
    job = launch(tmp_path, shards, KILL)
    survivors = [0, 1, 3] if shards == 1 else [0, 1]
    check_buffers(job, survivors)
    ledger = read_ledger(job.outdir / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(STEPS))
    assert ledger[1]["faults"] == [2 // shards]
    # Training itself is the fault-free run's: BatchNorm normalizes with batch statistics
    # in training, so the buffers never feed back into the loss or the gradients.
    verdict = check_ledger(job.outdir / "ledger.jsonl", reference=str(fault_free[topology].outdir / "ledger.jsonl"), rtol=1e-4)
    assert verdict.ok, f"{verdict.problems}\n{job.describe()}"
    reference = per_rank(fault_free[topology], "params")[0]
    for k, v in per_rank(job, "params")[0].items():
        torch.testing.assert_close(v, reference[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    if shards == 1:
        # The replay of replica 2's microbatches ran on some survivors only: their forward
        # counts differed before that step's sync, so integer buffers need the sync too.
        counts = {r: int(per_rank(job, "presync")[r][1]["blocks.0.1.num_batches_tracked"]) for r in survivors}
        assert len(set(counts.values())) > 1, counts
