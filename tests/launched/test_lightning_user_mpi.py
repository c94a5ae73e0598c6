"""A typical user's Lightning classifier script (tests/workers/classifier.py) under the strategy.

Three launched jobs, with real SIGKILLs:

* 4x1 fault-free: the reference;
* 4x1, the leader killed mid-epoch in training, then another replica killed in
  ``trainer.test()``;
* 2x2 with BatchNorm + dropout, a non-leader replica killed during a validation run
  inside ``fit``.

What is asserted is what the user sees: the numbers in ``metrics.csv`` and in what
``validate()`` / ``test()`` return (``sync_dist`` mean and sum, torchmetrics, over every
sample exactly once, equal to a one-process evaluation and to the fault-free run), the
samples ``predict()`` returned, the buffers on every rank, the exit status and the end.
"""

from __future__ import annotations

import csv
import json
import subprocess
import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_recover.audit.ledger import read_ledger
from harness.mpirun import MPIJob, run_mpi

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/classifier.py"
from classifier import SIZES, BlobData, Classifier

STEPS_PER_EPOCH, EPOCHS = 6, 2  # 192 samples / (B = 4 replicas x 2) microbatches of 4
SAMPLES_PER_STEP = 32
JOBS = {
    "fault_free": (1, []),
    # The leader dies in training (step 4, mid-epoch 0); replica 3 dies in trainer.test().
    "leader_killed": (1, [{"step": 4, "rank": 0, "phase": "backward"}, {"step": 12, "rank": 3, "phase": "test"}]),
    # 2 replicas x 2 shards, BatchNorm: replica 1 (ranks 2, 3) dies in the first validation run (after step 3).
    "batchnorm_2x2": (2, [{"step": 3, "rank": 2, "phase": "validation", "microbatch": 1}]),
}
SURVIVORS = {"fault_free": [0, 1, 2, 3], "leader_killed": [1, 2], "batchnorm_2x2": [0, 1]}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, MPIJob]:
    out = {}
    for name, (shards, faults) in JOBS.items():
        argv = [WORKER, "--shards", str(shards), "--faults", json.dumps(faults)]
        if name == "batchnorm_2x2":
            argv.append("--batchnorm")
        out[name] = run_mpi(4, argv, tmp_path_factory.mktemp(name), timeout=300)
    return out


def metrics_rows(job: MPIJob) -> list[dict[str, str]]:
    with open(job.outdir / "logs" / "version_0" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def column(rows: list[dict[str, str]], key: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]


@pytest.mark.parametrize("name", list(JOBS))
def test_the_script_ends_by_itself_with_status_0_and_the_survivors_report(jobs: dict[str, MPIJob], name: str) -> None:
    job = jobs[name]
    assert job.returncode == 0, job.describe()
    assert sorted(job.results()) == SURVIVORS[name], job.describe()
    assert all(r["global_step"] == STEPS_PER_EPOCH * EPOCHS for r in job.results().values())


@pytest.mark.parametrize("name", list(JOBS))
def test_sync_dist_sum_and_mean_cover_every_microbatch_of_each_step(jobs: dict[str, MPIJob], name: str) -> None:
    rows = metrics_rows(jobs[name])
    ledger = {line["step"]: line for line in read_ledger(jobs[name].outdir / "ledger.jsonl")}
    counts = column(rows, "train_count_step")
    # Every step's row, also across the leader's death; each sums the step's samples over all ranks.
    assert [s for s, _ in counts] == list(range(STEPS_PER_EPOCH * EPOCHS))
    assert {v for _, v in counts} == {float(SAMPLES_PER_STEP)}, counts
    # The step mean over all ranks is the committed loss (mean over the step's B microbatches).
    for step, loss in column(rows, "train_loss_step"):
        assert loss == pytest.approx(ledger[step]["loss"], rel=1e-6), step
    assert [v for _, v in column(rows, "train_count_epoch")] == [192.0] * EPOCHS


@pytest.mark.parametrize("name", list(JOBS))
def test_evaluation_covers_every_sample_exactly_once(jobs: dict[str, MPIJob], name: str) -> None:
    job = jobs[name]
    rows = metrics_rows(job)
    val_counts = column(rows, "val_count")  # two validation runs per epoch, then trainer.validate()
    assert len(val_counts) == 2 * EPOCHS + 1 and {v for _, v in val_counts} == {float(SIZES["val"])}, val_counts
    assert [v for _, v in column(rows, "test_count")] == [float(SIZES["test"])]
    results = job.results()
    for r in results.values():
        assert r["validate"][0]["val_count"] == SIZES["val"] and r["test"][0]["test_count"] == SIZES["test"]
    # predict() returns each rank's part (as under DDP); together, each sample once.
    predicted = sorted(i for r in results.values() for i in r["predicted"])
    assert predicted == list(range(SIZES["predict"]))
    assert all(r["predicted"] for r in results.values()), "every surviving rank predicts a part"


def test_synced_validation_metrics_equal_a_one_process_evaluation(jobs: dict[str, MPIJob]) -> None:
    job = jobs["fault_free"]
    model = Classifier()
    model.load_state_dict(torch.load(job.outdir / "final.pt"))
    model.eval()
    data = BlobData()
    data.setup("validate")
    x, y = data.sets["val"].x, data.sets["val"].y
    with torch.no_grad():
        logits = model(x)
    loss = float(torch.nn.functional.cross_entropy(logits, y))
    acc = float((logits.argmax(-1) == y).float().mean())
    for r in job.results().values():
        assert r["validate"][0]["val_loss"] == pytest.approx(loss, rel=1e-5)
        assert r["validate"][0]["val_acc"] == pytest.approx(acc, abs=1e-7)


def test_a_faulted_run_logs_the_fault_free_numbers(jobs: dict[str, MPIJob]) -> None:
    ref, faulted = metrics_rows(jobs["fault_free"]), metrics_rows(jobs["leader_killed"])
    for key in ("train_loss_step", "train_loss_epoch", "val_loss", "val_acc", "test_loss", "test_acc"):
        a, b = column(ref, key), column(faulted, key)
        assert [s for s, _ in a] == [s for s, _ in b], key
        assert [v for _, v in b] == pytest.approx([v for _, v in a], rel=1e-5, abs=1e-6), key
    expected = jobs["fault_free"].results()[0]["validate"][0]
    for r in jobs["leader_killed"].results().values():
        assert r["validate"][0] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", list(JOBS))
def test_every_rank_ends_with_the_same_buffers_and_parameters(jobs: dict[str, MPIJob], name: str) -> None:
    results = jobs[name].results()
    first = results[min(results)]
    for r in results.values():
        assert r["buffers"] == first["buffers"]
        if name != "batchnorm_2x2":  # shard ranks hold different halves of the parameters
            assert r["params"] == first["params"]
    if name == "batchnorm_2x2":
        assert "net.1.running_mean" in first["buffers"] and first["buffers"]["net.1.num_batches_tracked"][0] > 0


LOAD_BEST = """
import json, sys, torch
from classifier import BlobData, Classifier
model = Classifier.load_from_checkpoint(sys.argv[1], map_location="cpu")
model.eval()
data = BlobData()
data.setup("test")
x, y = data.sets["test"].x, data.sets["test"].y
with torch.no_grad():
    logits = model(x)
print(json.dumps({"batchnorm": model.hparams.batchnorm, "mpi": "mpi4py.MPI" in sys.modules,
                  "test_loss": float(torch.nn.functional.cross_entropy(logits, y)),
                  "test_acc": float((logits.argmax(-1) == y).float().mean())}))
"""


@pytest.mark.parametrize("name", ["fault_free", "batchnorm_2x2"])
def test_best_checkpoint_loads_in_a_plain_process_and_is_what_test_evaluated(jobs: dict[str, MPIJob], name: str) -> None:
    results = jobs[name].results()
    best = {r["best_model_path"] for r in results.values()}
    assert len(best) == 1 and best != {""}, best
    path = best.pop()
    assert Path(path).is_file() and Path(path).parent == jobs[name].outdir / "ckpt"
    res = subprocess.run(
        [sys.executable, "-c", LOAD_BEST, path],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "workers")}, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    assert loaded["batchnorm"] == (name == "batchnorm_2x2") and not loaded["mpi"]
    # trainer.test(ckpt_path="best") evaluated exactly this model, over every test sample once.
    tested = results[min(results)]["test"][0]
    assert tested["test_loss"] == pytest.approx(loaded["test_loss"], rel=1e-5)
    assert tested["test_acc"] == pytest.approx(loaded["test_acc"], abs=1e-7)
