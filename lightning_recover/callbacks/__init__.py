"""Callbacks of the recovery protocol (ReCoVer's in-step recovery), fault injection and checkpoints.

The step engine reduces; these own the decisions around a reduction, through the recovery
hooks of :mod:`lightning_recover.recovery.hooks`: where the sums land and what a spare
sends (:class:`ReductionBuffers`), the rule that only buckets reduced under one world
epoch are committed (:class:`EpochCheck`), which extra microbatches a replica runs
after a failure (:class:`BoundaryScheduler`), and that every live rank holds the leader's
module buffers after each committed step (:class:`BufferSync`); with ``recover.sdc`` on,
that the replicas' state still agrees bit for bit (:class:`CorruptionCheck`). The strategy installs
default instances before Lightning's setup hooks run; pass configured ones in
``Trainer(callbacks=[...])`` to replace them. :class:`RecoveryCallback` is the base for your own.

  base               RecoveryCallback: a Lightning callback that also gets the recovery hooks
  reduction_buffers  where the sums land and what a spare sends
  epoch_check        only buckets reduced under one world epoch are committed
  boundary           which extra microbatches a replica runs after a failure
  buffer_sync        every live rank holds the leader's module buffers after each commit
  corruption_check   with recover.sdc on: the replicas still agree bit for bit
  fault_injection    scripted faults at named points of a step (tests, chaos campaign)
  checkpoint         fallback checkpoints: where they go, which one a restart resumes
  loggers            logs (CSV, TensorBoard) that survive a change of leader
"""

from lightning_recover.callbacks.base import RecoveryCallback
from lightning_recover.callbacks.boundary import BoundaryScheduler
from lightning_recover.callbacks.buffer_sync import BufferSync, broadcast_buffers
from lightning_recover.callbacks.checkpoint import fallback_checkpoint, last_checkpoint, resolve_ckpt_path
from lightning_recover.callbacks.corruption_check import CorruptionCheck, SilentDataCorruptionError
from lightning_recover.callbacks.epoch_check import EpochCheck, StaleBucketError
from lightning_recover.callbacks.fault_injection import FaultInjection, FaultSpec
from lightning_recover.callbacks.reduction_buffers import ReductionBuffers

__all__ = [
    "BoundaryScheduler",
    "BufferSync",
    "CorruptionCheck",
    "EpochCheck",
    "FaultInjection",
    "FaultSpec",
    "RecoveryCallback",
    "ReductionBuffers",
    "SilentDataCorruptionError",
    "StaleBucketError",
    "broadcast_buffers",
    "fallback_checkpoint",
    "last_checkpoint",
    "resolve_ckpt_path",
]
