"""Checkpoint fallback: the last line of defence when in-place recovery cannot continue.

In-place recovery needs at least ``min_replicas`` live replicas; below that (or when every
replica is gone) the job stops with a clear message and is relaunched from the newest
checkpoint -- possibly on a different number of replicas, with B and the sample order
taken from the checkpoint. Every ``every_n_steps`` committed steps the leader replica
writes one: a directory ``step-<N>/`` with one ``shard<s>.pt`` per shard rank, built
under a temporary name and renamed into place, then a ``last`` pointer file replaced
atomically. A kill during a write therefore leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

LAST = "last"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def last_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint the ``last`` pointer names, or None when there is none yet."""
    pointer = Path(directory) / LAST
    if not pointer.exists():
        return None
    target = Path(directory) / pointer.read_text().strip()
    return target if target.is_dir() else None


def resolve_ckpt_path(ckpt_path: str | None, directory: str | os.PathLike[str] | None) -> str | None:
    """``"last"`` -> the newest complete checkpoint under ``directory``; other values unchanged."""
    if ckpt_path != LAST:
        return ckpt_path
    if directory is None:
        raise ValueError("ckpt_path=last needs recover.checkpoint.dir (where the checkpoints were written)")
    found = last_checkpoint(directory)
    if found is None:
        raise FileNotFoundError(f"ckpt_path=last but {str(directory)!r} holds no complete checkpoint (no '{LAST}' pointer)")
    return str(found)


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's (or a directory's entries') data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(directory: Path, tmp: Path, final: Path, keep: int) -> None:
    """Rename a finished checkpoint into place, move the ``last`` pointer, drop old ones.

    Only one replica writes checkpoints and its shard ranks meet at a barrier before this,
    so any other ``*.tmp`` directory is the leftover of a writer killed mid-way: removed.
    """
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_path(directory)  # the rename must be durable before the pointer names it
    pointer_tmp = directory / f".{LAST}.tmp"
    pointer_tmp.write_text(final.name + "\n")
    fsync_path(pointer_tmp)
    os.replace(pointer_tmp, directory / LAST)
    fsync_path(directory)
    done = sorted(p for p in directory.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in directory.glob("step-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


class ReplicaCheckpoint(Callback):
    """Save a checkpoint every ``every_n_steps`` committed optimizer steps."""

    def __init__(self, dirpath: str | os.PathLike[str], every_n_steps: int, keep: int = 2) -> None:
        if every_n_steps < 1:
            raise ValueError(f"recover.checkpoint.every_n_steps must be >= 1, got {every_n_steps}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.dirpath = Path(dirpath)
        self.every_n_steps = every_n_steps
        self.keep = keep

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step > 0 and step % self.every_n_steps == 0:
            trainer.save_checkpoint(self.dirpath / checkpoint_name(step))
