"""Every private Lightning member the package uses (lightning_recover/_lightning.py) exists in the installed Lightning."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.plugins.precision import Precision

from lightning_recover import _lightning


def _instances(tmp: Path) -> dict[str, object]:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp))
    return {
        "Trainer": trainer,
        "_TrainingEpochLoop": trainer.fit_loop.epoch_loop,
        "LightningModule": L.LightningModule(),
        "CSVLogger": CSVLogger(str(tmp)),
        "ExperimentWriter": ExperimentWriter(str(tmp / "w")),
        "Precision": Precision(),
        "LightningOptimizer": LightningOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)),
        "Metric": torchmetrics.MeanMetric(),
    }


@pytest.mark.parametrize("member", sorted(_lightning.PRIVATE))
def test_each_private_member_exists(member: str, tmp_path: Path) -> None:
    cls, _, attr = member.partition(".")
    obj = _instances(tmp_path)[cls]
    assert hasattr(obj, attr), (
        f"Lightning {L.__version__} has no {member} (checked with {_lightning.CHECKED_WITH}); "
        f"see lightning_recover/_lightning.py: {_lightning.PRIVATE[member]}"
    )


def test_the_wrappers_reach_what_they_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _instances(tmp_path)["Trainer"]
    _lightning.no_distributed_sampler(trainer)
    assert trainer._accelerator_connector.use_distributed_sampler is False  # type: ignore[attr-defined]
    _lightning.hand_over_checkpoint(trainer, {"state": 1})
    assert trainer._checkpoint_connector._loaded_checkpoint == {"state": 1}  # type: ignore[attr-defined]
    called: list[object] = []
    monkeypatch.setattr(torch.distributed, "broadcast", lambda *a, **k: called.append(a))
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert called, "the unpatched loop broadcasts (else this test proves nothing)"
    called.clear()
    _lightning.skip_sigterm_broadcast(trainer)
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert not called
    module = L.LightningModule()
    _lightning.set_device_mesh(module, "mesh")
    assert module.device_mesh == "mesh"
    module._current_fx_name = "on_train_start"
    with _lightning.logging_as_training_step(module, first=True):
        assert module._current_fx_name == "training_step"
    assert module._current_fx_name == "on_train_start"


def test_the_logger_and_optimizer_wrappers(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), version=None)
    assert _lightning.keeps_version(logger) and _lightning.set_logger_version(logger, 7) and logger.version == 7
    assert not _lightning.set_logger_version(object(), 7)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert _lightning.unwrapped_optimizer(LightningOptimizer(sgd)) is sgd and _lightning.unwrapped_optimizer(sgd) is sgd
