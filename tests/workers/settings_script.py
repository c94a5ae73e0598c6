"""A user's script that passes ReCoVerHSDPStrategy one bad setting, the way ``--case`` names (issue 34, point 2).

Each case is one way a user passes settings: keywords, nested groups as a Hydra app's YAML
has them (``checkpoint: {dir, every_n_steps}``, ``sdc: {...}``) built by Hydra's
``instantiate``, DictConfig / ListConfig values, ``config=`` given a dict or a DictConfig,
and Trainer settings with ``strategy="recover_hsdp"``. Every case must end the launched job
with exit status 2 and one line naming the key (``tests/launched/test_settings_mpi.py``);
``--case good`` builds a valid nested configuration and trains one step.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from hydra.utils import instantiate  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_recover.strategies import ReCoVerHSDPStrategy  # noqa: E402

TARGET = "lightning_recover.strategies.ReCoVerHSDPStrategy"


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def from_yaml(text: str) -> Any:
    """What a Hydra app's ``instantiate(cfg.strategy)`` does with a strategy group written in YAML."""
    return instantiate(OmegaConf.create(text))


def strategy_for(case: str, tmp: str) -> Any:
    if case == "keyword_unknown":
        return ReCoVerHSDPStrategy(grad_acum=2)
    if case == "keyword_value":
        return ReCoVerHSDPStrategy(grad_accum=0)
    if case == "nested_checkpoint":
        return from_yaml(f"{{_target_: {TARGET}, checkpoint: {{dir: {tmp}/ck, every_n_step: 2}}}}")
    if case == "nested_sdc":
        return from_yaml(f"{{_target_: {TARGET}, sdc: {{every_n_steps: 5, action: fix}}}}")
    if case == "both_forms":
        return ReCoVerHSDPStrategy(checkpoint={"dir": f"{tmp}/ck", "every_n_steps": 2}, checkpoint_dir=f"{tmp}/other")
    if case == "listconfig":
        return from_yaml(f"{{_target_: {TARGET}, rejoin: true, rejoin_hosts: [node7, node8]}}")
    if case == "config_dict":
        return ReCoVerHSDPStrategy(config={"grad_accum": 2, "polcy": "static"})
    if case == "config_dictconfig":
        return from_yaml(f"{{_target_: {TARGET}, config: {{shards: 0}}}}")
    if case == "good":
        return from_yaml(
            f"{{_target_: {TARGET}, grad_accum: 2, checkpoint: {{dir: {tmp}/ck, every_n_steps: 0}}, sdc: {{every_n_steps: 1}}}}"
        )
    if case == "strategy_string":
        return "recover_hsdp"
    raise SystemExit(f"unknown case {case!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    args = ap.parse_args()
    tmp = os.environ.get("LR_TEST_OUT", ".")
    strategy = strategy_for(args.case, tmp)
    accumulate = 2 if args.case == "strategy_string" else 1  # a Trainer setting the strategy refuses, after MPI is up
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False, accumulate_grad_batches=accumulate,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    torch.manual_seed(0)
    trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=2))
    print(f"settings_script: rank {trainer.global_rank} trained {trainer.global_step} step(s) with {trainer.strategy.config.sdc}", flush=True)


if __name__ == "__main__":
    main()
