"""The "ulfm" process group's in-process parts: op and dtype planning, the lockstep refusal, torch's view of it.

No MPI here (the collectives and their recovery across a kill are tested on real ranks in
test_process_group_mpi.py): a call that is refused fails before it would communicate, and
torch's rank table is read through a stand-in shard communicator whose membership a test
changes as a repair would.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_recover.comm.process_group import ProcessGroupULFM, lockstep_refusal, new_replica_group, reduction
from lightning_recover.comm.topology import RankLayout
from lightning_recover.recovery.state import StepState
from lightning_recover.workload.factory import make_policy

Op = dist.ReduceOp


@pytest.mark.parametrize(
    ("op", "dtype", "mpi_op", "reduced_in", "average"),
    [
        (Op.SUM, torch.float32, "SUM", torch.float32, False),
        (Op.AVG, torch.float64, "SUM", torch.float64, True),
        (Op.PRODUCT, torch.int64, "PROD", torch.int64, False),
        (Op.MIN, torch.uint8, "MIN", torch.uint8, False),
        (Op.MAX, torch.int8, "MAX", torch.int8, False),
        (Op.BXOR, torch.int32, "BXOR", torch.int32, False),
        # MPI has no 16-bit float type: reduced in fp32 and rounded back once.
        (Op.SUM, torch.bfloat16, "SUM", torch.float32, False),
        (Op.AVG, torch.float16, "SUM", torch.float32, True),
        (Op.MAX, torch.bfloat16, "MAX", torch.float32, False),
    ],
)
def test_torch_ops_map_to_mpi_ops_and_16_bit_floats_are_reduced_in_fp32(
    op: dist.ReduceOp.RedOpType, dtype: torch.dtype, mpi_op: str, reduced_in: torch.dtype, average: bool
) -> None:
    plan = reduction(op, dtype)
    assert (plan.mpi_op, plan.dtype, plan.average) == (mpi_op, reduced_in, average)
    # dist.all_reduce hands the backend AllreduceOptions wrapping a ReduceOp: the same plan.
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(op)
    assert reduction(opts, dtype) == plan


@pytest.mark.parametrize(
    ("op", "dtype", "error", "says"),
    [
        (Op.AVG, torch.int64, TypeError, "reduce with SUM and divide by dist.get_world_size(group)"),
        (Op.BAND, torch.float32, TypeError, "needs an integer tensor"),
        (Op.SUM, torch.bool, TypeError, "cannot reduce torch.bool; use one of float32, float64, bfloat16"),
        (Op.SUM, torch.complex64, TypeError, "cannot reduce torch.complex64"),
        (Op.PREMUL_SUM, torch.float32, ValueError, "use one of SUM, AVG, PRODUCT, MIN, MAX"),
    ],
)
def test_unsupported_reductions_name_what_to_use(op: object, dtype: torch.dtype, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=None) as info:
        reduction(op, dtype)
    assert says in str(info.value)


def _step(microbatches_run: int, agreed: bool = False) -> StepState:
    st = StepState(step=3, replica=0, plan=make_policy("static", 2, 2).begin_step(3, [0, 1]), started_at=0.0, world_epoch=0)
    st.work.microbatches_run, st.agreed = microbatches_run, agreed
    return st


def test_calls_run_only_where_every_live_member_enters_them() -> None:
    assert lockstep_refusal(None, evaluating=False) is None  # between steps (hooks, epoch ends)
    assert lockstep_refusal(_step(0), evaluating=False) is None  # the step's first microbatch
    assert lockstep_refusal(_step(2, agreed=True), evaluating=False) is None  # on_before_optimizer_step
    later = lockstep_refusal(_step(1), evaluating=False)
    assert later is not None and "trainer.global_step" in later and "on_before_optimizer_step" in later
    evaluating = lockstep_refusal(None, evaluating=True)
    assert evaluating is not None and "epoch-end hook" in evaluating


class _ShardComm:
    """Stands in for the MPI shard communicator: a rank and a size that a "repair" changes; no traffic."""

    def __init__(self, rank: int, size: int) -> None:
        self.now = (rank, size)

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self.now[0]

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        return self.now[1]

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the call communicated ({name}) although it should have been refused first")


def _comm(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(
        shard_comm=_ShardComm(rank, size), layout=RankLayout(size, 1), alive_replicas=tuple(range(size)), rank=rank, shard=0, world_epoch=0
    )


def test_a_refused_call_fails_before_communicating_and_leaves_the_tensor_alone() -> None:
    reason = [lockstep_refusal(_step(1), evaluating=False)]
    pg = ProcessGroupULFM(_comm(1, 4), run=lambda fn: fn(), refuse=lambda: reason[0])  # type: ignore[arg-type]
    t = torch.tensor([5.0])
    with pytest.raises(RuntimeError, match="all_reduce over strategy.replica_group cannot run after the step's first microbatch"):
        dist.all_reduce(t, group=pg)
    assert t.item() == 5.0
    reason[0] = lockstep_refusal(None, evaluating=True)
    with pytest.raises(RuntimeError, match="barrier over strategy.replica_group cannot run in an evaluation batch"):
        dist.barrier(group=pg)
    with pytest.raises(RuntimeError, match="broadcast over strategy.replica_group cannot run in an evaluation batch"):
        dist.broadcast(t, group_src=0, group=pg)


@pytest.fixture
def replica_local_default_group() -> Iterator[None]:
    """torch's default group as the strategy makes it: this replica's ranks only (here one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_torch_sees_the_ulfm_backend_and_the_live_rank_and_size(replica_local_default_group: None) -> None:
    comm = _comm(2, 4)
    pg = new_replica_group(comm, run=lambda fn: fn())  # type: ignore[arg-type]
    assert dist.get_backend(pg) == "ulfm"
    assert (dist.get_rank(pg), dist.get_world_size(pg), pg.replicas) == (2, 4, (0, 1, 2, 3))
    # A repair removed replica 1: the same object, renumbered.
    comm.shard_comm.now, comm.alive_replicas = (1, 3), (0, 2, 3)
    assert (dist.get_rank(pg), dist.get_world_size(pg), pg.rank(), pg.size(), pg.replicas) == (1, 3, 1, 3, (0, 2, 3))
    # torch's global ranks are replica-local: it can name this rank only.
    assert dist.get_global_rank(pg, 1) == 0 and dist.get_process_group_ranks(pg) == [0]
    with pytest.raises(NotImplementedError, match="supports all_reduce, all_gather, all_gather_into_tensor, broadcast and barrier"):
        dist.reduce(torch.zeros(1), group_dst=0, group=pg)
    # The backend name is the strategy's group only.
    with pytest.raises(ValueError, match="use trainer.strategy.replica_group"):
        dist.new_group(ranks=[0], backend="ulfm")


def test_a_replacement_not_admitted_yet_is_told_when_it_joins() -> None:
    comm = _comm(0, 2)
    comm.shard_comm = None
    pg = ProcessGroupULFM(comm, run=lambda fn: fn())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="a replacement not admitted yet: it joins the replica group at its first step"):
        pg.size()
