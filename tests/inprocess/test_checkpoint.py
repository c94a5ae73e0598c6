"""Checkpoint files in one process: DCP + consolidated file, async == sync, atomic publication,
the ``last.ckpt`` pointer, deferred removal, ckpt_path=last resolution, load_from_checkpoint."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_recover.callbacks.checkpoint import POINTER, fallback_checkpoint, last_checkpoint, resolve_ckpt_path
from lightning_recover.strategies import checkpoint_io
from lightning_recover.strategies.checkpoint_io import STATE_KEY, STORE, CheckpointWriter


class Net(L.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width), torch.nn.Linear(width, 2))


def _checkpoint(net: Net, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What Lightning's dump_checkpoint hands the strategy (live tensors, not copies)."""
    return {
        "epoch": 0, "global_step": step, "pytorch-lightning_version": L.__version__,
        "state_dict": net.state_dict(), "optimizer_states": [opt.state_dict()],
        "hyper_parameters": dict(net.hparams), "hparams_name": "kwargs", STATE_KEY: {"step": step},
    }


def _trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net.body(torch.randn(4, 8)).sum().backward()
    opt.step()
    return net, opt


def _disturb(net: Net, opt: torch.optim.Optimizer) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
        for s in opt.state.values():
            s["exp_avg"].add_(1.0)


def test_async_save_writes_the_state_of_the_call_even_if_training_goes_on(tmp_path: Path) -> None:
    net, opt = _trained()
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    expected_avg = [s["exp_avg"].clone() for s in opt.state.values()]
    sync = CheckpointWriter(0, 1, async_save=False, pointer_dir=tmp_path / "sync")
    sync.save(_checkpoint(net, opt, 2), tmp_path / "sync" / "a.ckpt", step=2)
    gate = threading.Event()
    asynchronous = CheckpointWriter(0, 1, async_save=True, pointer_dir=tmp_path / "async", fault_point=lambda step: gate.wait(10))
    asynchronous.save(_checkpoint(net, opt, 2), tmp_path / "async" / "a.ckpt", step=2)
    assert asynchronous.pending and not (tmp_path / "async" / "a.ckpt").exists(), "the write happens in the background"
    _disturb(net, opt)  # the step loop goes on while the write is pending
    gate.set()
    asynchronous.close()
    for mode in ("sync", "async"):
        path = tmp_path / mode / "a.ckpt"
        loaded = torch.load(path, weights_only=False)
        assert loaded.keys() >= {"epoch", "global_step", "hyper_parameters", "state_dict", STATE_KEY}
        assert "optimizer_states" not in loaded, "optimizer shards live in the DCP directory only"
        for k, v in expected.items():
            torch.testing.assert_close(loaded["state_dict"][k], v, rtol=0, atol=0)
        # The DCP directory restores model and optimizer into a fresh pair.
        fresh, fresh_opt = _trained(seed=1)
        meta, dcp_dir = checkpoint_io.read_checkpoint(last_checkpoint(tmp_path / mode))  # type: ignore[arg-type]
        assert meta[STATE_KEY]["step"] == 2 and dcp_dir.parent.name == STORE
        model_state, opt_state = fresh.state_dict(), fresh_opt.state_dict()
        checkpoint_io.load_into(dcp_dir, model_state, [opt_state])
        fresh_opt.load_state_dict(opt_state)
        for k, v in expected.items():
            torch.testing.assert_close(fresh.state_dict()[k], v, rtol=0, atol=0)
        for got, want in zip([s["exp_avg"] for s in fresh_opt.state.values()], expected_avg):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_load_from_checkpoint_reads_the_consolidated_file(tmp_path: Path) -> None:
    net, opt = _trained()
    CheckpointWriter(0, 1, async_save=False).save(_checkpoint(net, opt, 3), tmp_path / "best.ckpt", step=3)
    restored = Net.load_from_checkpoint(tmp_path / "best.ckpt")
    for k, v in net.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[k], v, rtol=0, atol=0)
    # Without consolidation the file is small and names only its shards.
    CheckpointWriter(0, 1, async_save=False, consolidate=False).save(_checkpoint(net, opt, 3), tmp_path / "thin.ckpt", step=3)
    assert "state_dict" not in torch.load(tmp_path / "thin.ckpt", weights_only=False)


def test_a_write_cut_off_before_publication_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    net, opt = _trained()

    def die_at_4(step: int) -> None:
        if step == 4:
            raise SystemExit("killed")  # stands in for SIGKILL: nothing after this point runs

    writer = CheckpointWriter(0, 1, async_save=True, pointer_dir=tmp_path, fault_point=die_at_4)
    writer.save(_checkpoint(net, opt, 2), tmp_path / "step-00000002.ckpt", step=2)
    writer.save(_checkpoint(net, opt, 4), tmp_path / "step-00000004.ckpt", step=4)
    with pytest.raises(SystemExit):
        writer.wait()
    assert list((tmp_path / STORE).glob("step-00000004.ckpt-*.tmp")), "the write should have been cut off mid-way"
    assert not (tmp_path / "step-00000004.ckpt").exists()
    assert last_checkpoint(tmp_path) == tmp_path / "step-00000002.ckpt"
    assert resolve_ckpt_path("last", tmp_path) == str(tmp_path / "step-00000002.ckpt")
    assert torch.load(tmp_path / POINTER, weights_only=False)[STATE_KEY]["step"] == 2
    # The next publication clears the dead writer's leftover.
    writer.save(_checkpoint(net, opt, 6), tmp_path / "step-00000006.ckpt", step=6)
    writer.close()
    assert not list((tmp_path / STORE).glob("*.tmp"))
    assert last_checkpoint(tmp_path) == tmp_path / "step-00000006.ckpt"


def test_removal_waits_for_the_pending_publication_and_rewrites_keep_one_version(tmp_path: Path) -> None:
    net, opt = _trained()
    gate = threading.Event()
    writer = CheckpointWriter(0, 1, async_save=True, pointer_dir=tmp_path, fault_point=lambda step: step == 4 and gate.wait(10))
    writer.save(_checkpoint(net, opt, 2), tmp_path / "step-00000002.ckpt", step=2)
    writer.save(_checkpoint(net, opt, 4), tmp_path / "step-00000004.ckpt", step=4)
    writer.remove(tmp_path / "step-00000002.ckpt")  # ModelCheckpoint's top-k removal, right after the save
    assert last_checkpoint(tmp_path) == tmp_path / "step-00000002.ckpt", "still the newest complete one"
    gate.set()
    writer.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == [STORE, POINTER, "step-00000004.ckpt"]
    assert [p.name.split("-")[1] for p in (tmp_path / STORE).iterdir()] == ["00000004.ckpt"]
    # Saving the same name again (save_last=True's last.ckpt) replaces it and leaves one DCP version.
    for step in (5, 6):
        writer.save(_checkpoint(net, opt, step), tmp_path / "last.ckpt", step=step)
    writer.close()
    assert not (tmp_path / POINTER).is_symlink(), "Lightning's own last.ckpt is not overwritten by the pointer"
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)[STATE_KEY]["step"] == 6
    assert len(list((tmp_path / STORE).glob("last.ckpt-*"))) == 1


def test_fallback_is_plain_model_checkpoint_configuration(tmp_path: Path) -> None:
    cb = fallback_checkpoint(tmp_path, every_n_steps=3)
    assert (cb.monitor, cb.mode, cb.save_top_k, cb._every_n_train_steps) == ("step", "max", 2, 3)
    assert cb.format_checkpoint_name({"step": torch.tensor(4)}) == str(tmp_path / "step-00000004.ckpt")
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        fallback_checkpoint(tmp_path, every_n_steps=0)


def test_resolve_errors_are_clear(tmp_path: Path) -> None:
    assert resolve_ckpt_path(None, tmp_path) is None
    assert resolve_ckpt_path("some/file", None) == "some/file"
    with pytest.raises(FileNotFoundError, match=f"no '{POINTER}' pointer"):
        resolve_ckpt_path("last", tmp_path)
    with pytest.raises(ValueError, match="recover.checkpoint.dir"):
        resolve_ckpt_path("last", None)
    with pytest.raises(IsADirectoryError, match="pass a checkpoint file"):
        checkpoint_io.read_checkpoint(tmp_path)
    (tmp_path / "foreign.ckpt").write_bytes(b"")
    torch.save({"state_dict": {}}, tmp_path / "foreign.ckpt")
    with pytest.raises(ValueError, match="not written by ReCoVerHSDPStrategy"):
        checkpoint_io.read_checkpoint(tmp_path / "foreign.ckpt")
