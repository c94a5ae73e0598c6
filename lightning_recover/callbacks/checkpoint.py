"""Checkpoint fallback: the last line of defence when in-place recovery cannot continue.

In-place recovery needs at least ``min_replicas`` live replicas; below that (or when every
replica is gone) the job stops with a clear message and is relaunched from the newest
checkpoint -- possibly on a different number of replicas or shard ranks, with B and the
sample order taken from the checkpoint. The fallback is plain Lightning configuration
(:func:`fallback_checkpoint`): a ``ModelCheckpoint`` writing ``step-<N>.ckpt`` every
``every_n_steps`` committed steps and keeping the newest two; the strategy writes each one
as the leader replica (:mod:`lightning_recover.strategies.checkpoint_io`), in the
background, and points ``last.ckpt`` at it once it is complete. A kill during a write
therefore leaves the previous checkpoint and the pointer whole.
"""

from __future__ import annotations

import os
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

LAST = "last"
#: The pointer to the newest complete checkpoint of the fallback directory (a relative symlink).
POINTER = "last.ckpt"
#: ModelCheckpoint's file name pattern of the fallback checkpoints (``step-00000004.ckpt``).
FILENAME = "step-{step:08d}"


def fallback_checkpoint(dirpath: str | os.PathLike[str], every_n_steps: int, keep: int = 2) -> ModelCheckpoint:
    """The fallback: ``ModelCheckpoint`` every ``every_n_steps`` optimizer steps into ``dirpath``, newest ``keep`` kept.

    ``monitor="step", mode="max"`` is Lightning's way of keeping the newest k; no
    ``last.ckpt`` copy is written (the strategy's ``last.ckpt`` symlink names the newest).
    """
    if every_n_steps < 1:
        raise ValueError(f"recover.checkpoint.every_n_steps must be >= 1, got {every_n_steps}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    return ModelCheckpoint(
        dirpath=os.fspath(dirpath), filename=FILENAME, monitor="step", mode="max", save_top_k=keep,
        every_n_train_steps=every_n_steps, auto_insert_metric_name=False, save_last=False,
    )


def is_fallback(callback: object, dirpath: str | os.PathLike[str]) -> bool:
    """Whether ``callback`` already checkpoints into ``dirpath`` (then the strategy installs no fallback)."""
    d = getattr(callback, "dirpath", None)
    return isinstance(callback, ModelCheckpoint) and d is not None and os.path.abspath(d) == os.path.abspath(dirpath)


def last_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint file ``directory/last.ckpt`` names, or None when there is none yet."""
    pointer = Path(directory) / POINTER
    if not pointer.exists():  # also a dangling link
        return None
    return Path(os.path.realpath(pointer)) if pointer.is_symlink() else pointer


def resolve_ckpt_path(ckpt_path: str | None, directory: str | os.PathLike[str] | None) -> str | None:
    """``"last"`` -> the newest complete checkpoint under ``directory``; other values unchanged."""
    if ckpt_path != LAST:
        return ckpt_path
    if directory is None:
        raise ValueError("ckpt_path=last needs recover.checkpoint.dir (where the checkpoints were written)")
    found = last_checkpoint(directory)
    if found is None:
        raise FileNotFoundError(f"ckpt_path=last but {str(directory)!r} holds no complete checkpoint (no '{POINTER}' pointer)")
    return str(found)
