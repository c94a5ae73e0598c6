"""Values Lightning and torchmetrics synchronise, synchronised across the live replicas instead.

torch's default process group is replica-local here (:mod:`.replica_group`), so the
syncs Lightning and torchmetrics would run over it never see the other replicas. This
module runs them over the ULFM communicator, each as one collective of the step engine
(a peer's death inside it is repaired and the call retried over the survivors):

* :func:`reduce_logged`: the strategy's ``reduce`` (``self.log(..., sync_dist=True)``),
  a mean or sum over every rank of the world -- or the local value where ranks do not run
  in lockstep (inside a step before its agreement, inside an evaluation batch);
* :func:`gather`: the strategy's ``all_gather`` and torchmetrics' ``dist_sync_fn``;
* :func:`route_metric_sync`: points every torchmetrics ``Metric`` of the module at
  :func:`gather`.

Errors: a reduction other than mean or sum is a ``ValueError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_recover.recovery.job import RecoveryJob

__all__ = ["gather", "gather_cpu", "reduce_logged", "route_metric_sync"]


def gather_cpu(job: RecoveryJob, tensor: Tensor) -> list[Tensor]:
    """Every world rank's ``tensor``, in world-rank order, on the CPU."""
    assert job.comm is not None and job.engine is not None
    comm = job.comm
    return job.engine.run_collective(lambda: comm.allgather_object(tensor.detach().cpu()))  # type: ignore[no-any-return]


def gather(job: RecoveryJob, tensor: Tensor) -> list[Tensor]:
    """Every world rank's ``tensor``, in world-rank order (on ``tensor``'s device)."""
    return [p.to(tensor.device) for p in gather_cpu(job, tensor)]


def route_metric_sync(module: torch.nn.Module | None, job: RecoveryJob, world_size: Callable[[], int]) -> None:
    """torchmetrics syncs over torch's default group, which is replica-local here; send
    its gathers across the live replicas instead (every rank holds distinct samples;
    a spare's shadow updates would count twice, so log metrics from contributors)."""
    from torchmetrics import Metric

    if module is None:
        return

    def sync(tensor: Tensor, group: Any | None = None) -> list[Tensor]:
        return gather(job, tensor)

    for m in module.modules():
        if isinstance(m, Metric):
            m.dist_sync_fn = sync
            m.distributed_available_fn = lambda: job.comm is not None and world_size() > 1


def reduce_logged(job: RecoveryJob, tensor: Tensor, reduce_op: Any, *, evaluating: bool, world_size: Callable[[], int]) -> Tensor:
    """``tensor`` reduced over the world (``reduce_op``: mean or sum), or as it is where ranks are not in lockstep."""
    assert job.comm is not None and job.engine is not None
    st = job.engine.state
    if st is not None and not st.agreed:
        # Inside a step ranks run different numbers of microbatches: a collective per
        # self.log call would pair different calls. The commit reduces them (synced_logs).
        return tensor
    if evaluating:
        # Ranks evaluate different numbers of batches (no padding); epoch values are synced.
        return tensor
    op = str(reduce_op).lower().split(".")[-1] if reduce_op is not None else "mean"
    if op not in ("mean", "avg", "sum"):
        raise ValueError(f"reduce_op={reduce_op!r} is not supported across replicas; use 'mean' or 'sum'")
    src = tensor.detach().to("cpu", torch.float64).contiguous()
    out = torch.empty_like(src)
    comm = job.comm

    def _do() -> Tensor:
        comm.allreduce([src], [out], across="world")
        return out

    total = job.engine.run_collective(_do)
    if op in ("mean", "avg"):
        total = total / world_size()
        if not torch.is_floating_point(tensor):
            # Ranks evaluate unequal sample counts (no padding): a mean count is fractional,
            # and Lightning divides the summed values by it.
            return total.to(tensor.device, torch.get_default_dtype())
    return total.to(tensor.device, tensor.dtype)
