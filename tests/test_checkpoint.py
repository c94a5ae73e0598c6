"""Checkpoint files: atomic publication, the `last` pointer, and ckpt_path=last resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_recover.callbacks.checkpoint import LAST, last_checkpoint, publish, resolve_ckpt_path


def _write(tmp: Path) -> None:
    tmp.mkdir(parents=True)
    (tmp / "shard0.pt").write_bytes(b"x")


def test_publish_moves_pointer_and_keeps_two(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _write(tmp_path / f"step-{step:08d}.tmp")
        publish(tmp_path, tmp_path / f"step-{step:08d}.tmp", tmp_path / f"step-{step:08d}", keep=2)
    assert last_checkpoint(tmp_path) == tmp_path / "step-00000006"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000006"]


def test_interrupted_write_leaves_previous_checkpoint(tmp_path: Path) -> None:
    _write(tmp_path / "step-00000002.tmp")
    publish(tmp_path, tmp_path / "step-00000002.tmp", tmp_path / "step-00000002", keep=2)
    # A writer killed mid-way leaves only a .tmp directory; the pointer still names step 2.
    (tmp_path / "step-00000004.tmp").mkdir()
    (tmp_path / "step-00000004.tmp" / "shard0.pt.part").write_bytes(b"half")
    assert last_checkpoint(tmp_path) == tmp_path / "step-00000002"
    assert resolve_ckpt_path("last", tmp_path) == str(tmp_path / "step-00000002")


def test_next_publish_removes_a_dead_writers_leftover(tmp_path: Path) -> None:
    (tmp_path / "step-00000004.tmp").mkdir()
    (tmp_path / "step-00000004.tmp" / "shard0.pt.part").write_bytes(b"half")
    _write(tmp_path / "step-00000006.tmp")
    publish(tmp_path, tmp_path / "step-00000006.tmp", tmp_path / "step-00000006", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "step-00000006"]


def test_resolve_errors_are_clear(tmp_path: Path) -> None:
    assert resolve_ckpt_path(None, tmp_path) is None
    assert resolve_ckpt_path("some/file", None) == "some/file"
    with pytest.raises(FileNotFoundError, match=f"no '{LAST}' pointer"):
        resolve_ckpt_path("last", tmp_path)
    with pytest.raises(ValueError, match="recover.checkpoint.dir"):
        resolve_ckpt_path("last", None)
