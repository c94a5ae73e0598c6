"""FSDP2's collectives inside a replica, on the replica's MPI communicator.

FSDP2 all-gathers each unit's parameters before its forward (and again before its
backward) and reduce-scatters its gradients after backward, over the replica's S ranks.
By default these go over torch's replica-local process group
(:mod:`~lightning_recover.strategies.replica_group`): gloo on CPU, i.e. TCP through the
loopback device, about 23 collectives per step for a 4-block model at G = 2. With
``recover.replica_plane=mpi`` (what ``auto`` picks on CPU with the MPI data plane) they
go to Open MPI instead, whose shared-memory transport moves a megabyte in a fraction of
gloo's time. The hand-over uses FSDP2's public ``set_custom_all_gather`` /
``set_custom_reduce_scatter``; Lightning's own collectives, checkpoints and the user's
``dist`` calls stay on torch's group.

The contract of :class:`MPIAllGather` and :class:`MPIReduceScatter`:

* **Same results.** The all-gather moves bytes, whatever the dtype. The reduce-scatter
  sums (``AVG`` divides by the replica size afterwards); 16-bit floats are summed in fp32
  (MPI has no bf16 type). With S = 2 a sum does not depend on the order, so the losses
  are bitwise those of the gloo group.
* **A replica-mate's death** (ULFM's "process failed" or "revoked") revokes the replica
  communicator, so that every mate still blocked in the collective is released too, and
  raises :class:`ReplicaPlaneError`. The strategy's replica guard turns it into this
  rank's exit through the replica-consistency gate: the replica is lost as a whole, the
  same outcome as a gloo error. A hung mate is declared dead by ULFM's failure detector
  (the launcher's ``--hang-timeout``) or killed by the heartbeat watchdog, whichever
  comes first. Any other MPI error propagates unchanged.
* **Waiting.** On a host with more ranks than cores a collective waits without spinning
  (:mod:`~lightning_recover.comm.mpi_wait`): the mate it waits for gets the core. A rank
  waiting for a late mate is not stuck in compute: the wait runs inside the ``waiting``
  context the strategy gives (its probes pause the watchdog's progress rule, as for every
  other MPI wait of the step). Before, a rank whose mate came later than the stuck timeout
  into an all-gather was killed as stuck, and its healthy replica lost with it: seen three
  times in the host salvage campaign (seed 959), the late mate most likely still in the
  cross-replica reduction, waiting on a slow rank of another replica. A mate truly stuck in
  compute is caught by the watchdog of a rank on its own host; one alone on its host never
  was by this rule (only by chance, through a mate killed for waiting), and is left to the
  supervisor's stall timeout.
* **Threads.** Called on the thread that runs forward and backward, while the overlapped
  cross-replica reduction may use the shard communicator on a helper thread (MPI is
  initialized with ``MPI_THREAD_MULTIPLE``).
* **Tensor parallel.** With ``recover.tensor_parallel > 1`` FSDP2 shards over the replica's
  data-parallel dimension only, so its collectives run on :func:`data_parallel_comm`: the
  mates that share this rank's tensor-parallel index. The tensor-parallel collectives
  (DTensor's, inside forward and backward) stay on torch's group; a mate's death
  fails either one and takes the replica through the gate all the same.
* **Lifetime.** The communicator is the replica's for its whole life: a repair keeps or
  removes whole replicas, so it never needs rebuilding; a replacement replica brings its
  own, split from its spawn.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_recover.comm import mpi_wait
from lightning_recover.comm.ulfm import FAILURE_CONFIRM_S, failure_classes
from lightning_recover.config import ConfigurationError
from lightning_recover.errors import RecoverError

if TYPE_CHECKING:
    from mpi4py import MPI

__all__ = ["MPIAllGather", "MPIReduceScatter", "ReplicaPlaneError", "data_parallel_comm", "resolve_replica_plane", "use_replica_plane"]

# MPI sums these natively; 16-bit floats go through fp32.
_NATIVE = (torch.float32, torch.float64, torch.int32, torch.int64)


class ReplicaPlaneError(RecoverError, RuntimeError):
    """A replica-mate died (or the replica's communicator was revoked) inside an FSDP2 collective."""


def resolve_replica_plane(setting: str, data_plane: str, device_type: str) -> str:
    """``"mpi"`` or ``"torch"`` for ``recover.replica_plane=setting``; refuses what cannot run here."""
    if setting == "auto":
        return "mpi" if data_plane == "mpi" and device_type == "cpu" else "torch"
    if setting == "mpi" and device_type != "cpu":
        raise ConfigurationError(
            f"recover.replica_plane=mpi moves FSDP2's collectives through host memory, but the Trainer runs on "
            f"{device_type}; use recover.replica_plane=torch (NCCL inside the replica) or auto"
        )
    return setting



class _ReplicaCollective:
    """What both collectives share: the communicator, plain buffers, the failure rule."""

    def __init__(self, comm: MPI.Intracomm, waiting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> None:
        self.comm = comm
        # Entered around every wait for the mates (the strategy's probes: waiting is not computing).
        self._waiting = waiting
        #: Collectives run so far (what a test checks to know this plane carried them).
        self.calls = 0

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _run(self, what: str, blocking: Any, nonblocking: Any, *args: Any, **kwargs: Any) -> None:
        from mpi4py import MPI

        self.calls += 1
        try:
            with self._waiting():
                if mpi_wait.polite():
                    mpi_wait.wait(nonblocking(*args, **kwargs))
                else:
                    blocking(*args, **kwargs)
        except MPI.Exception as exc:
            if exc.Get_error_class() not in failure_classes() and not _has_failed(self.comm):
                raise
            try:
                self.comm.Revoke()
            except MPI.Exception:
                pass  # already revoked by a mate: either way nobody stays blocked
            raise ReplicaPlaneError(
                f"replica-local {what} over MPI failed: a replica-mate died ({exc.Get_error_string()})"
            ) from exc


class MPIAllGather(_ReplicaCollective):
    """FSDP2's all-gather (``FSDPModule.set_custom_all_gather``) as ``MPI_Allgather`` of bytes."""

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any = None, async_op: bool = False) -> None:
        # FSDP2 waits on a returned Work only; None means "already done".
        self._run("all-gather", self.comm.Allgather, self.comm.Iallgather, _bytes(input_tensor), _bytes(output_tensor))


class MPIReduceScatter(_ReplicaCollective):
    """FSDP2's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``) as ``MPI_Reduce_scatter_block``."""

    def __call__(
        self, output_tensor: Tensor, input_tensor: Tensor, group: Any = None, op: Any = None, async_op: bool = False
    ) -> None:
        from mpi4py import MPI

        name = _op_name(op)
        if name not in ("SUM", "AVG"):
            raise ValueError(
                f"recover.replica_plane=mpi reduce-scatters with SUM or AVG, FSDP2 asked for {op!r}; "
                "set recover.replica_plane=torch for this model"
            )
        wide = input_tensor.dtype not in _NATIVE
        src = input_tensor.float() if wide else input_tensor
        dst = torch.empty(output_tensor.shape, dtype=src.dtype) if wide else output_tensor
        self._run("reduce-scatter", self.comm.Reduce_scatter_block, self.comm.Ireduce_scatter_block, src.numpy(), dst.numpy(), op=MPI.SUM)
        if name == "AVG":
            dst.div_(self.comm.Get_size())
        if dst is not output_tensor:
            output_tensor.copy_(dst)


def _has_failed(comm: MPI.Intracomm, within_s: float = FAILURE_CONFIRM_S) -> bool:
    """Whether a member of ``comm`` is known dead (or ``comm`` revoked), now or within ``within_s``.

    Open MPI sometimes reports a peer death as ERR_OTHER, a non-blocking collective even
    before the death reached the communicator (see ``FaultTolerantComm._failure_confirmed``)."""
    from mpi4py import MPI

    deadline = time.monotonic() + within_s
    while True:
        try:
            comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # drives the progress that delivers the news
            if comm.Is_revoked():
                return True
            group = comm.Get_failed()
            try:
                if group.Get_size() > 0:
                    return True
            finally:
                group.Free()
        except MPI.Exception as exc:
            if exc.Get_error_class() in failure_classes():
                return True
            raise
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _op_name(op: Any) -> str:
    """``"SUM"`` for ``ReduceOp.SUM`` or ``ReduceOp.RedOpType.SUM`` (FSDP2 passes either)."""
    if op is None:
        return "SUM"
    name = getattr(op, "name", None)
    return str(name if name is not None else op).rsplit(".", 1)[-1].upper()


def _bytes(t: Tensor) -> Any:
    """A contiguous CPU tensor's bytes as a numpy view (any dtype, bf16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def use_replica_plane(
    model: torch.nn.Module,
    comm: MPI.Intracomm,
    waiting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
) -> tuple[MPIAllGather, MPIReduceScatter]:
    """Give every FSDP unit of ``model`` the MPI collectives over ``comm`` (shared by all units);
    each wait for the mates runs inside ``waiting()``.

    A unit with several parameter groups (a per-parameter mesh) keeps torch's group:
    FSDP2 refuses one custom collective for them.
    """
    from torch.distributed.fsdp import FSDPModule

    gather, scatter = MPIAllGather(comm, waiting), MPIReduceScatter(comm, waiting)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            try:
                m.set_custom_all_gather(gather)
                m.set_custom_reduce_scatter(scatter)
            except ValueError:
                continue
    return gather, scatter


def data_parallel_comm(mates: MPI.Intracomm, tensor_parallel: int) -> MPI.Intracomm:
    """The ranks of ``mates`` (the replica, ranked by shard) that share this rank's tensor-parallel index,
    ranked by data-parallel index: FSDP2's group on a ``("data_parallel", "tensor_parallel")`` mesh
    (:class:`~lightning_recover.comm.topology.ReplicaGrid`). ``mates`` itself without tensor parallelism.
    Collective over ``mates``."""
    from mpi4py import MPI

    from lightning_recover.comm.topology import ReplicaGrid

    if tensor_parallel == 1:
        return mates
    grid = ReplicaGrid(mates.Get_size(), tensor_parallel)
    shard = mates.Get_rank()
    comm = mates.Split(grid.tensor_index(shard), grid.data_index(shard))
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm
