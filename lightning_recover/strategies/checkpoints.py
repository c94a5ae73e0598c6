"""The strategy's checkpoint hooks: who writes, what the checkpoint carries, and a resume.

Lightning calls the strategy to save, remove and load checkpoints; :class:`Checkpoints`
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
  refused (the communicator's fences).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_recover import _lightning
from lightning_recover.recovery.job import RecoveryJob
from lightning_recover.strategies import checkpoint_io

__all__ = ["Checkpoints"]


class Checkpoints:
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
        """Only the leader replica writes; the checkpoint gets the protocol state."""
        comm = self._job.comm
        assert comm is not None
        if comm.alive_replicas[0] != comm.replica:
            return
        if storage_options is not None:
            raise TypeError(f"ReCoVerHSDPStrategy.save_checkpoint takes no storage_options (got {storage_options!r}); pass None")
        state = checkpoint[checkpoint_io.STATE_KEY] = self._protocol_state()
        comm.check_fences("checkpoint")
        if self._job.ledger is not None:
            # Every ledger line up to this step durable before the checkpoint can be published:
            # a relaunch from it after an OS crash finds no step missing (see lightning_recover.audit.ledger).
            self._job.ledger.sync()
        with self._guard("checkpoint save"):
            self.writer.save(checkpoint, filepath, step=int(state["step"]))

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
