"""Lightning's bundled demo model (``lightning.pytorch.demos.LightningTransformer``), unchanged.

Only its data is ours (WikiText2 needs a download): random token blocks in the demo's
``(inputs, target)`` format. Launched, it trains on 4 replicas with ``--faults``; run as
plain ``python`` it is the one-process reference (one replica accumulating the same B
microbatches). The leader (or the one process) writes ``ledger.jsonl`` to $LR_TEST_OUT;
every rank that reaches the end writes ``rank{R}.json`` with its parameters' digest.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.demos import LightningTransformer  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from lightning_recover.callbacks import FaultInjection  # noqa: E402
from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402

VOCAB, BLOCK = 50, 12


class Demo(LightningTransformer):
    """The demo as is, but for its data: no WikiText2 download."""

    def prepare_data(self) -> None:
        pass


class Tokens(Dataset):
    def __init__(self, n: int = 96) -> None:
        self.data = torch.randint(0, VOCAB, (n, BLOCK + 1), generator=torch.Generator().manual_seed(5))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--faults", default="[]")
    args = ap.parse_args()
    out = Path(os.environ["LR_TEST_OUT"])
    L.seed_everything(11)
    model = Demo(vocab_size=VOCAB)
    strategy = ReCoVerHSDPStrategy(grad_accum=args.grad_accum, ledger_path=out / "ledger.jsonl", seed=11)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=args.steps, logger=False,
        callbacks=[FaultInjection(json.loads(args.faults))], enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(Tokens(), batch_size=2))
    assert strategy.comm is not None
    digest = {k: float(v.detach().double().sum()) for k, v in model.named_parameters()}
    result = {"rank": strategy.comm.rank, "global_step": trainer.global_step, "params": digest}
    (out / f"rank{strategy.comm.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
