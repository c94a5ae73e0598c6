"""The "ulfm" process group: the fault-tolerant communicator as a ``torch.distributed`` group.

The ReCoVer paper's ProcessGroupULFM, in Python. :class:`ProcessGroupULFM` is what
``ReCoVerHSDPStrategy.replica_group`` returns: user code (a LightningModule, a callback)
runs ``dist.all_reduce(t, group=pg)``, ``dist.all_gather``, ``dist.broadcast`` and
``dist.barrier`` across the live replicas with the strategy's failure semantics.

Contract:

* **Members**: the ranks holding this rank's shard index in every *live* replica, i.e. the
  communicator's shard communicator (with one shard per replica: one rank per live
  replica). Group rank ``k`` is the ``k``-th live replica in replica order:
  ``pg.replicas[k]``. torch's default group is replica-local under the strategy, so the
  group is *not* a subgroup of it (see "torch's rank table" below).
* **A member dies mid-call**: the call runs inside the strategy's
  ``StepEngine.run_collective``: the MPI error becomes a :class:`PeerFailure`, the
  survivors agree that the attempt failed, repair the world (whole replicas leave, world
  epoch + 1) and the call is **issued again over the new membership from the original
  inputs** (every attempt starts from a copy taken at entry, so a half-finished attempt
  leaves nothing behind). The result is therefore over the survivors -- never a hang,
  never an error to catch. A call that completed everywhere is never repeated.
* **Size and rank change** after a repair (smaller) or a hot re-join (larger): read them at
  each use, ``dist.get_world_size(pg)`` / ``pg.size()`` and ``dist.get_rank(pg)`` /
  ``pg.rank()``; ``pg.replicas`` names the replica behind each group rank. The object
  itself stays valid for the whole job: it follows the communicator, there is nothing to
  re-fetch after a repair.
* **Operations** (all synchronous: the returned ``Work`` is already completed, so
  ``async_op=True`` is accepted and its ``wait()`` returns at once):

  - ``all_reduce`` with SUM, AVG, PRODUCT, MIN, MAX, and BAND/BOR/BXOR on integer
    tensors, on float32/64, int8/16/32/64 and uint8; bfloat16 and float16 are reduced in
    float32 (MPI has no 16-bit float type; a 16-bit buffer sent as bytes sums silently
    wrong) and rounded back once. The result lands in the caller's tensor, in place.
    AVG divides the sum by the group size the call completed with.
  - ``all_gather`` into a list and ``all_gather_into_tensor`` (same shape and dtype on
    every member; any dtype, copied byte for byte). A repair during the call shrinks the
    group, and torch hands the backend a copy of the list, so the list cannot shrink: the
    first ``pg.size()`` entries (read *after* the call) hold the survivors' tensors in
    group-rank order and the entries beyond are zero-filled.
  - ``broadcast`` from a *group* rank: ``dist.broadcast(t, group_src=k, group=pg)``
    (torch >= 2.6). After a repair the call is issued again, so ``k`` then names the
    ``k``-th live replica; ``group_src=0`` (the first live replica) is the root that stays
    meaningful. All members must name the same root: a mismatch (e.g. ``src=`` given a
    torch-global rank, which is replica-local here) is an error on every member, not a hang.
  - ``barrier``.

  Other torch collectives (reduce, scatter, reduce_scatter, all_to_all, send/recv) raise
  ``NotImplementedError``.
* **Where a call may run**: like any process group, every live member must enter the same
  calls in the same order. Inside an optimizer step replicas run different numbers of
  microbatches (minor replicas, a spare's shadow work, replays after a failure), so a call
  is refused (``RuntimeError``, before any communication) in any microbatch but the step's
  first and in validation/test/predict batches (ranks evaluate different numbers of
  batches). Call it once per step: in ``training_step`` guarded by
  ``trainer.global_step`` (the first call of a step), or in a hook every rank runs once per
  step (``on_train_batch_start/end``, ``on_before_optimizer_step``), or in an epoch hook.

**torch's rank table.** ``dist.get_rank(group)`` translates torch's *default-group* rank
through a table torch keeps per group. The group is registered through the public path
(``Backend.register_backend("ulfm", ...)`` and ``dist.new_group(backend="ulfm")`` over this
rank alone, so torch knows its name and backend), and its table entry then reads the live
group rank. Only this rank is in that table: the other members are in other replicas'
default groups, which torch cannot name. So ``dist.get_global_rank``,
``dist.get_process_group_ranks`` and ``broadcast(src=...)`` know this rank only; use group
ranks (``group_src=``, ``pg.replicas``).

Nothing here runs at import: the backend is registered when the strategy builds the group.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Sequence, ValuesView
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

if TYPE_CHECKING:
    from mpi4py import MPI

    from lightning_recover.comm.communicator import FaultTolerantComm

__all__ = ["BACKEND", "ProcessGroupULFM", "lockstep_refusal", "new_replica_group", "reduction"]

T = TypeVar("T")

#: The torch.distributed backend name of the group.
BACKEND = "ulfm"

RedOp = dist.ReduceOp.RedOpType
_ARITHMETIC = {RedOp.SUM: "SUM", RedOp.AVG: "SUM", RedOp.PRODUCT: "PROD", RedOp.MIN: "MIN", RedOp.MAX: "MAX"}
_BITWISE = {RedOp.BAND: "BAND", RedOp.BOR: "BOR", RedOp.BXOR: "BXOR"}
_INTEGER = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
_FLOAT = (torch.float32, torch.float64)
# 16-bit floats are reduced in fp32: MPI has no such type, and bytes would be summed as integers.
_WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


@dataclass(frozen=True)
class Reduction:
    """How one ``all_reduce`` runs over MPI: the MPI op's name, the dtype reduced in, whether to divide by the size."""

    mpi_op: str
    dtype: torch.dtype
    average: bool


def reduction(op: Any, dtype: torch.dtype) -> Reduction:
    """The :class:`Reduction` for torch's ``op`` (a ``ReduceOp``, its ``RedOpType`` or ``AllreduceOptions``) on ``dtype``.

    Raises ``ValueError`` / ``TypeError`` naming the unsupported op or dtype and what to use instead.
    """
    op = getattr(op, "reduceOp", op)
    op = getattr(op, "op", op)  # a ReduceOp instance wraps its RedOpType
    supported = "SUM, AVG, PRODUCT, MIN, MAX (and BAND, BOR, BXOR on integers)"
    if op not in _ARITHMETIC and op not in _BITWISE:
        raise ValueError(f"all_reduce over the ulfm replica group does not support {op}; use one of {supported}")
    if dtype not in _INTEGER and dtype not in _FLOAT and dtype not in _WIDEN:
        names = ", ".join(str(d).removeprefix("torch.") for d in (*_FLOAT, *_WIDEN, *_INTEGER))
        raise TypeError(f"all_reduce over the ulfm replica group cannot reduce {dtype}; use one of {names}")
    if op in _BITWISE:
        if dtype not in _INTEGER:
            raise TypeError(f"{op} needs an integer tensor, got {dtype}; use SUM/MIN/MAX, or reduce an integer view")
        return Reduction(_BITWISE[op], dtype, average=False)
    if op == RedOp.AVG and dtype in _INTEGER:
        raise TypeError(f"AVG of a {dtype} tensor is not an integer; reduce with SUM and divide by dist.get_world_size(group)")
    return Reduction(_ARITHMETIC[op], _WIDEN.get(dtype, dtype), average=op == RedOp.AVG)


class StepProgress(Protocol):
    """What the lockstep rule reads of the step in progress (:class:`lightning_recover.recovery.state.StepState`).

    A protocol rather than the class: the step engine builds on this layer, so this module
    names only what it reads and never imports it.
    """

    agreed: bool
    microbatches_run: int


class FaultPoints(Protocol):
    """Where fault injection reaches a call of this group (:class:`lightning_recover.recovery.engine.Probes`)."""

    def fault_point(self, phase: str, *, step: int, microbatch: int | None = None, bucket: int | None = None) -> None: ...


def lockstep_refusal(step: StepProgress | None, evaluating: bool) -> str | None:
    """Why a replica-group call would not be entered by every live member now, or None when it would.

    ``step`` is the step in progress (None between steps); ``evaluating`` says whether an
    evaluation batch (validation/test/predict step) is running.
    """
    if evaluating:
        return "in an evaluation batch: ranks evaluate different numbers of batches; call it in an epoch-end hook"
    if step is not None and not step.agreed and step.work.microbatches_run > 0:
        return (
            "after the step's first microbatch: replicas run different numbers of microbatches (minor replicas, "
            "spares, replays after a failure); call it once per step, e.g. in training_step only when "
            "trainer.global_step differs from the last step you called it in, or in on_train_batch_start/end "
            "or on_before_optimizer_step"
        )
    return None


class _Completed(dist.Work):
    """The Work of a call that already finished (every call of this group is synchronous)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._tensors

    def get_future(self) -> Future[list[torch.Tensor]]:
        fut: Future[list[torch.Tensor]] = Future()
        fut.set_result(self._tensors)
        return fut


class _OwnRank(dict[int, int]):
    """torch's rank table entry of the group: {this rank's default-group rank: its group rank *now*}."""

    def __init__(self, default_rank: int, group: ProcessGroupULFM) -> None:
        super().__init__({default_rank: 0})
        self._group = group

    def __getitem__(self, key: int) -> int:
        super().__getitem__(key)  # KeyError for any other default-group rank
        return self._group.rank()

    def get(self, key: int, default: Any = None) -> Any:  # type: ignore[override]
        return self[key] if key in self else default

    def items(self) -> ItemsView[int, int]:  # type: ignore[override]
        return {k: self._group.rank() for k in self.keys()}.items()

    def values(self) -> ValuesView[int]:  # type: ignore[override]
        return {k: self._group.rank() for k in self.keys()}.values()


class ProcessGroupULFM(dist.ProcessGroup):
    """The live replicas' ranks of this shard index as a torch process group; see the module docstring.

    ``run`` is the strategy's ``StepEngine.run_collective`` (retry over the survivors after a
    repair) and ``refuse`` says why a call cannot run now (see :func:`lockstep_refusal`).
    ``probes`` get fault injection's points, numbered by the optimizer step ``step()`` and
    the call's index in that step (as ``microbatch``): ``collective`` before this rank's MPI
    calls, ``collective_done`` after they returned and before the survivors agree.
    """

    def __init__(
        self,
        comm: FaultTolerantComm,
        run: Callable[[Callable[[], Any]], Any],
        *,
        refuse: Callable[[], str | None] = lambda: None,
        probes: FaultPoints | None = None,
        step: Callable[[], int] = lambda: 0,
    ) -> None:
        # torch keeps a rank and a size in C++ (these, as of now); Python callers get the live ones from rank()/size().
        now = (0, 1) if comm.shard_comm is None else (comm.shard_comm.Get_rank(), comm.shard_comm.Get_size())
        super().__init__(*now)
        self.comm = comm
        self._run = run
        self._refuse = refuse
        self._probes = probes
        self._step = step
        #: (optimizer step, calls made in it): fault injection names a call by its index in the step.
        self._calls = (-1, 0)

    # ------------------------------------------------------------------ membership
    def _shard_comm(self) -> MPI.Intracomm:
        comm = self.comm.shard_comm
        if comm is None:
            raise RuntimeError(
                f"rank {self.comm.rank} is a replacement not admitted yet: it joins the replica group at its first step"
            )
        return comm

    def rank(self) -> int:
        """This rank's position among the live replicas now (0 = the first live replica)."""
        return int(self._shard_comm().Get_rank())

    def size(self) -> int:
        """How many live replicas the group spans now."""
        return int(self._shard_comm().Get_size())

    @property
    def replicas(self) -> tuple[int, ...]:
        """The replica index behind each group rank, in group-rank order (the live replicas)."""
        return tuple(self.comm.alive_replicas)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def __repr__(self) -> str:
        if self.comm.shard_comm is None:
            return f"ProcessGroupULFM(rank {self.comm.rank}, not admitted yet)"
        return (
            f"ProcessGroupULFM(rank={self.rank()}, size={self.size()}, replicas={list(self.replicas)}, "
            f"shard={self.comm.shard}, world_epoch={self.comm.world_epoch})"
        )

    # ------------------------------------------------------------------ one call
    def _call(self, what: str, attempt: Callable[[MPI.Intracomm], T]) -> T:
        """``attempt`` over the current shard communicator, retried over the survivors after a repair."""
        reason = self._refuse()
        if reason is not None:
            raise RuntimeError(f"{what} over strategy.replica_group cannot run {reason}")
        from mpi4py import MPI

        step = self._step()
        index = self._calls[1] if self._calls[0] == step else 0
        self._calls = (step, index + 1)

        def once() -> T:
            comm = self._shard_comm()
            if self._probes is not None:
                self._probes.fault_point("collective", step=step, microbatch=index)
            try:
                out = attempt(comm)
            except MPI.Exception as exc:
                raise self.comm.fail_for(f"{what} over the replica group", exc) from None
            if self._probes is not None:
                self._probes.fault_point("collective_done", step=step, microbatch=index)
            return out

        return self._run(once)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor] | torch.Tensor, opts: Any = RedOp.SUM) -> dist.Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        plans = [reduction(opts, t.dtype) for t in tensors]
        # The inputs as they were at entry: every attempt starts from them.
        sources = [t.detach().to("cpu", p.dtype, copy=True).reshape(-1) for t, p in zip(tensors, plans)]

        def attempt(comm: MPI.Intracomm) -> list[torch.Tensor]:
            from mpi4py import MPI

            outs = []
            for src, plan in zip(sources, plans):
                buf = src.clone()
                comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=getattr(MPI, plan.mpi_op))
                if plan.average:
                    buf /= comm.Get_size()
                outs.append(buf)
            return outs

        results = self._call("all_reduce", attempt)
        for t, r in zip(tensors, results):
            t.copy_(r.view(t.shape))
        return _Completed(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        if len(output_tensors) != len(input_tensors):
            raise ValueError(f"all_gather got {len(input_tensors)} input tensors but {len(output_tensors)} output lists")
        for outs, t in zip(output_tensors, input_tensors):
            for i, o in enumerate(outs):
                if o.numel() != t.numel() or o.dtype != t.dtype:
                    raise ValueError(
                        f"all_gather output {i} is {tuple(o.shape)}/{o.dtype} but the input is {tuple(t.shape)}/{t.dtype}; "
                        "every member must gather tensors of one shape and dtype"
                    )
        gathered = self._gather(input_tensors, lambda size: [len(outs) for outs in output_tensors])
        for outs, rows in zip(output_tensors, gathered):
            for i, o in enumerate(outs):
                if i < len(rows):
                    o.copy_(rows[i].reshape(o.shape))
                else:  # a member left during the call: see the module docstring
                    o.zero_()
        return _Completed([o for outs in output_tensors for o in outs])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:  # noqa: A002
        """``dist.all_gather_into_tensor``: the output holds exactly ``size`` inputs, so a repair mid-call
        leaves the rows beyond the survivors zero-filled, like the list form."""
        if output.dtype != input.dtype or output.numel() % max(input.numel(), 1):
            raise ValueError(
                f"all_gather_into_tensor output {tuple(output.shape)}/{output.dtype} is not a whole number of inputs "
                f"{tuple(input.shape)}/{input.dtype}"
            )
        slots = output.numel() // max(input.numel(), 1)
        (rows,) = self._gather([input], lambda size: [slots])
        flat = output.view(-1) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype)
        flat.zero_()
        for i, row in enumerate(rows):
            flat[i * input.numel() : (i + 1) * input.numel()].copy_(row)
        if flat.data_ptr() != output.data_ptr():
            output.copy_(flat.view(output.shape))
        return _Completed([output])

    def _gather(self, inputs: Sequence[torch.Tensor], room: Callable[[int], list[int]]) -> list[list[torch.Tensor]]:
        """Each input from every member (byte copies, so any dtype), in group-rank order."""
        sources = [t.detach().to("cpu", copy=True).contiguous().reshape(-1) for t in inputs]

        def attempt(comm: MPI.Intracomm) -> list[list[torch.Tensor]]:
            size = comm.Get_size()
            for slots in room(size):
                if slots < size:
                    raise ValueError(f"all_gather over the replica group needs room for {size} tensors (pg.size()), got {slots}")
            out = []
            for src in sources:
                recv = torch.empty(size * src.numel(), dtype=src.dtype)
                comm.Allgather(_bytes(src), _bytes(recv))
                out.append(list(recv.view(size, -1)))
            return out

        return self._call("all_gather", attempt)

    def broadcast(self, tensors: list[torch.Tensor] | torch.Tensor, opts: Any = None) -> dist.Work:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        root = int(getattr(opts, "rootRank", 0) if opts is not None else 0)
        sources = [t.detach().to("cpu", copy=True).contiguous().reshape(-1) for t in tensors]

        def attempt(comm: MPI.Intracomm) -> list[torch.Tensor]:
            from mpi4py import MPI

            size = comm.Get_size()
            # Every member must name the same root; a mismatch would pair different broadcasts.
            roots = np.array([root, -root], dtype=np.int64)
            comm.Allreduce(MPI.IN_PLACE, roots, op=MPI.MIN)
            lowest, highest = int(roots[0]), -int(roots[1])
            if lowest != highest:
                raise ValueError(
                    f"broadcast over the replica group: members named different roots ({lowest}..{highest}); pass the "
                    "root as a group rank, dist.broadcast(t, group_src=k, group=pg) (src= is a torch-global rank, and "
                    "torch's global ranks are replica-local under ReCoVerHSDPStrategy)"
                )
            if not 0 <= root < size:
                raise ValueError(f"broadcast root {root} is not a group rank of the replica group (size {size})")
            outs = []
            for src in sources:
                buf = src.clone()
                comm.Bcast(_bytes(buf), root=root)
                outs.append(buf)
            return outs

        results = self._call("broadcast", attempt)
        for t, r in zip(tensors, results):
            t.copy_(r.view(t.shape))
        return _Completed(tensors)

    def barrier(self, opts: Any = None) -> dist.Work:
        self._call("barrier", lambda comm: comm.Barrier())
        return _Completed([])

    def _unsupported(self, *args: Any, **kwargs: Any) -> dist.Work:
        raise NotImplementedError(
            "the ulfm replica group supports all_reduce, all_gather, all_gather_into_tensor, broadcast and barrier; "
            "express reduce/scatter/reduce_scatter/all_to_all with those (e.g. all_reduce, then take your slice)"
        )

    reduce = gather = scatter = reduce_scatter = _reduce_scatter_base = alltoall = alltoall_base = _unsupported
    send = recv = recv_anysource = allreduce_coalesced = allgather_coalesced = _unsupported


def _bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor as a numpy view (any dtype, bf16 included)."""
    return t.view(torch.uint8).numpy()


def _create(options: Any, group: Any) -> ProcessGroupULFM:
    """The "ulfm" backend's creator: hands torch the group the strategy built (``pg_options``)."""
    if not isinstance(group, ProcessGroupULFM):
        raise ValueError(
            "the 'ulfm' backend is the strategy's cross-replica group and cannot be created by init_process_group "
            "or new_group; use trainer.strategy.replica_group (ReCoVerHSDPStrategy)"
        )
    return group


def new_replica_group(
    comm: FaultTolerantComm,
    run: Callable[[Callable[[], Any]], Any],
    *,
    refuse: Callable[[], str | None] = lambda: None,
    probes: FaultPoints | None = None,
    step: Callable[[], int] = lambda: 0,
) -> ProcessGroupULFM:
    """Build the group and register it with torch (backend ``"ulfm"``); local, no communication.

    Needs torch's default group (the replica-local one) to exist; see the module docstring
    for what the registration gives and what it cannot.
    """
    group = ProcessGroupULFM(comm, run, refuse=refuse, probes=probes, step=step)
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    registered = dist.new_group(
        ranks=[dist.get_rank()], backend=BACKEND, pg_options=group, use_local_synchronization=True, group_desc="replica_group"
    )
    assert registered is group
    # torch translates group ranks through a table keyed by default-group ranks and filled
    # once by new_group; no public API updates it, and this group's rank changes with every
    # repair, so its entry reads the live rank.
    dist.distributed_c10d._world.pg_group_ranks[group] = _OwnRank(dist.get_rank(), group)
    return group
