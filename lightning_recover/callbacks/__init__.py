"""Callbacks of the recovery protocol (layer 2) and fault injection.

The strategy reduces; these own the decisions around a reduction: the rollback copies of
gradient buckets (:class:`GradientSnapshot`), the rule that only buckets reduced under one
membership are committed (:class:`EpochCheck`), and which extra microbatches a replica
runs after a failure (:class:`BoundaryScheduler`). The strategy installs default
instances itself; pass configured ones in ``Trainer(callbacks=[...])`` to replace them.
"""

from lightning_recover.callbacks.boundary import BoundaryScheduler
from lightning_recover.callbacks.checkpoint import ReplicaCheckpoint, last_checkpoint, resolve_ckpt_path
from lightning_recover.callbacks.epoch_check import EpochCheck, StaleBucketError
from lightning_recover.callbacks.fault_injection import FaultInjection, FaultSpec
from lightning_recover.callbacks.snapshot import GradientSnapshot

__all__ = [
    "BoundaryScheduler",
    "EpochCheck",
    "FaultInjection",
    "FaultSpec",
    "GradientSnapshot",
    "ReplicaCheckpoint",
    "StaleBucketError",
    "last_checkpoint",
    "resolve_ckpt_path",
]
