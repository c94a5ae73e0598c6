"""A leader SIGKILLed mid-run: Lightning's stock CSVLogger and TensorBoardLogger still hold every step's metrics.

Launched 4x1 jobs (tests/workers/logs_worker.py, tiny GPT). What a user sees in
``logs/version_0/metrics.csv`` after the run: one training row per step 0..N-1 whose
``step_loss`` is the ledger's committed loss, a key first logged after the death merged into
the header, and the old leader's rows kept; and in ``tb/version_0/`` (the new leader's event
file beside the old one's) a ``step_loss`` scalar for every step. In-process cases:
tests/inprocess/test_loggers.py.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from lightning_recover.ledger import read_ledger
from harness.mpirun import run_mpi

pytestmark = pytest.mark.mpi
WORKER = "tests/workers/logs_worker.py"
STEPS = 6


@dataclass(frozen=True)
class Case:
    faults: list[dict] = field(default_factory=list)  # FaultInjection schedule
    die_before_logging: list[str] = field(default_factory=list)  # "RANK:STEP": killed after the commit, before the log
    late_from: int = 0  # the first step that logs late_metric
    leader: int | None = None  # the rank leading when fit returned (None: either, the death is seen at the end)

    @property
    def deaths(self) -> int:
        return len(self.faults) + len(self.die_before_logging)


CASES = {
    # The leader dies in step 1's backward (row 0 written); its successor dies after step 3
    # committed, before it logs step 3: only the survivors hold row 3.
    "twice": Case(faults=[{"step": 1, "rank": 0, "phase": "backward", "kind": "kill"}], die_before_logging=["1:3"], late_from=4, leader=2),
    # The leader dies before logging the last step; the survivors may see it only when the script
    # ends, whose repair makes rank 1 the leader, which writes the last row (with a key new to the file).
    "last_step": Case(die_before_logging=[f"0:{STEPS - 1}"], late_from=STEPS - 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_stock_csv_logger_holds_every_step_after_the_leader_dies(tmp_path: Path, case: str) -> None:
    c = CASES[case]
    argv = [WORKER, "--steps", str(STEPS), "--late-from", str(c.late_from), "--faults", json.dumps(c.faults)]
    for spec in c.die_before_logging:
        argv += ["--die-before-logging", spec]
    job = run_mpi(4, argv, tmp_path, timeout=240)
    assert job.returncode == 0, job.describe()
    dead = {f["rank"] for f in c.faults} | {int(spec.split(":")[0]) for spec in c.die_before_logging}
    results = {int(f.stem[4:]): json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")}
    assert sorted(results) == sorted(set(range(4)) - dead), job.describe()
    if c.leader is not None:
        assert [r for r, res in results.items() if res["leader"]] == [c.leader], job.describe()

    ledger = {line["step"]: line["loss"] for line in read_ledger(tmp_path / "ledger.jsonl")}
    assert sorted(ledger) == list(range(STEPS)), job.describe()
    log_dir = tmp_path / "logs" / "version_0"
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["version_0"]
    with (log_dir / "metrics.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or []), list(reader)
    assert {"step_loss", "train_loss", "late_metric", "faults", "step"} <= set(header), header
    train = [r for r in rows if r["step_loss"]]
    steps = [int(r["step"]) for r in train]
    assert steps == list(range(STEPS)), f"metrics.csv training rows are for steps {steps}\n{job.describe()}"
    for r in train:
        s = int(r["step"])
        # self.log stores a float as a float32 tensor: the ledger's loss, rounded the same way.
        assert float(r["step_loss"]) == torch.tensor(ledger[s], dtype=torch.float32).item(), f"step {s}: {r}"
        assert r["train_loss"], f"step {s} lost its train_loss"
        assert r["late_metric"] == ("" if s < c.late_from else str(float(s))), f"step {s}: {r}"
    # The strategy's count of lost replicas, as each row's writer saw it when the step was logged.
    faults = [float(r["faults"]) for r in train]
    assert faults == sorted(faults) and faults[0] == 0 and faults[-1] <= c.deaths, faults
    if c.leader is not None:
        assert faults[-1] == c.deaths, faults
    for spec in c.die_before_logging:
        step = int(spec.split(":")[1])
        if step + 1 < STEPS:  # that row was logged before the death was seen: from the survivors' journal
            assert faults[step] < faults[step + 1], faults
    assert sorted(p.name for p in log_dir.iterdir() if "tmp" in p.name) == []

    # TensorBoard: every step's step_loss is in some event file of the one run directory (a
    # new leader writes its own file there; a step may appear twice, never zero times).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["version_0"]
    scalars: dict[int, set[float]] = {}
    for events in sorted((tmp_path / "tb" / "version_0").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        if "step_loss" in acc.Tags()["scalars"]:
            for e in acc.Scalars("step_loss"):
                scalars.setdefault(e.step, set()).add(e.value)
    assert sorted(scalars) == list(range(STEPS)), f"TensorBoard has step_loss for steps {sorted(scalars)}\n{job.describe()}"
    for s, values in scalars.items():
        assert values == {torch.tensor(ledger[s], dtype=torch.float32).item()}, f"step {s}: {values}"
