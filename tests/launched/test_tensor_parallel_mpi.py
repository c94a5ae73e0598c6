"""Tensor parallel inside a replica: 2 replicas x (TP 2), the replica as a ("data_parallel", "tensor_parallel") mesh.

The example's LLaMA (``examples/llama.py``) applies ``parallelize_module`` on
``self.device_mesh["tensor_parallel"]`` and ``fully_shard`` on ``self.device_mesh["data_parallel"]``
in its ``configure_model``, as under Lightning's ``ModelParallelStrategy``. A fault-free run
must match one process accumulating the same microbatches; a run in which one TP rank is
SIGKILLed must lose its whole replica (its TP mate leaves through the replica-consistency
gate) and end equal to the fault-free TP run to float32 rounding (the cross-replica sum
adds the same microbatches in another order).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from harness.mpirun import MPIJob, run_mpi
from lightning_recover.audit.ledger import read_ledger

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/llama_worker.py"
STEPS = 3
ARGS = ["--shards", "2", "--tp", "2", "--steps", str(STEPS)]


def launch(out: Path, faults: list[dict] | None = None, args: list[str] = ARGS) -> MPIJob:
    job = run_mpi(4, [WORKER, *args, "--faults", json.dumps(faults or [])], out, timeout=240)
    assert job.returncode == 0, job.describe()
    assert (out / "ledger.jsonl").exists(), job.describe()
    return job


def params(job: MPIJob) -> dict[int, dict[str, torch.Tensor]]:
    return {int(f.stem[6:]): torch.load(f) for f in sorted(job.outdir.glob("params*.pt"))}


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> MPIJob:
    return launch(tmp_path_factory.mktemp("tp_fault_free"), args=[*ARGS, "--validate", "--sdc-every", "1"])


def test_tp_mesh_matches_a_single_process(fault_free: MPIJob) -> None:
    from llama_worker import reference_run, validation_loss

    results = fault_free.results()
    assert sorted(results) == [0, 1, 2, 3]
    for rank, res in results.items():
        assert res["mesh"] == {"names": ["data_parallel", "tensor_parallel"], "shape": [1, 2]}, res["mesh"]
        assert (res["dp_index"], res["tp_index"]) == (0, rank % 2), "ranks lie row-major: TP mates are neighbours"
        # parallelize_module ran on the TP dimension: the row-wise output projection is split on its inputs.
        assert res["placements"]["layers.0.attention.wo.weight"][-1] == "S(1)", res["placements"]
        assert res["placements"]["layers.0.feed_forward.w1.weight"][-1] == "S(0)", res["placements"]
    ledger = read_ledger(fault_free.outdir / "ledger.jsonl")
    ref_losses, ref_params = reference_run(ARGS, replicas=2)
    assert [line["loss"] for line in ledger] == pytest.approx(ref_losses, rel=1e-5)
    assert all(line["B"] == 4 and line["committed"] == 4 for line in ledger)
    finals = params(fault_free)
    assert sorted(finals) == [0, 2], "one parameter file per replica (its shard 0)"
    for p in finals.values():
        assert p.keys() == ref_params.keys()
        for k in p:
            torch.testing.assert_close(p[k], ref_params[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    # The corruption check compared every position's (dp, tp) shards across the replicas after each step: no false alarm.
    assert all(res["sdc_checks"] == STEPS and res["sdc_detections"] == 0 for res in results.values()), results
    # trainer.validate() after fit: the held-out samples split over the replicas' data-parallel
    # indices (both TP ranks of an index evaluate the same ones); the synced mean is one process's.
    val = validation_loss(ref_params, ARGS)
    for res in results.values():
        assert res["validate"][0]["val_loss"] == pytest.approx(val, rel=1e-4), res["validate"]


def test_killed_tp_rank_takes_its_replica_through_the_gate(tmp_path: Path, fault_free: MPIJob) -> None:
    # Rank 3 (replica 1, TP index 1) is SIGKILLed in step 1's backward, between the TP all-reduces
    # its mate, rank 2, waits for; rank 2 must leave through the gate, replica 0 replays the lost work.
    job = launch(tmp_path, [{"step": 1, "rank": 3, "phase": "backward", "kind": "kill"}])
    assert sorted(job.results()) == [0, 1], job.describe()
    assert re.search(r"rank 2: replica-consistency gate", job.stderr), job.describe()
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(STEPS))
    assert [line["faults"] for line in ledger] == [[], [1], []]
    assert all(line["B"] == 4 and line["committed"] == 4 for line in ledger), "constant B through the loss"
    # The same samples in every step; only the order of the cross-replica sum differs (the survivor
    # adds the lost replica's microbatches itself), so agreement is to float32 rounding.
    assert [line["loss"] for line in ledger] == pytest.approx([line["loss"] for line in read_ledger(fault_free.outdir / "ledger.jsonl")], rel=1e-6)
    (survivor,) = params(job).values()
    reference = params(fault_free)[0]
    assert survivor.keys() == reference.keys()
    for k in reference:
        torch.testing.assert_close(survivor[k], reference[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k} vs the fault-free TP run: {m}")


def test_fsdp_by_tp_in_one_replica_matches_a_single_process(tmp_path: Path) -> None:
    # One replica of 4 ranks, FSDP 2 x TP 2: each data-parallel index computes its half of a
    # microbatch (both TP ranks of an index the same half), FSDP2 sums over the data-parallel
    # ranks on the MPI replica plane (the mates of one TP index), the divisor is B x 2.
    from llama_worker import reference_run

    args = ["--shards", "4", "--tp", "2", "--steps", str(STEPS)]
    job = launch(tmp_path, args=args)
    results = job.results()
    assert {(r["dp_index"], r["tp_index"]) for r in results.values()} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for res in results.values():
        assert res["mesh"] == {"names": ["data_parallel", "tensor_parallel"], "shape": [2, 2]}
        assert res["replica_plane"] == "mpi" and res["replica_plane_calls"] > 0, "FSDP2's collectives ran on MPI"
    ref_losses, ref_params = reference_run(args, replicas=1)
    assert [line["loss"] for line in read_ledger(tmp_path / "ledger.jsonl")] == pytest.approx(ref_losses, rel=1e-5)
    (final,) = params(job).values()
    for k in ref_params:
        torch.testing.assert_close(final[k], ref_params[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_lost_tp_replica_rejoins_with_its_tp_and_fsdp_shards(tmp_path: Path) -> None:
    # Rank 3 killed in step 1 takes replica 1 (ranks 2, 3) down; hot re-join spawns both back, the
    # donor sends each its (dp, tp) shards, rebuilt on the joiner's mesh: parameters that no TP plan
    # split live on its "data_parallel" dimension alone (seen broken before: a copy across meshes).
    from llama_worker import reference_run

    args = ["--shards", "2", "--tp", "2", "--steps", "20", "--rejoin"]
    job = launch(tmp_path, [{"step": 1, "rank": 3, "phase": "backward", "kind": "kill"}], args=args)
    assert "replica(s) [1] re-joined" in job.stderr, job.describe()
    results = job.results()
    assert sorted(results) == [0, 1, 2, 3], "the replacements finished the run"
    assert all(r["alive"] == [0, 1] and r["global_step"] == 20 for r in results.values())
    ledger = read_ledger(tmp_path / "ledger.jsonl")
    assert [line["step"] for line in ledger] == list(range(20)) and all(line["committed"] == 4 for line in ledger)
    ref_losses, ref_params = reference_run(args, replicas=2)
    assert [line["loss"] for line in ledger] == pytest.approx(ref_losses, rel=1e-5)
    finals = params(job)
    assert sorted(finals) == [0, 2]
    for k in ref_params:
        assert torch.equal(finals[0][k], finals[2][k]), f"the re-joined replica differs from the survivor in {k}"
        torch.testing.assert_close(finals[0][k], ref_params[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
