"""After every committed step, every live rank holds the leader's module buffers.

This is DDP's ``broadcast_buffers`` for the recovery protocol. Buffers are not gradients:
BatchNorm's running statistics move in every forward on each rank's own data (and each
shard rank of a replica sees only its slice of a microbatch), so without a sync the
replicas, and the shard ranks of one replica, drift apart, and validation metrics, the
best checkpoint and test results depend on which rank is asked.

:class:`BufferSync` acts in ``on_step_committed`` (the optimizer has stepped): world rank 0
of the current membership, the *leader* (shard 0 of the lowest live replica), broadcasts
every buffer of the model to every live rank over the ULFM world communicator, packed into
one message. The hook gets the communicator and ``StepEngine.run_collective`` from the
engine as its ``collectives`` argument (:class:`~lightning_recover.recovery.hooks.StepCollectives`),
so a death during the broadcast is repaired like any other and the broadcast is redone
from the leader of the repaired world; the buffers are overwritten only once one
membership agreed that the broadcast completed.

* Every buffer is sent, whatever its dtype, as DDP does. Integer buffers can differ too:
  BatchNorm's ``num_batches_tracked`` counts forwards, and a replica that replays a lost
  replica's microbatches at a boundary step runs more of them (with ``momentum=None`` the
  count also weighs the running average).
* Bytes are copied, never reduced: every rank ends bitwise equal to the leader.
* Parameters, gradients, the reduction and the RNG are never touched, and a model without
  buffers (or a one-rank job) costs nothing: no collective at all.
* Buffers no rank changed cost nothing either. Before the step's reduction each rank votes
  whether its buffers differ from what the last sync left (a bit-exact print); the votes
  are summed with the step's loss, so every rank decides alike, and when none moved there
  is no broadcast and no agreement (a constant causal mask, frozen statistics). A buffer
  changed only in backward is synced one step later, with the next vote.
* FSDP2 does not shard buffers: every shard rank holds each one whole, so one broadcast
  across the world serves replicas and shard ranks alike. A buffer that the user made a
  sharded DTensor (in ``configure_model``) differs between shard ranks by design; its
  local shard is broadcast across replicas only, from the leader replica's rank that
  holds the same shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from typing_extensions import override

from lightning_recover.audit.corruption import Fingerprint, fingerprint
from lightning_recover.callbacks.base import RecoveryCallback
from lightning_recover.recovery.hooks import StepCollectives
from lightning_recover.recovery.state import StepState

# Each buffer starts at a multiple of this many bytes in the packed message, so the bytes
# can be viewed as any dtype again (complex128 is the widest element: 16 bytes).
_ALIGN = 16


class BufferComm(Protocol):
    """What the sync needs of the communicator (:class:`~lightning_recover.comm.communicator.FaultTolerantComm`)."""

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], root: int = 0, across: str = "replicas") -> None: ...


class _Packed:
    """A group of tensors laid out in one flat byte tensor, each at an aligned offset."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.offsets: list[int] = []
        size = 0
        for t in tensors:
            self.offsets.append(size)
            size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        devices = {t.device for t in tensors}
        # Packing on the buffers' own device costs one host copy for the whole group.
        self.stage = torch.empty(size, dtype=torch.uint8, device=devices.pop() if len(devices) == 1 else "cpu")

    def pack(self) -> None:
        for t, off in zip(self.tensors, self.offsets):
            raw = t.detach().reshape(-1).view(torch.uint8)
            self.stage[off : off + raw.numel()].copy_(raw)

    def unpack(self) -> None:
        with torch.no_grad():
            for t, off in zip(self.tensors, self.offsets):
                n = t.numel() * t.element_size()
                t.copy_(self.stage[off : off + n].view(t.dtype).view(t.shape))


def _by_reach(module: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The module's buffers (their local tensors) that are whole on every rank, and the sharded ones."""
    whole: list[torch.Tensor] = []
    sharded: list[torch.Tensor] = []
    for buf in module.buffers():
        placements = getattr(buf, "placements", None)
        if placements is None:
            whole.append(buf)
        elif all(p.is_replicate() for p in placements):
            whole.append(buf.to_local())  # type: ignore[attr-defined]
        else:
            sharded.append(buf.to_local())  # type: ignore[attr-defined]
    return whole, sharded


def broadcast_buffers(module: torch.nn.Module, comm: BufferComm, run_collective: Callable[[Callable[[], None]], Any]) -> int:
    """Overwrite every buffer of ``module`` on every live rank with the leader's; returns the bytes sent.

    ``run_collective`` retries the broadcast until one membership agrees it completed
    (``StepEngine.run_collective``). Returns 0, without any collective, when the module
    has no buffers.
    """
    whole, sharded = _by_reach(module)
    groups = [(_Packed(ts), across) for ts, across in ((whole, "world"), (sharded, "replicas")) if ts]
    if not groups:
        return 0

    def attempt() -> None:
        # Packed afresh on every attempt: after a repair the root is the new leader,
        # whose buffers are still its own (nothing is unpacked before agreement).
        for packed, across in groups:
            packed.pack()
            comm.broadcast_tensors([packed.stage], root=0, across=across)

    run_collective(attempt)
    for packed, _ in groups:
        packed.unpack()
    return sum(packed.stage.numel() for packed, _ in groups)


class BufferSync(RecoveryCallback):
    """After each committed step, broadcast the model's buffers from the leader to every live rank.

    Installed by default. ``BufferSync(enabled=False)`` in ``Trainer(callbacks=[...])``
    turns it off, like ``DDPStrategy(broadcast_buffers=False)``: each rank then keeps the
    buffers of its own data.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        #: Bytes broadcast after the last committed step (0: nothing to send).
        self.last_bytes = 0
        # The buffers' print right after the last sync (None: never synced on this rank), and
        # whether any rank's buffers moved since, as the step's vote said.
        self._synced: Fingerprint | None = None
        self._changed = True

    @override
    def on_before_reduce(self, trainer: Any, pl_module: Any, step: StepState, collectives: StepCollectives) -> None:
        # Buffers move in forward, and every planned forward has run by now (an overlapped
        # round starts at the last backward). A constant buffer (a causal mask) then costs
        # no broadcast and no agreement: the vote rides on the step's own loss reduction.
        if self._active(trainer, pl_module):
            step.requests.votes["buffers_changed"] = float(self._synced is None or self._print(pl_module) != self._synced)

    @override
    def on_before_commit(self, trainer: Any, pl_module: Any, step: StepState) -> None:
        self._changed = step.requests.vote_totals.get("buffers_changed", 1.0) > 0

    @override
    def on_step_committed(self, trainer: Any, pl_module: Any, record: dict[str, Any], collectives: StepCollectives) -> None:
        if not self._active(trainer, pl_module) or not self._changed:
            self.last_bytes = 0
            return
        # The job's FaultTolerantComm: broadcast_tensors is beyond the engine's own ReplicaComm contract.
        self.last_bytes = broadcast_buffers(pl_module, collectives.comm, collectives.run)  # type: ignore[arg-type]
        self._synced = self._print(pl_module)

    def _active(self, trainer: Any, pl_module: Any) -> bool:
        # A recovery hook runs only from a job's step engine, so a communicator is there (the
        # collectives argument); one rank alone has nobody to sync with.
        return bool(self.enabled and pl_module is not None and trainer.strategy.world_size > 1)

    @staticmethod
    def _print(module: torch.nn.Module) -> Fingerprint:
        whole, sharded = _by_reach(module)
        return fingerprint(whole + sharded)
