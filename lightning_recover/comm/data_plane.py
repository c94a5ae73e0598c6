"""The data plane: how one bucket of the cross-replica gradient reduction travels (ReCoVer's fault-aware collectives).

ULFM MPI is the *control plane* of the recovery protocol: it detects failures, agrees and
repairs membership (:mod:`lightning_recover.comm.communicator`). The *data plane* only moves
gradient bytes between the live ranks of one shard index -- the members of this rank's
shard communicator -- and can be MPI itself or a ``torch.distributed`` backend. Its
contract, for every implementation:

* **Per bucket**: ``reduce(bucket, src, dst, where)`` SUM-reduces the ``bucket``'s
  segments of ``src`` over the plane's members and writes the sums into the same segments
  of ``dst`` (``src is dst``: in place). 16-bit floats are summed in fp32, so switching
  planes changes at most the summation order. Every member gets bitwise-identical sums.
  On any error ``dst`` may hold anything in that bucket: the caller's rollback copy
  (:class:`~lightning_recover.comm.buckets.ReduceHandle`) restores it.
* **On a dead peer** it raises :class:`~lightning_recover.comm.interface.PeerFailure`
  -- never hangs, never another exception -- after the control plane revoked its
  communicators (so every peer blocked with it is released, whatever plane that peer is
  blocked in) and applied the replica-consistency gate: exactly what the MPI path always
  did (:meth:`ControlPlane.peer_failure`). A transport error that the control plane does
  not confirm as a failure within the plane's timeout is a real error
  (:class:`DataPlaneError`), not a membership change.
* **Lifetime**: one plane per **world epoch**. The communicator builds it when the epoch
  starts -- at construction, after every ULFM repair and after every re-join
  (``grow``) -- and :meth:`DataPlane.close` ends the previous one. A plane that failed is
  aborted at once and never used again; a plane whose epoch ended is discarded. Neither
  ever blocks the caller: a transport operation that cannot be cancelled is left to a
  daemon thread that holds its buffers until it ends by itself.
* **Threads**: a plane may be called from any thread, one caller at a time (the step
  engine's reduction may run on a helper thread while the main thread runs backward).

Implementations:

* :class:`MPIDataPlane` (``recover.data_plane=mpi``, the default): ``MPI_Allreduce`` on the
  shard communicator, zero-copy for a single-segment bucket of a native dtype.
* :class:`~lightning_recover.comm.torch_plane.TorchDistDataPlane` (``gloo``: CPU, the
  stand-in on this machine; ``nccl``: CUDA): a ``torch.distributed`` group per world epoch
  among the same members (:mod:`lightning_recover.comm.torch_plane`, imported only when
  such a plane is built).
* :class:`FailedPlane`: the plane of an epoch whose set-up already saw a peer failure; it
  raises :class:`PeerFailure` at the first bucket, so the failure is handled where every
  other one is.

``across="world"`` reductions (the step's loss header, Lightning's ``self.log`` sync) are
small and stay on MPI whatever the setting.

Importing this module imports no torch, so that the communicator imports without it
(``benchmarks/scaling_rank.py``): torch is imported where tensors are handled (a caller
that holds tensors has loaded it already), and otherwise only annotations name it.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from lightning_recover.comm import mpi_wait
from lightning_recover.comm.buckets import Bucket
from lightning_recover.comm.interface import PeerFailure
from lightning_recover.config import DATA_PLANES, ConfigurationError
from lightning_recover.errors import RecoverError

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

__all__ = [
    "DATA_PLANES",
    "ControlPlane",
    "DataPlane",
    "DataPlaneError",
    "FailedPlane",
    "MPIDataPlane",
    "check_data_plane",
    "native_dtypes",
    "widened_dtypes",
]


# MPI has native sum support for these; 16-bit floats are widened to fp32 first (MPI has
# no bf16 type, and a 16-bit buffer passed as bytes sums silently wrong). Functions, not
# constants, so that importing this module does not import torch: the first caller holds tensors.
@functools.cache
def native_dtypes() -> dict[torch.dtype, type]:
    """The dtypes MPI sums natively, each with its numpy type."""
    import torch

    return {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}


@functools.cache
def widened_dtypes() -> dict[torch.dtype, torch.dtype]:
    """The 16-bit floats, each with the dtype it is summed in (fp32)."""
    import torch

    return {torch.bfloat16: torch.float32, torch.float16: torch.float32}




class DataPlaneError(RecoverError, RuntimeError):
    """The data plane failed, and the control plane saw no peer failure that explains it."""


class ControlPlane(Protocol):
    """What a data plane needs from the control plane (:class:`~lightning_recover.comm.communicator.FaultTolerantComm`)."""

    def failure_noticed(self) -> bool:
        """Whether a member of the current world is known dead or the world was revoked (drives MPI progress)."""
        ...

    def peer_failure(self, where: str, error_class: int | None = None) -> PeerFailure:
        """Revoke the current world, apply the replica-consistency gate, return the :class:`PeerFailure` to raise."""
        ...


def check_data_plane(kind: str, device_type: str) -> None:
    """Refuse a data plane this process cannot run, with the fix (``device_type``: the strategy's root device)."""
    import torch
    import torch.distributed as dist

    if kind not in DATA_PLANES:
        raise ConfigurationError(
            f"data_plane must be one of {', '.join(DATA_PLANES)}, got {kind!r} (recover.data_plane={kind!r}); "
            "set recover.data_plane=mpi (the default), gloo or nccl"
        )
    if kind == "gloo" and not dist.is_gloo_available():
        raise ConfigurationError("recover.data_plane=gloo: this torch build has no gloo; use recover.data_plane=mpi")
    if kind == "nccl":
        if not torch.cuda.is_available() or device_type != "cuda":
            where = "this process has no CUDA device" if not torch.cuda.is_available() else f"the Trainer runs on {device_type}"
            raise ConfigurationError(
                f"recover.data_plane=nccl needs the gradients on CUDA, but {where}; "
                "use Trainer(accelerator='gpu') on a CUDA machine, or recover.data_plane=gloo or mpi"
            )
        if not dist.is_nccl_available():
            raise ConfigurationError("recover.data_plane=nccl: this torch build has no NCCL; use recover.data_plane=gloo or mpi")


class DataPlane(ABC):
    """One world epoch's transport for the cross-replica buckets; see the module docstring."""

    #: The setting that selects it (``recover.data_plane``).
    kind: ClassVar[str]

    def __init__(self, world_epoch: int, size: int) -> None:
        #: The world epoch this plane was built for; it is never used in another.
        self.world_epoch = world_epoch
        #: Members (live replicas of this shard index), this rank included.
        self.size = size
        #: Buckets this plane reduced (a bucket whose dtypes differ counts once).
        self.reductions = 0

    @abstractmethod
    def reduce(self, bucket: Bucket, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], where: str) -> None:
        """SUM ``bucket``'s segments of ``src`` over the members into ``dst``; :class:`PeerFailure` on a dead peer."""

    def close(self) -> None:  # noqa: B027 - a plane without resources has nothing to release
        """End this plane (its epoch ended, or it failed); never blocks, never raises, idempotent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_epoch={self.world_epoch}, size={self.size})"


def copy_through(bucket: Bucket, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """The sum over a single member: the local values."""
    for ti, s, e in bucket.segments:
        a, b = src[ti].detach().view(-1), dst[ti].detach().view(-1)
        if a.data_ptr() != b.data_ptr():
            b[s:e].copy_(a[s:e])


def by_stage_dtype(bucket: Bucket, src: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, list[tuple[int, int, int]]]]:
    """The bucket's segments grouped by the dtype they are summed in (16-bit floats in fp32)."""
    groups: dict[torch.dtype, list[tuple[int, int, int]]] = {}
    for seg in bucket.segments:
        dtype = src[seg[0]].dtype
        groups.setdefault(widened_dtypes().get(dtype, dtype), []).append(seg)
    return list(groups.items())


def gather(segs: Sequence[tuple[int, int, int]], src: Sequence[torch.Tensor], stage: torch.Tensor) -> None:
    off = 0
    for ti, s, e in segs:
        stage[off : off + e - s].copy_(src[ti].detach().reshape(-1)[s:e])
        off += e - s


def scatter(segs: Sequence[tuple[int, int, int]], stage: torch.Tensor, dst: Sequence[torch.Tensor]) -> None:
    off = 0
    for ti, s, e in segs:
        dst[ti].detach().view(-1)[s:e].copy_(stage[off : off + e - s])
        off += e - s


# ---------------------------------------------------------------------- MPI
class MPIDataPlane(DataPlane):
    """``MPI_Allreduce`` over one communicator (the shard communicator, or the world for ``across="world"``).

    On a host with more ranks than cores it waits without spinning (:mod:`~lightning_recover.comm.mpi_wait`).
    """

    kind = "mpi"

    def __init__(self, comm: MPI.Comm, fail: Callable[[str, Any], PeerFailure], world_epoch: int) -> None:
        super().__init__(world_epoch, comm.Get_size())
        self.comm = comm
        # FaultTolerantComm._fail: an MPI error is a peer failure only if its class says so or a death is known.
        self._fail = fail

    def reduce(self, bucket: Bucket, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], where: str) -> None:
        from mpi4py import MPI

        try:
            self._reduce(bucket, src, dst)
        except MPI.Exception as exc:
            raise self._fail(where, exc) from None
        self.reductions += 1

    def _reduce(self, bucket: Bucket, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
        import torch
        from mpi4py import MPI

        if len(bucket.segments) == 1:
            ti, s, e = bucket.segments[0]
            a, b = src[ti].detach(), dst[ti].detach()
            if a.dtype in native_dtypes() and a.device.type == "cpu" and b.device.type == "cpu":
                # Zero-copy: MPI reads and writes the tensors' own memory.
                send = a.view(-1)[s:e].numpy()
                recv = b.view(-1)[s:e].numpy()
                self._allreduce(MPI.IN_PLACE if a.data_ptr() == b.data_ptr() else send, recv)
                return
        dtypes = {src[ti].dtype for ti, _, _ in bucket.segments}
        if len(dtypes) > 1:
            # Mixed dtypes in one bucket: reduce segment-wise through per-dtype staging.
            for seg in bucket.segments:
                self._reduce(Bucket([seg], seg[2] - seg[1]), src, dst)
            return
        dtype = dtypes.pop()
        stage = torch.empty(bucket.numel, dtype=widened_dtypes().get(dtype, dtype))
        gather(bucket.segments, src, stage)
        self._allreduce(MPI.IN_PLACE, stage.numpy())
        scatter(bucket.segments, stage, dst)

    def _allreduce(self, send: Any, recv: Any) -> None:
        from mpi4py import MPI

        if mpi_wait.polite():
            mpi_wait.wait(self.comm.Iallreduce(send, recv, MPI.SUM))
        else:
            self.comm.Allreduce(send, recv, MPI.SUM)


# ---------------------------------------------------------------------- a plane whose set-up failed
class FailedPlane(DataPlane):
    """An epoch's plane that could not be set up because a peer failed meanwhile (see the module docstring)."""

    def __init__(self, kind: str, control: ControlPlane, world_epoch: int, size: int, reason: str) -> None:
        super().__init__(world_epoch, size)
        self.kind = kind  # type: ignore[misc]  # the plane it stands for
        self._control = control
        self.reason = reason

    def reduce(self, bucket: Bucket, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], where: str) -> None:
        raise self._control.peer_failure(f"{where} (the {self.kind} data plane of world epoch {self.world_epoch} was not set up: {self.reason})")
