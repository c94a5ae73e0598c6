"""The ``torch.distributed`` data planes: one gloo or NCCL group per world epoch, watched by ULFM (ReCoVer's fault-aware collectives).

They keep the data-plane contract of :mod:`lightning_recover.comm.data_plane`
(``recover.data_plane=gloo``: CPU, the stand-in on this machine; ``nccl``: CUDA). A
:class:`TorchDistDataPlane` is a ``torch.distributed`` group per world epoch among the
members of a shard index, made without torch's default process group (which is
replica-local here, see :mod:`lightning_recover.strategies.replica_group`) from a
``TCPStore`` the world's leader hosts (:func:`host_store`; its address is shared over the
ULFM world), a ``PrefixStore`` per world epoch and shard index. Its group connects lazily,
at the epoch's first bucket. Each collective runs asynchronously and is polled while the
control plane is watched (:meth:`~lightning_recover.comm.data_plane.ControlPlane.failure_noticed`):
a rank blocked in gloo or NCCL cannot see an MPI revoke, and gloo only fails the ranks
directly connected to a dead one quickly; the others would wait for the group timeout.
Buckets are staged through a buffer the plane owns, so an abandoned operation that still
completes later can never write into the gradients.

This module imports torch at import; the communicator imports it only when it builds such
a plane, so that the collectives run without torch on the MPI plane.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from lightning_recover.comm import netaddr
from lightning_recover.comm.buckets import Bucket
from lightning_recover.comm.data_plane import (
    ControlPlane,
    DataPlane,
    DataPlaneError,
    by_stage_dtype,
    copy_through,
    gather,
    scatter,
)
from lightning_recover.comm.interface import PeerFailure

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["POLL_S", "TorchDistDataPlane", "host_store"]

#: How often a torch plane looks at the control plane while a collective is pending.
POLL_S = 0.005


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
            copy_through(bucket, src, dst)
            self.reductions += 1
            return
        device = self._device_for(src[bucket.segments[0][0]])
        group = self._connected(where, device)
        for dtype, segs in by_stage_dtype(bucket, src):
            # A buffer of the plane's own, never the gradients: an abandoned operation may still write it.
            stage = self._buffer(dtype, sum(e - s for _, s, e in segs), device)
            gather(segs, src, stage)
            self._inflight = work = group.allreduce([stage])
            self._wait(work, where)
            self._inflight = None
            scatter(segs, stage, dst)
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
