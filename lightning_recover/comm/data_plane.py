"""The data plane: how one bucket of the cross-replica gradient reduction travels (layer 1).

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
* :class:`TorchDistDataPlane` (``gloo``: CPU, the stand-in on this machine; ``nccl``:
  CUDA): a ``torch.distributed`` group per world epoch among the same members, made
  without torch's default process group (which is replica-local here, see
  :mod:`lightning_recover.strategies.replica_group`) from a ``TCPStore`` the world's
  leader hosts (address shared over the ULFM world), a ``PrefixStore`` per world epoch and
  shard index. Its group connects lazily, at the epoch's first bucket. Each collective
  runs asynchronously and is polled while the control plane is watched
  (:meth:`ControlPlane.failure_noticed`): a rank blocked in gloo or NCCL cannot see an MPI
  revoke, and gloo only fails the ranks directly connected to a dead one quickly; the
  others would wait for the group timeout. Buckets are staged through a buffer the plane
  owns, so an abandoned operation that still completes later can never write into the
  gradients.
* :class:`FailedPlane`: the plane of an epoch whose set-up already saw a peer failure; it
  raises :class:`PeerFailure` at the first bucket, so the failure is handled where every
  other one is.

``across="world"`` reductions (the step's loss header, Lightning's ``self.log`` sync) are
small and stay on MPI whatever the setting.
"""

from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from lightning_recover.comm import mpi_wait, netaddr
from lightning_recover.comm.buckets import Bucket
from lightning_recover.comm.interface import PeerFailure
from lightning_recover.config import DATA_PLANES, ConfigurationError
from lightning_recover.errors import RecoverError

if TYPE_CHECKING:
    import torch.distributed as dist
    from mpi4py import MPI

__all__ = [
    "DATA_PLANES",
    "ControlPlane",
    "DataPlane",
    "DataPlaneError",
    "FailedPlane",
    "MPIDataPlane",
    "TorchDistDataPlane",
    "check_data_plane",
    "host_store",
]

# MPI has native sum support for these; 16-bit floats are widened to fp32 first (MPI has
# no bf16 type, and a 16-bit buffer passed as bytes sums silently wrong).
NATIVE = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}
WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}

#: How often a torch plane looks at the control plane while a collective is pending.
POLL_S = 0.005


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


def _copy_through(bucket: Bucket, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> None:
    """The sum over a single member: the local values."""
    for ti, s, e in bucket.segments:
        a, b = src[ti].detach().view(-1), dst[ti].detach().view(-1)
        if a.data_ptr() != b.data_ptr():
            b[s:e].copy_(a[s:e])


def _by_stage_dtype(bucket: Bucket, src: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, list[tuple[int, int, int]]]]:
    """The bucket's segments grouped by the dtype they are summed in (16-bit floats in fp32)."""
    groups: dict[torch.dtype, list[tuple[int, int, int]]] = {}
    for seg in bucket.segments:
        dtype = src[seg[0]].dtype
        groups.setdefault(WIDEN.get(dtype, dtype), []).append(seg)
    return list(groups.items())


def _gather(segs: Sequence[tuple[int, int, int]], src: Sequence[torch.Tensor], stage: torch.Tensor) -> None:
    off = 0
    for ti, s, e in segs:
        stage[off : off + e - s].copy_(src[ti].detach().reshape(-1)[s:e])
        off += e - s


def _scatter(segs: Sequence[tuple[int, int, int]], stage: torch.Tensor, dst: Sequence[torch.Tensor]) -> None:
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
        from mpi4py import MPI

        if len(bucket.segments) == 1:
            ti, s, e = bucket.segments[0]
            a, b = src[ti].detach(), dst[ti].detach()
            if a.dtype in NATIVE and a.device.type == "cpu" and b.device.type == "cpu":
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
        stage = torch.empty(bucket.numel, dtype=WIDEN.get(dtype, dtype))
        _gather(bucket.segments, src, stage)
        self._allreduce(MPI.IN_PLACE, stage.numpy())
        _scatter(bucket.segments, stage, dst)

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


# ---------------------------------------------------------------------- torch.distributed
def host_store(hosts: Sequence[str], timeout_s: float) -> tuple[dist.TCPStore, tuple[str, int]]:
    """The leader's ``TCPStore`` for this epoch's groups, and the address the members reach it at.

    ``hosts``: where the members run (loopback when that is this host only)."""
    import torch.distributed as dist

    # Not gethostbyname(gethostname()): 127.0.1.1 on Debian-style hosts (see lightning_recover.comm.netaddr).
    addr = netaddr.reachable_address(hosts)
    # Port 0: the OS picks a free port at bind time, so nothing can take it between choosing and binding.
    store = dist.TCPStore(addr, 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, (addr, int(store.port))


def _reap(works: Sequence[Any], *keep: object) -> None:
    """Hold ``keep`` (a group, its staging buffers, its store) until ``works`` ended by themselves, in a daemon thread.

    A gloo operation cannot be cancelled (``abort()`` does nothing for gloo) and a group's
    destructor waits for its pending operations, up to the group timeout. The last
    reference is therefore dropped here, off the caller's thread; at interpreter exit a
    daemon thread is simply stopped, so nothing waits for it then either."""

    def wait() -> None:
        for work in works:
            try:
                work.wait()
            except Exception:  # noqa: BLE001, S110 - the operation was abandoned; its outcome no longer matters
                pass

    threading.Thread(target=lambda: (wait(), keep), name="lightning-recover-plane-reaper", daemon=True).start()


class TorchDistDataPlane(DataPlane):
    """A ``torch.distributed`` group (``backend`` "gloo" or "nccl") among one world epoch's members of a shard index.

    Built by the communicator at the start of every world epoch with the rendezvous
    ``address`` its leader published (``store``: the leader passes its own
    :func:`host_store`). ``rank``/``size``: this rank's place among the members (the
    shard communicator's). ``timeout_s`` bounds the group's connection and each
    collective when no failure is seen (a peer slower than that is an error), and how
    long a transport error waits for the control plane to confirm a failure.
    """

    kind = "torch"

    def __init__(
        self,
        backend: str,
        control: ControlPlane,
        *,
        world_epoch: int,
        shard: int,
        rank: int,
        size: int,
        address: tuple[str, int],
        store: dist.Store | None = None,
        timeout_s: float = 60.0,
        poll_s: float = POLL_S,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if timeout_s <= 0 or poll_s <= 0:
            raise ValueError(f"timeout_s and poll_s must be positive, got {timeout_s} and {poll_s}")
        super().__init__(world_epoch, size)
        self.kind = backend  # type: ignore[misc]
        self.backend = backend
        self.shard = shard
        self.rank = rank
        self.address = address
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._control = control
        self._store = store
        self._group: Any = None
        # The collective in flight: handed to the reaper with the staging buffers if abandoned.
        self._inflight: Any = None
        # Staging buffers by dtype, reused bucket after bucket (fresh pages would cost a fault each).
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self._closed = False

    @property
    def prefix(self) -> str:
        """The key prefix of this epoch's and shard index's rendezvous in the leader's store."""
        return f"lightning_recover/data_plane/epoch{self.world_epoch}/shard{self.shard}/"

    # ------------------------------------------------------------------ the per-bucket path
    def reduce(self, bucket: Bucket, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor], where: str) -> None:
        if self._closed:
            raise self._control.peer_failure(f"{where} (the {self.backend} data plane of world epoch {self.world_epoch} was aborted)")
        if self.size == 1:
            _copy_through(bucket, src, dst)
            self.reductions += 1
            return
        device = self._device_for(src[bucket.segments[0][0]])
        group = self._connected(where, device)
        for dtype, segs in _by_stage_dtype(bucket, src):
            # A buffer of the plane's own, never the gradients: an abandoned operation may still write it.
            stage = self._buffer(dtype, sum(e - s for _, s, e in segs), device)
            _gather(segs, src, stage)
            self._inflight = work = group.allreduce([stage])
            self._wait(work, where)
            self._inflight = None
            _scatter(segs, stage, dst)
        self.reductions += 1

    def _device_for(self, tensor: torch.Tensor) -> torch.device:
        """Where a bucket is staged: host memory for gloo; for NCCL the gradients' CUDA device (the
        current device is per thread, and the caller may be a helper thread)."""
        if self.backend == "gloo":
            return torch.device("cpu")
        return tensor.device if tensor.is_cuda else torch.device("cuda", torch.cuda.current_device())

    def _buffer(self, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self._buffers[dtype] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def _connected(self, where: str, device: torch.device) -> Any:
        """The group, connected at the epoch's first bucket under the same watch as a collective."""
        if self._group is not None:
            return self._group
        box: dict[str, Any] = {}
        done = threading.Event()

        def connect() -> None:
            try:
                box["group"] = self._make_group(device)
            except Exception as exc:  # noqa: BLE001 - judged by the caller, with the control plane
                box["error"] = exc
            finally:
                done.set()

        # Connecting waits for every member (up to the timeout); a thread keeps the control plane watched meanwhile.
        threading.Thread(target=connect, name="lightning-recover-plane-connect", daemon=True).start()
        self._watch(done.wait, f"{where}: connecting the {self.backend} data plane")
        if "error" in box:
            raise self._confirm(f"{where}: connecting the {self.backend} data plane", box["error"])
        self._group = box["group"]
        return self._group

    def _make_group(self, device: torch.device) -> Any:
        import torch.distributed as dist

        timeout = timedelta(seconds=self.timeout_s)
        store = self._store
        if store is None:
            host, port = self.address
            store = dist.TCPStore(host, port, None, False, timeout)
        prefixed = dist.PrefixStore(self.prefix, store)
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(prefixed, self.rank, self.size, timeout)
        options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]
        options.is_high_priority_stream = False
        # The NCCL options expose their timeout only as `_timeout` (torch's own new_group sets it the same way).
        options._timeout = timeout
        # NCCL's watchdog would tear the whole process down on a timed-out collective (its
        # default); the plane handles failures itself, so it may only abort the communicator.
        previous = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        try:
            group = dist.ProcessGroupNCCL(prefixed, self.rank, self.size, options)  # type: ignore[attr-defined]
        finally:
            if previous is None:
                os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = previous
        # NCCL creates its communicator lazily, inside the first collective, waiting on the
        # store where nothing watches the control plane; connect here, in the watched thread.
        group.eager_connect_single_device(device)
        return group

    def _wait(self, work: Any, where: str) -> None:
        if self.backend == "gloo":
            step = timedelta(seconds=self.poll_s)

            def finished_within(_: float) -> bool:
                try:
                    work.wait(step)
                    return True
                except RuntimeError:
                    # "Operation timed out!" only says it is still running; a finished
                    # work's own error is raised again by the wait below.
                    return bool(work.is_completed())

            self._watch(finished_within, where)
        else:
            # A CUDA future completes when the collective is enqueued, not done: ask the work itself.
            def finished_within(seconds: float) -> bool:
                deadline = time.monotonic() + seconds
                while not work.is_completed():
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(50e-6)
                return True

            self._watch(finished_within, where)
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise RuntimeError subclasses of many kinds
            raise self._confirm(where, exc) from None

    def _watch(self, finished_within: Callable[[float], bool], where: str) -> None:
        """Wait until ``finished_within(poll_s)`` says done; a failure the control plane notices first aborts."""
        while not finished_within(self.poll_s):
            if self._control.failure_noticed():
                self.close()
                raise self._control.peer_failure(where)

    def _confirm(self, where: str, exc: BaseException) -> PeerFailure:
        """A transport error: a :class:`PeerFailure` once the control plane confirms one, else :class:`DataPlaneError`."""
        self.close()
        # The transport sees a dead peer (a reset connection) a little before ULFM does.
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self._control.failure_noticed():
                return self._control.peer_failure(where)
            if time.monotonic() >= deadline:
                break
            time.sleep(self.poll_s)
        raise DataPlaneError(
            f"the {self.backend} data plane failed during {where} (world epoch {self.world_epoch}) and MPI saw no "
            f"peer fail within {self.timeout_s:g} s: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. "
            "A peer slower than recover.timeout_s ends this way too: raise recover.timeout_s, or set recover.data_plane=mpi"
        )

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        group, self._group = self._group, None
        inflight, self._inflight = self._inflight, None
        buffers, self._buffers = self._buffers, {}
        if group is None and inflight is None:
            return
        if self.backend == "nccl" and group is not None:
            try:
                group.abort()  # ncclCommAbort: pending kernels end, nothing waits for a peer
            except Exception:  # noqa: BLE001, S110 - already aborted by NCCL's watchdog
                pass
        _reap([inflight] if inflight is not None else [], group, buffers, self._store)
