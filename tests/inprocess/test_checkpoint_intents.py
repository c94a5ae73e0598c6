"""A checkpoint the dead leader never published is never reported (issue 34, point 3): the pieces on their own.

The launched runs (``tests/launched/test_user_epoch_mpi.py``) cover the leader killed while it
saves, where the new leader writes the save again. Here: what counts as published, the
unfinished DCP folders the new leader removes, and the roll-back when the save cannot be
written again (steps committed since): every ModelCheckpoint forgets the path.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_recover.strategies import checkpoint_io
from lightning_recover.strategies.checkpoint_hooks import forget_checkpoints


def test_published_means_the_file_and_a_dcp_folder_of_that_step(tmp_path: Path) -> None:
    final = tmp_path / "epoch=0-step=2.ckpt"
    store = tmp_path / checkpoint_io.STORE
    (store / "epoch=0-step=2.ckpt-00000002-abc.tmp").mkdir(parents=True)
    assert not checkpoint_io.published(final, 2)
    final.write_text("x")
    assert not checkpoint_io.published(final, 2), "a folder still .tmp is no commit"
    (store / "epoch=0-step=2.ckpt-00000001-abc").mkdir()
    assert not checkpoint_io.published(final, 2), "another step's save of the same name"
    (store / "epoch=0-step=2.ckpt-00000002-def").mkdir()
    assert checkpoint_io.published(final, 2)
    removed = checkpoint_io.remove_unfinished_writes(tmp_path)
    assert [p.name for p in removed] == ["epoch=0-step=2.ckpt-00000002-abc.tmp"]
    assert sorted(p.name for p in store.iterdir()) == ["epoch=0-step=2.ckpt-00000001-abc", "epoch=0-step=2.ckpt-00000002-def"]


def test_a_lost_save_leaves_every_report_of_the_callbacks(tmp_path: Path) -> None:
    kept, lost = str(tmp_path / "epoch=0-step=2.ckpt"), str(tmp_path / "epoch=1-step=4.ckpt")
    cb = ModelCheckpoint(dirpath=tmp_path, monitor="val_loss", save_top_k=2, save_last=True)
    cb.best_k_models = {kept: torch.tensor(2.0), lost: torch.tensor(1.0)}
    cb.best_model_path, cb.best_model_score = lost, torch.tensor(1.0)
    cb.kth_best_model_path, cb.kth_value = kept, torch.tensor(2.0)
    cb.last_model_path = str(tmp_path / "last.ckpt")
    forget_checkpoints(SimpleNamespace(checkpoint_callbacks=[cb]), {lost, cb.last_model_path})
    assert cb.best_k_models == {kept: torch.tensor(2.0)}
    assert (cb.best_model_path, float(cb.best_model_score), cb.kth_best_model_path) == (kept, 2.0, kept)
    assert cb.last_model_path == ""
    forget_checkpoints(SimpleNamespace(checkpoint_callbacks=[cb]), {kept})
    assert (cb.best_k_models, cb.best_model_path, cb.best_model_score) == ({}, "", None)
