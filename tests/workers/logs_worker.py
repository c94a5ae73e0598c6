"""Launched job for the leader-death logging test: tiny GPT, Lightning's stock CSVLogger and TensorBoardLogger.

Logs, besides the strategy's ``step_loss`` and the model's ``train_loss``, a metric
``late_metric`` (value: the step) only from ``--late-from`` on, so its key first reaches
the log after the leader died. The leader writes ``ledger.jsonl``; every surviving rank
writes ``rank{R}.json`` into $LR_TEST_OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_recover.callbacks import FaultInjection  # noqa: E402
from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402

from benchmarks.chaos import build_tiny  # noqa: E402  (benchmarks/chaos.py)


class DieBeforeLogging(L.Callback):
    """SIGKILLs this rank after step ``step`` committed and before Lightning logs that step.

    The survivors log the step; they notice the death only in a later collective."""

    def __init__(self, spec: str) -> None:
        rank, step = spec.split(":")
        self.rank, self.step = int(rank), int(step)

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step + 1 and int(os.environ["OMPI_COMM_WORLD_RANK"]) == self.rank:
            print(f"logs_worker: killing rank {self.rank} after step {self.step} committed", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--late-from", type=int, required=True)
    ap.add_argument("--faults", default="[]")
    ap.add_argument("--die-before-logging", action="append", default=[], metavar="RANK:STEP")
    args = ap.parse_args()
    out = Path(os.environ["LR_TEST_OUT"])
    model, data = build_tiny(7)
    original_step = model.training_step

    def training_step(batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = original_step(batch, batch_idx)
        step = model.trainer.global_step
        if step >= args.late_from:
            model.log("late_metric", float(step), on_step=True)
        return loss

    model.training_step = training_step  # type: ignore[method-assign]
    strategy = ReCoVerHSDPStrategy(grad_accum=2, ledger_path=out / "ledger.jsonl", seed=7, bucket_mb=0.01)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps,
        callbacks=[FaultInjection(json.loads(args.faults)), *map(DieBeforeLogging, args.die_before_logging)], logger=[CSVLogger(out, name="logs"), TensorBoardLogger(out, name="tb")],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, log_every_n_steps=1,
    )
    trainer.fit(model, DataLoader(data, batch_size=2))
    comm = strategy.comm
    assert comm is not None
    result = {"rank": comm.rank, "leader": strategy.global_rank == 0, "global_step": trainer.global_step}
    (out / f"rank{comm.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
