"""The collectives of the fault-aware communicator: bucketed reductions, broadcasts, gathers (ReCoVer's fault-aware collectives).

:class:`Collectives` is the base class of
:class:`~lightning_recover.comm.communicator.FaultTolerantComm` that moves data within the
current world; the communicator keeps the membership (agreement, repair, grow, the data
plane of each world epoch) these run on, and its ``_fail`` turns every MPI error raised
here into a :class:`~lightning_recover.comm.interface.PeerFailure` (revoke, gate) or
re-raises it.

* ``allreduce(tensors)`` SUM-reduces a list of tensors in buckets. Every bucket records
  the **world epoch** (the membership generation, bumped by every repair; not a data
  epoch) it completed in, so after a repair the caller can tell which buckets are stale
  (reduced under an older membership) and must be rolled back and reduced again.
  16-bit tensors are reduced in fp32: MPI has no bf16 type and a 16-bit buffer passed as
  bytes sums silently wrong. ``across="replicas"`` goes over this world epoch's data
  plane (:mod:`lightning_recover.comm.data_plane`), ``across="world"`` over MPI on the world.
* Broadcasts (tensors byte for byte, a few integers, a picklable object), an object
  all-gather and a barrier, over the current world.

Importing this module imports no torch: the methods that handle tensors import it (their
caller has loaded it already), and annotations name it only for type checkers.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from lightning_recover.comm import mpi_wait
from lightning_recover.comm.buckets import ReduceHandle, plan_buckets
from lightning_recover.comm.data_plane import DataPlane, MPIDataPlane, native_dtypes, widened_dtypes
from lightning_recover.comm.interface import PeerFailure
from lightning_recover.comm.ulfm import mpi, unblock_cid_allocation

#: What a garbled object collective raises (see Collectives._garbled).
UNPICKLING_ERRORS: tuple[type[BaseException], ...] = (MemoryError, OverflowError, EOFError, pickle.UnpicklingError)

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

__all__ = ["Collectives"]


class Collectives:
    """The data-moving half of :class:`~lightning_recover.comm.communicator.FaultTolerantComm` (its base class).

    It holds no state of its own: the attributes below are the communicator's, set up by
    it and replaced by its repair and grow."""

    #: The current world and this rank's shard communicator in it.
    world: MPI.Intracomm
    shard_comm: MPI.Intracomm
    #: Membership generation: buckets are tagged with it.
    world_epoch: int
    bucket_bytes: int
    #: This world epoch's data plane (None until this rank has a world), and MPI on the world for ``across="world"``.
    data_plane: DataPlane | None
    _world_plane: MPIDataPlane | None
    #: The communicator's: an MPI error of ``where`` as the PeerFailure to raise (or the error itself, re-raised).
    _fail: Callable[[str, MPI.Exception], PeerFailure]
    _failure_confirmed: Callable[[], bool]
    peer_failure: Callable[[str], PeerFailure]

    def allreduce(
        self,
        tensors: Sequence[torch.Tensor],
        out: Sequence[torch.Tensor],
        *,
        handle: ReduceHandle | None = None,
        across: str = "replicas",
        on_bucket: Callable[[int], None] | None = None,
        after_bucket: Callable[[int], None] | None = None,
    ) -> ReduceHandle:
        """SUM-reduce ``tensors`` across replicas (same shard index) in buckets.

        Always out of place: the sums land in ``out`` and ``tensors`` stay the local values,
        the rollback copy a stale bucket is reduced again from (the step's caller owns both:
        :class:`~lightning_recover.callbacks.reduction_buffers.ReductionBuffers`).
        Pass the returned ``handle`` back after :meth:`repair` to redo exactly the buckets
        that are not complete in the current world epoch (create it up front with
        :meth:`plan` so it survives the exception). ``across="world"`` reduces over every
        rank instead of one shard index, always over MPI (small: the step's loss header and
        logged values); ``"replicas"`` goes over this world epoch's :attr:`data_plane`. ``on_bucket(i)`` runs before bucket ``i`` (fault
        injection); ``after_bucket(i)`` runs once bucket ``i`` completed and carries the
        current world epoch.
        """
        plane = self._plane_for(across)
        dsts = list(out)
        self._check_tensors(tensors, dsts)
        if handle is None:
            handle = self.plan(tensors)
        for i in handle.pending(self.world_epoch):
            if on_bucket is not None:
                on_bucket(i)
            bucket = handle.buckets[i]
            bucket.world_epoch = None
            plane.reduce(bucket, tensors, dsts, f"reduce of bucket {i}/{len(handle.buckets)}")
            bucket.world_epoch = self.world_epoch
            if after_bucket is not None:
                after_bucket(i)
        return handle

    def plan(self, tensors: Sequence[torch.Tensor]) -> ReduceHandle:
        """A fresh handle splitting ``tensors`` into buckets of about ``bucket_bytes``."""
        itemsize = max((4 if t.dtype in widened_dtypes() else t.element_size()) for t in tensors) if tensors else 4
        return ReduceHandle(plan_buckets([t.numel() for t in tensors], max(1, self.bucket_bytes // itemsize)))

    def _plane_for(self, across: str) -> DataPlane:
        """This world epoch's data plane for ``across="replicas"``; MPI on the world for ``"world"``."""
        plane = self.data_plane if across == "replicas" else self._world_plane if across == "world" else None
        if plane is None:
            self._comm_for(across)  # names a bad ``across``
            raise RuntimeError("this rank has no world yet: a replacement reduces only after grow()")
        return plane

    def _comm_for(self, across: str) -> MPI.Comm:
        if across == "replicas":
            return self.shard_comm
        if across == "world":
            return self.world
        raise ValueError(f"across must be 'replicas' or 'world', got {across!r}")

    @staticmethod
    def _check_tensors(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
        if len(src) != len(dst):
            raise ValueError(f"got {len(src)} input tensors but {len(dst)} outputs")
        for i, (a, b) in enumerate(zip(src, dst)):
            if a.numel() != b.numel() or a.dtype != b.dtype:
                raise ValueError(f"tensor {i}: output {tuple(b.shape)}/{b.dtype} does not match input {tuple(a.shape)}/{a.dtype}")
            if not (a.is_contiguous() and b.is_contiguous()):
                raise ValueError(f"tensor {i} is not contiguous; call .contiguous() before reducing")
            if a.dtype not in native_dtypes() and a.dtype not in widened_dtypes():
                raise TypeError(
                    f"tensor {i} has dtype {a.dtype}, which cannot be summed over MPI; "
                    f"use one of {sorted(str(d) for d in [*native_dtypes(), *widened_dtypes()])}"
                )


    def barrier(self) -> None:
        """Wait for every member; on an oversubscribed host asleep (:mod:`~.mpi_wait`), not spinning."""
        try:
            if mpi_wait.polite():
                mpi_wait.wait(self.world.Ibarrier())
            else:
                self.world.Barrier()
        except mpi().Exception as exc:
            raise self._fail("barrier", exc) from None

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], root: int = 0, across: str = "replicas") -> None:
        """Overwrite ``tensors`` with the root's values, byte for byte (any dtype; CUDA via host)."""
        import torch

        MPI = mpi()
        comm = self._comm_for(across)
        for t in tensors:
            host = t if t.device.type == "cpu" else t.cpu()
            if not host.is_contiguous():
                raise ValueError("broadcast_tensors needs contiguous tensors")
            try:
                comm.Bcast(host.view(-1).view(torch.uint8).numpy(), root=root)
            except MPI.Exception as exc:
                raise self._fail("broadcast", exc) from None
            if host is not t:
                t.copy_(host)

    def broadcast_codes(self, codes: Sequence[int], root: int = 0) -> list[int]:
        """Broadcast a few integers from current-world rank ``root`` (a buffer broadcast: no pickling)."""
        MPI = mpi()
        buf = np.array(list(codes), dtype=np.int64)
        try:
            self.world.Bcast([buf, MPI.INT64_T], root=root)
        except MPI.Exception as exc:
            raise self._fail("broadcast", exc) from None
        return [int(v) for v in buf]

    def duplicate_world(self) -> MPI.Intracomm:
        """A duplicate of the world (collective) with errors returned, for traffic apart from the step's.

        Called with no other communicator creation of this process under way (a re-join attempt's
        start; an earlier attempt's creation either ended or never returns): a creation an earlier
        attempt's failure left marked would otherwise hold this one forever (:func:`unblock_cid_allocation`)."""
        MPI = mpi()
        unblock_cid_allocation()
        try:
            dup = self.world.Dup()
        except MPI.Exception as exc:
            raise self._fail("duplicating the world", exc) from None
        dup.Set_errhandler(MPI.ERRORS_RETURN)
        return dup

    def bcast_object(self, obj: object, root: int = 0) -> object:
        """Broadcast a picklable object from current-world rank ``root``."""
        try:
            return self.world.bcast(obj, root=root)
        except mpi().Exception as exc:
            raise self._fail("broadcast", exc) from None
        except UNPICKLING_ERRORS as exc:
            raise self._garbled("broadcast", exc) from None

    def allgather_object(self, obj: object) -> list[object]:
        """Every current-world rank's picklable ``obj``, in rank order."""
        try:
            return self.world.allgather(obj)
        except mpi().Exception as exc:
            raise self._fail("allgather", exc) from None
        except UNPICKLING_ERRORS as exc:
            raise self._garbled("allgather", exc) from None

    def _garbled(self, where: str, exc: BaseException) -> BaseException:
        """An object collective whose bytes could not be unpickled: a peer's death, if one is known.

        mpi4py gathers the pickles' sizes before their bytes; a peer SIGKILLed between the two
        can leave a size that was never sent, and the receive buffer's allocation then fails
        (MemoryError, seen in the host campaign when a host's ranks died during a corruption
        check) or the bytes do not unpickle, without any MPI error. With a failure confirmed
        that is the membership change it is; otherwise it is a real error and stays one."""
        if self._failure_confirmed():
            return self.peer_failure(where)
        return exc
