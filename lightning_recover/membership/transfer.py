"""The state transfer of an admission: the donor replica's checkpoint, shard by shard, to the replacements.

Once the world grew (:meth:`FaultTolerantComm.grow`), the donor replica -- the lowest live
veteran (:func:`donor_and_recipients`) -- sends Lightning's own checkpoint, dumped in
memory, to the replacements of its shard (:func:`send_state`), which rebuild it
(:func:`recv_state`) and restore it as Lightning restores a ``ckpt_path``. The dict's
skeleton travels pickled and every tensor as its raw bytes (no pickling of tensor data); a
DTensor goes as its local shard and is rebuilt on the replacement's mesh. A peer's death
during the transfer is an ordinary failure of the world (:class:`PeerFailure`): the step
engine repairs and the admission is retried or dropped by its caller.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from lightning_recover.comm.communicator import FaultTolerantComm

__all__ = ["donor_and_recipients", "recv_state", "send_state"]

TAG_STATE = 7303


def _mpi() -> Any:
    """``mpi4py.MPI``, imported on first use: the import initializes MPI, which the joiner does itself first."""
    from mpi4py import MPI

    return MPI


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by a placeholder (its index in ``tensors``, and how to rebuild it)."""
    import torch
    if isinstance(obj, torch.Tensor):
        spec = None
        local = obj
        if hasattr(obj, "to_local") and hasattr(obj, "placements"):
            # The mesh dimensions it lives on: with tensor parallel, FSDP2 leaves a parameter that no TP plan
            # split on the replica mesh's "data_parallel" dimension alone, the others on both.
            mesh_dims = tuple(obj.device_mesh.mesh_dim_names or ()) if hasattr(obj, "device_mesh") else ()
            spec = {"placements": tuple(obj.placements), "shape": tuple(obj.shape), "stride": tuple(obj.stride()), "mesh_dims": mesh_dims}
            local = obj.to_local()
        tensors.append(local.detach().to("cpu").contiguous())
        return _Placeholder(len(tensors) - 1, tuple(local.shape), local.dtype, spec)
    if isinstance(obj, dict):
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_flatten(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_flatten(v, tensors) for v in obj)
    return obj


@dataclass(frozen=True)
class _Placeholder:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    #: For a DTensor: its placements and global shape/stride (rebuilt on the joiner's mesh).
    dtensor: dict[str, Any] | None


def _submesh(mesh: Any, dims: tuple[str, ...]) -> Any:
    """The part of the joiner's replica ``mesh`` spanned by the named ``dims`` (the whole mesh when they are all of it)."""
    if not dims or tuple(mesh.mesh_dim_names or ()) == dims:
        return mesh
    return mesh[dims[0] if len(dims) == 1 else dims]


def _restore(obj: Any, tensors: Sequence[torch.Tensor], mesh: Any, device: torch.device) -> Any:
    if isinstance(obj, _Placeholder):
        t = tensors[obj.index].to(device)
        if obj.dtensor is not None:
            from torch.distributed.tensor import DTensor

            on = _submesh(mesh, obj.dtensor.get("mesh_dims", ()))
            return DTensor.from_local(t, on, obj.dtensor["placements"], shape=obj.dtensor["shape"], stride=obj.dtensor["stride"])
        return t
    if isinstance(obj, dict):
        return {k: _restore(v, tensors, mesh, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore(v, tensors, mesh, device) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_restore(v, tensors, mesh, device) for v in obj)
    return obj


def _bytes(t: torch.Tensor) -> np.ndarray:
    import torch

    return t.view(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)


def send_state(comm: FaultTolerantComm, state: dict[str, Any], to: Sequence[int]) -> int:
    """Send ``state`` (a checkpoint dict; DTensors go as their local shard) to world ranks ``to``; returns bytes sent.

    The skeleton travels pickled, every tensor as its raw bytes (no pickling of tensor data).
    A peer death raises :class:`PeerFailure` (through the communicator's failure path).
    """
    MPI = _mpi()
    tensors: list[torch.Tensor] = []
    skeleton = pickle.dumps(_flatten(state, tensors), protocol=pickle.HIGHEST_PROTOCOL)
    header = np.frombuffer(skeleton, dtype=np.uint8)
    sent = 0
    try:
        for dest in to:
            comm.world.Send([np.array([header.size], dtype=np.int64), MPI.INT64_T], dest=dest, tag=TAG_STATE)
            comm.world.Send([header, MPI.BYTE], dest=dest, tag=TAG_STATE)
            for t in tensors:
                comm.world.Send([_bytes(t), MPI.BYTE], dest=dest, tag=TAG_STATE)
            sent += header.size + sum(t.numel() * t.element_size() for t in tensors)
    except MPI.Exception as exc:
        raise comm.fail_for("state transfer", exc) from None
    return sent


def recv_state(comm: FaultTolerantComm, source: int, mesh: Any, device: torch.device) -> dict[str, Any]:
    """Receive what :func:`send_state` sent from world rank ``source``; DTensors are rebuilt on ``mesh``."""
    import torch

    MPI = _mpi()
    try:
        n = np.zeros(1, dtype=np.int64)
        comm.world.Recv([n, MPI.INT64_T], source=source, tag=TAG_STATE)
        header = np.empty(int(n[0]), dtype=np.uint8)
        comm.world.Recv([header, MPI.BYTE], source=source, tag=TAG_STATE)
        skeleton = pickle.loads(header.tobytes())
        tensors: list[torch.Tensor] = []
        for ph in sorted(_placeholders(skeleton), key=lambda p: p.index):
            t = torch.empty(ph.shape, dtype=ph.dtype)
            if t.numel():
                comm.world.Recv([_bytes(t), MPI.BYTE], source=source, tag=TAG_STATE)
            tensors.append(t)
    except MPI.Exception as exc:
        raise comm.fail_for("state transfer", exc) from None
    return _restore(skeleton, tensors, mesh, device)


def _placeholders(obj: Any) -> Iterator[_Placeholder]:
    if isinstance(obj, _Placeholder):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _placeholders(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _placeholders(v)


def donor_and_recipients(comm: FaultTolerantComm, joiners: Sequence[int]) -> tuple[int, dict[int, list[int]]]:
    """The donor replica (the lowest live veteran) and, per shard, the world ranks of the replacements it sends to."""
    members = comm.members
    veterans = [r for r in comm.alive_replicas if r not in joiners]
    if not veterans:
        # Not a PeerFailure: a repair cannot bring a donor back, and retrying would loop forever.
        raise RuntimeError(
            f"every replica that held the live state died before the transfer (live: {list(comm.alive_replicas)}, "
            f"all replacements); relaunch from the newest checkpoint (ckpt_path=last)"
        )
    donor = veterans[0]
    layout = comm.layout
    to: dict[int, list[int]] = {}
    for s in range(layout.shards):
        to[s] = [members.index(layout.rank_of(r, s)) for r in joiners if layout.rank_of(r, s) in members]
    return donor, to
