"""strategy.replica_group on real ranks: a user's torch.distributed collectives across three real SIGKILLs.

One launched job (4 replicas x 1 shard): every step, the first microbatch's training_step
runs all_reduce (SUM, MAX, MIN, AVG, a bf16 SUM), all_gather, broadcast and barrier over
``trainer.strategy.replica_group`` (tests/workers/train_worker.py ``replica_group_calls``).
Three ranks are killed inside such calls: rank 2 in step 1's first all_reduce before its MPI
call (the others are left waiting inside it); rank 1 in step 2's first all_reduce after its
part returned, before the survivors agreed (they may hold a sum that includes it, which must
be discarded: the call is issued again from the inputs as they were); rank 3 in step 3's
all_gather after its part returned (the list the user sized for two holds one row and a
zero-filled slot). What each rank got is compared with the exact values over the replicas
live at that call.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.mpirun import assert_reference_run, ledger_lines, train_worker

pytestmark = pytest.mark.mpi
ARGV = ["--steps", "4", "--replica-group"]
FAULTS = [
    {"step": 1, "rank": 2, "phase": "collective", "kind": "kill"},  # call 0: the first all_reduce
    {"step": 2, "rank": 1, "phase": "collective_done", "kind": "kill"},  # call 0 again, after its MPI part
    {"step": 3, "rank": 3, "phase": "collective_done", "microbatch": 5, "kind": "kill"},  # call 5: all_gather
]


def expected(step: int, replica: int, live: list[int], gather_live: list[int] | None = None) -> dict:
    """What replica ``replica`` gets at ``step``: the all_reduces over ``live``, and the all_gather (into a list
    sized ``len(live)``), broadcast and final size over ``gather_live`` (a member died inside the all_gather)."""
    after = live if gather_live is None else gather_live
    values = [r + 1.0 for r in live]
    # bf16 inputs 1.0 and 2**-8: summed in fp32, then rounded to bf16 once (a bf16 accumulation gives other values).
    half = float(torch.tensor(1.0 + (len(live) - 1) * 2.0**-8).to(torch.bfloat16))
    gathered = [[r + 1.0, -(r + 1.0)] for r in after] + [[0.0, 0.0]] * (len(live) - len(after))
    return {
        "step": step, "sum": [sum(values), 2 * sum(values)], "max": max(values), "min": int(min(values)),
        "avg": sum(values) / len(values), "bf16": half, "bf16_dtype": "torch.bfloat16", "gathered": gathered,
        "bcast": after[min(1, len(after) - 1)] + 1.0, "size": len(after), "rank": after.index(replica), "pg_rank": after.index(replica),
        "replicas": after,
    }


def test_user_collectives_over_the_replica_group_give_the_survivors_results_across_kills(tmp_path: Path) -> None:
    job = train_worker(4, tmp_path, ARGV, FAULTS)
    assert job.returncode == 0, job.describe()
    assert "kill rank 2 at step 1 collective microbatch 0" in job.stderr, job.describe()
    assert "kill rank 1 at step 2 collective_done microbatch 0" in job.stderr, job.describe()
    assert "kill rank 3 at step 3 collective_done microbatch 5" in job.stderr, job.describe()
    plan = {  # step -> (replicas live for the all_reduces, for the all_gather onwards)
        0: ([0, 1, 2, 3], None), 1: ([0, 1, 3], None), 2: ([0, 3], None), 3: ([0, 3], [0]),
    }
    seen = {r: [json.loads(line) for line in (tmp_path / f"collectives{r}.jsonl").read_text().splitlines()] for r in range(4)}
    for rank, records in seen.items():
        steps = {0: [0, 1, 2, 3], 1: [0, 1], 2: [0], 3: [0, 1, 2]}[rank]  # the dead ranks got until their kill
        assert [rec["step"] for rec in records] == steps, (rank, records)
        for rec in records:
            assert rec == expected(rec["step"], rank, *plan[rec["step"]]), f"rank {rank} step {rec['step']}"
    ledger = ledger_lines(job)
    assert [line["faults"] for line in ledger] == [[], [2], [1], [3]]
    assert [line["world_epoch"] for line in ledger] == [0, 1, 2, 3]
    # The user's collectives change nothing of the training: the trajectory is the fault-free one.
    assert_reference_run(job, ARGV, replicas=4)
