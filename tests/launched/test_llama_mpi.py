"""LLaMA models under kills, 2 replicas x (TP 2): the example's LLaMA with activation checkpointing, with
``torch.compile`` on its blocks, and a Hugging Face ``transformers.LlamaForCausalLM``.

Each run SIGKILLs one tensor-parallel rank of replica 1 in step 1 and must end as one process
accumulating the same microbatches (``llama_worker.reference_run``): same losses, same final
parameters, to float32 rounding. What ``configure_model`` applied is asserted from the ranks'
own reports (blocks recomputing, blocks compiled, TP placements), so a variant that silently
fell back to plain eager would fail. The plain TP runs (fault-free and killed) are in
``test_tensor_parallel_mpi.py``. Tiny and few steps: the CI suite's time is counted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.mpirun import MPIJob, run_mpi
from lightning_recover.audit.ledger import read_ledger

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/llama_worker.py"
STEPS = 3
KILL = [{"step": 1, "rank": 3, "phase": "backward", "kind": "kill"}]


def killed_run(out: Path, variant: list[str]) -> tuple[MPIJob, list[dict]]:
    """2 x (TP 2) with ``variant``'s worker arguments; rank 3 killed; checked against one process."""
    from llama_worker import reference_run

    args = ["--shards", "2", "--tp", "2", "--steps", str(STEPS), *variant]
    job = run_mpi(4, [WORKER, *args, "--faults", json.dumps(KILL)], out, timeout=400)
    assert job.returncode == 0, job.describe()
    assert sorted(job.results()) == [0, 1], job.describe()
    assert "rank 2: replica-consistency gate" in job.stderr, job.describe()
    ledger = read_ledger(out / "ledger.jsonl")
    assert [line["faults"] for line in ledger] == [[], [1], []], job.describe()
    assert all(line["B"] == 4 and line["committed"] == 4 for line in ledger)
    ref_losses, ref_params = reference_run(args, replicas=2)
    assert [line["loss"] for line in ledger] == pytest.approx(ref_losses, rel=1e-5)
    (final,) = [torch.load(f) for f in out.glob("params*.pt")]
    assert final.keys() == ref_params.keys()
    for k in final:
        torch.testing.assert_close(final[k], ref_params[k], rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    return job, ledger


def test_activation_checkpointing_under_a_kill(tmp_path: Path) -> None:
    job, _ = killed_run(tmp_path, ["--ac"])
    for res in job.results().values():
        assert res["recompute"] == 2, "configure_model set both blocks to recompute"


def test_compiled_blocks_under_a_kill(tmp_path: Path) -> None:
    # aot_eager: dynamo and AOTAutograd trace the TP blocks as inductor would, without its C++
    # build (minutes on a 2-core CI machine); the strategy sees the same compiled modules.
    job, _ = killed_run(tmp_path, ["--compile", "aot_eager"])
    for res in job.results().values():
        assert res["compiled"] == 2, "configure_model compiled both blocks"
    assert "Dynamo does not know how to trace" not in job.stderr, "a hook of ours split the user's compiled graph"


@pytest.mark.hf
def test_hugging_face_llama_under_a_kill(tmp_path: Path) -> None:
    job, _ = killed_run(tmp_path, ["--model", "hf"])
    for res in job.results().values():
        placements = res["placements"]
        assert placements["hf.model.layers.0.self_attn.o_proj.weight"][-1] == "S(1)", placements
        assert placements["hf.model.layers.0.mlp.gate_proj.weight"][-1] == "S(0)", placements
