"""The strategy's checkpoint hooks: who writes, what the checkpoint carries, and a resume.

Lightning calls the strategy to save, remove and load checkpoints; :class:`CheckpointHooks`
answers for it:

* save: only the leader replica writes, through this rank's DCP writer
  (:class:`~.checkpoint_io.CheckpointWriter`, in the background unless
  ``recover.checkpoint.async_save=false``); the checkpoint carries the job's protocol
  state (:meth:`RecoveryJob.state_dict`) under :data:`~.checkpoint_io.STATE_KEY`, and the
  ledger is made durable up to this step before the checkpoint can be published;
* dump: what ``trainer.save_checkpoint`` would write, in memory, with the protocol state
  and the fault count, for the donor of a re-join to send;
* load: Lightning's keys from the file, the model's (and optimizers') shards from the DCP
  directory, resharded; when fitting, the job resumes from the protocol state
  (:meth:`RecoveryJob.load_state_dict`);
* every file operation runs in the replica guard (a replica-mate's death ends this
  replica through the gate), and a write whose world was fenced off by a newer launch is
  refused (the communicator's fences);
* a leader lost while it wrote (:meth:`CheckpointHooks.on_membership`): every rank remembers the
  saves Lightning asked for (:class:`SaveIntent`), so a save the dead leader never
  published is finished by the new leader replica when no step committed since (the
  remembered state is still the state of that save), and otherwise forgotten by every
  rank's ModelCheckpoint, so that no callback reports a path that does not exist; the new
  leader removes the dead writer's unfinished DCP folders either way.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_recover import _lightning
from lightning_recover.recovery.job import RecoveryJob
from lightning_recover.strategies import checkpoint_io

__all__ = ["CheckpointHooks", "SaveIntent"]

#: Saves remembered at most (a rank that never sees them published, e.g. without shared storage, must not grow).
MAX_INTENTS = 8


@dataclass
class SaveIntent:
    """A save Lightning asked every rank for: what the leader replica was to write.

    ``checkpoint`` is Lightning's dict as the save got it (the model's and optimizers' tensors
    by reference: they keep the saved values until the next step commits); ``step`` the global
    step it was made at."""

    checkpoint: dict[str, Any]
    filepath: str
    step: int

    @property
    def published(self) -> bool:
        return checkpoint_io.published(self.filepath, self.step)


class CheckpointHooks:
    """One rank's checkpoint saves and loads; see the module docstring.

    ``protocol_state()``: the job's state of this step with the sample order;
    ``guard(where)``: the strategy's ``replica_guard``."""

    def __init__(
        self, job: RecoveryJob, protocol_state: Callable[[], dict[str, Any]], guard: Callable[[str], AbstractContextManager[None]]
    ) -> None:
        self._job = job
        self._protocol_state = protocol_state
        self._guard = guard
        self._writer: checkpoint_io.CheckpointWriter | None = None
        self._intents: list[SaveIntent] = []
        self._leader: int | None = None  # the leader replica when the saves were asked for

    @property
    def writer(self) -> checkpoint_io.CheckpointWriter:
        """This rank's DCP writer, made at its first use."""
        if self._writer is None:
            job = self._job
            assert job.comm is not None and job.probes is not None
            probes, ckpt = job.probes, job.config.checkpoint
            self._writer = checkpoint_io.CheckpointWriter(
                job.comm.shard, job.config.shards, async_save=ckpt.async_save, consolidate=ckpt.consolidate,
                pointer_dir=ckpt.dir, fault_point=lambda step: probes.fault_point("checkpoint", step=step),
            )
        return self._writer

    def dump(self, trainer: Any) -> dict[str, Any]:
        """Lightning's own checkpoint of this moment, plus the protocol's state, for a replacement."""
        checkpoint = _lightning.dump_checkpoint(trainer)
        state = checkpoint[checkpoint_io.STATE_KEY] = self._protocol_state()
        state["faults_seen"] = self._job.engine.faults_seen if self._job.engine is not None else 0
        return checkpoint

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None) -> None:
        """Only the leader replica writes; the checkpoint gets the protocol state; every rank remembers the save."""
        comm = self._job.comm
        assert comm is not None
        if storage_options is not None:
            raise TypeError(f"ReCoVerHSDPStrategy.save_checkpoint takes no storage_options (got {storage_options!r}); pass None")
        state = checkpoint[checkpoint_io.STATE_KEY] = self._protocol_state()
        self._remember(SaveIntent(checkpoint, os.fspath(filepath), int(state["step"])), leader=comm.alive_replicas[0])
        if comm.alive_replicas[0] != comm.replica:
            return
        self._write(checkpoint, filepath, int(state["step"]))

    def _write(self, checkpoint: dict[str, Any], filepath: Any, step: int) -> None:
        comm = self._job.comm
        assert comm is not None
        comm.check_fences("checkpoint")
        if self._job.ledger is not None:
            # Every ledger line up to this step durable before the checkpoint can be published:
            # a relaunch from it after an OS crash finds no step missing (see lightning_recover.audit.ledger).
            self._job.ledger.sync()
        with self._guard("checkpoint save"):
            self.writer.save(checkpoint, filepath, step=step)

    def _remember(self, intent: SaveIntent, leader: int) -> None:
        # Published saves need no memory; the rest wait for a publish or for the leader's loss. An
        # earlier step's save can only be forgotten, never written again: its state is let go.
        kept = [i for i in self._intents if not i.published][-(MAX_INTENTS - 1):]
        for i in kept:
            if i.step != intent.step:
                i.checkpoint = {}
        self._intents = [*kept, intent]
        self._leader = leader

    def on_membership(self, trainer: Any) -> None:
        """The world changed: when the leader replica was lost, no callback may report a save it never published.

        Each remembered save not published (the dead leader was writing it, or had it still
        pending in the background) is written now by the new leader replica when its state
        is still the one remembered (no step committed since: ``trainer.global_step`` is the
        save's), and otherwise forgotten by every rank's ModelCheckpoint. The new leader
        removes the dead writer's unfinished DCP folders first. Called on every rank after a
        repair, inside the step where it happened (before that step commits).
        """
        comm = self._job.comm
        if comm is None or self._leader is None:
            return
        leader, before = comm.alive_replicas[0], self._leader
        self._leader = leader
        if leader == before or not self._intents:
            return
        intents, self._intents = self._intents, []
        cut = [i for i in intents if not i.published]
        step = int(trainer.global_step)
        redo = [i for i in cut if i.step == step]
        gone = [i for i in cut if i.step != step]
        say = rank_zero_only(print)
        if comm.replica == leader:
            with self._guard("checkpoint cleanup"):
                for directory in sorted({os.path.dirname(os.path.abspath(i.filepath)) for i in intents}):
                    checkpoint_io.remove_unfinished_writes(directory)
            for intent in redo:
                say(f"[lightning-recover] the leader replica {before} was lost while it saved {intent.filepath} (step "
                    f"{intent.step}); replica {leader} writes it now", file=sys.stderr, flush=True)
                self._write(intent.checkpoint, intent.filepath, intent.step)
        if gone:
            forget_checkpoints(trainer, {os.path.abspath(i.filepath) for i in gone})
            say(f"[lightning-recover] the leader replica {before} was lost before it published "
                f"{', '.join(i.filepath for i in gone)}, and steps committed since: the checkpoint callbacks forget it",
                file=sys.stderr, flush=True)

    def remove(self, filepath: Any) -> None:
        """ModelCheckpoint's top-k removal: the file and its DCP directory, once a pending save is published."""
        with self._guard("checkpoint removal"):
            self.writer.remove(filepath)

    def wait(self) -> None:
        """Block until this rank's background checkpoint write (if any) is published."""
        if self._writer is not None:
            with self._guard("checkpoint write"):
                self._writer.wait()

    def load(self, path: Any, model: torch.nn.Module, optimizers: Sequence[Any], *, fitting: bool) -> dict[str, Any]:
        """The checkpoint at ``path``, resharded to ``model``; when ``fitting``, the job resumes from it."""
        self.wait()
        checkpoint = checkpoint_io.load(path, model, optimizers, fitting=fitting, guard=lambda: self._guard("checkpoint load"))
        if fitting:
            state = checkpoint[checkpoint_io.STATE_KEY]
            self._job.load_state_dict(state)
            assert self._job.layout is not None
            rank_zero_only(print)(
                f"[lightning-recover] resuming at step {state['step']} on {self._job.layout.replicas} replica(s) "
                f"(checkpoint had {len(state['replicas'])}); B={state['B']} from the checkpoint",
                file=sys.stderr,
                flush=True,
            )
        return checkpoint


def forget_checkpoints(trainer: Any, missing: set[str]) -> None:
    """Every ModelCheckpoint of ``trainer`` stops reporting the paths in ``missing`` (absolute):
    they leave its top-k, and its best, k-th best and last are taken again from what remains."""
    for cb in getattr(trainer, "checkpoint_callbacks", []):
        kept = {path: score for path, score in cb.best_k_models.items() if os.path.abspath(path) not in missing}
        if len(kept) == len(cb.best_k_models) and os.path.abspath(cb.best_model_path or "-") not in missing and os.path.abspath(
            cb.last_model_path or "-"
        ) not in missing:
            continue
        cb.best_k_models = kept
        best, worst = (min, max) if cb.mode == "min" else (max, min)
        if kept:
            cb.best_model_path = best(kept, key=kept.get)
            cb.best_model_score = kept[cb.best_model_path]
            cb.kth_best_model_path = worst(kept, key=kept.get)
            cb.kth_value = kept[cb.kth_best_model_path]
        elif os.path.abspath(cb.best_model_path or "-") in missing:
            cb.best_model_path, cb.best_model_score, cb.kth_best_model_path = "", None, ""
        if os.path.abspath(cb.last_model_path or "-") in missing:
            cb.last_model_path = ""
