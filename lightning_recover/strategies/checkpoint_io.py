"""The fallback checkpoint's file layout: one directory per checkpoint, one file per shard rank.

Only the leader replica writes (every replica holds the same state). Its S shard ranks
each write ``shard<s>.pt`` into ``<name>.tmp/``, meet at a replica-local barrier, and shard
0 renames the directory into place and moves the ``last`` pointer
(:func:`lightning_recover.callbacks.checkpoint.publish`); a kill at any point leaves the
previous checkpoint whole. Each file carries, besides Lightning's checkpoint of that shard,
the ``lightning_recover`` state a resume needs (B, G_init, T, the sample order, the policy).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_recover.callbacks.checkpoint import fsync_path, publish
from lightning_recover.config import ConfigurationError

STATE_KEY = "lightning_recover"


def write_replica_checkpoint(
    checkpoint: dict[str, Any],
    filepath: str | os.PathLike[str],
    shard: int,
    replica_barrier: Callable[[str], None],
    before_rename: Callable[[], None] = lambda: None,
) -> None:
    """Write this shard's part of ``checkpoint`` and, on shard 0, publish the whole directory."""
    final = os.path.abspath(os.fspath(filepath))
    directory, tmp = os.path.dirname(final), final + ".tmp"
    if shard == 0:
        os.makedirs(tmp, exist_ok=True)
    replica_barrier("checkpoint start")
    part = os.path.join(tmp, f"shard{shard}.pt")
    torch.save(checkpoint, part + ".part")
    fsync_path(part + ".part")
    before_rename()
    os.replace(part + ".part", part)
    replica_barrier("checkpoint written")
    if shard == 0:
        publish(Path(directory), Path(tmp), Path(final), keep=2)


def read_replica_checkpoint(path: str | os.PathLike[str], shard: int, shards: int) -> dict[str, Any]:
    """This shard's part of the checkpoint at ``path``, checked to be ours and for this shard count."""
    path = os.fspath(path)
    shard_file = os.path.join(path, f"shard{shard}.pt")
    if not os.path.isfile(shard_file):
        raise FileNotFoundError(
            f"{shard_file!r} not found: {path!r} is not a lightning-recover checkpoint for recover.shards={shards}"
        )
    checkpoint = torch.load(shard_file, map_location="cpu", weights_only=False)
    state = checkpoint.get(STATE_KEY)
    if state is None:
        raise ValueError(f"{path!r} was not written by ReCoVerHSDPStrategy (no '{STATE_KEY}' state)")
    if state["shards"] != shards:
        raise ConfigurationError(
            f"checkpoint {path!r} was written with shards={state['shards']} but this run has shards={shards}; "
            f"resume with recover.shards={state['shards']}"
        )
    return checkpoint
