"""FSDP2 (and tensor parallel) inside a replica: the replica's mesh, sharding, local shards.

The replica-local FSDP2 reduce-scatter must *sum* (the constant divisor, ``B`` times the
replica's data-parallel ranks, is applied once, after the cross-replica sum), and the cross-replica reduction works on each
parameter's local shard. Checkpoints hold local shards too. A user who shards the model
in ``configure_model`` (over the strategy's ``device_mesh``) keeps their FSDP units; the
sum reduction is set on them all the same. With ``recover.tensor_parallel > 1`` the mesh is
2-D, the user's ``parallelize_module`` runs on its ``"tensor_parallel"`` dimension and FSDP2
on its ``"data_parallel"`` one; a parameter's local shard is then its (dp, tp) part, which
the replicas' ranks at the same position reduce together as before.

Two helpers serve the step's schedule: :func:`set_gradient_sync` turns the in-replica
reduce-scatter off on the microbatches before the last (FSDP2 then accumulates the
unsharded gradient, as stock HSDP with ``set_requires_gradient_sync``), and
:func:`on_gradient_ready` reports each parameter's gradient as final, which FSDP2 does
after a unit's reduce-scatter and autograd after accumulating a plain parameter's -- the
signal the overlapped cross-replica reduction waits for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_recover.config import ConfigurationError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def replica_mesh(device_type: str, shards: int, tensor_parallel: int = 1) -> DeviceMesh:
    """The mesh over this replica's ``shards`` ranks (torch's default group, replica-local).

    Without tensor parallelism one dimension, named ``"data_parallel"`` as the FSDP dimension
    of Lightning's ``ModelParallelStrategy`` mesh, so ``fully_shard(m, mesh=self.device_mesh)``
    and ``self.device_mesh["data_parallel"]`` in ``configure_model`` both shard over the
    replica. With ``tensor_parallel > 1`` the 2-D ``("data_parallel", "tensor_parallel")``
    mesh of ``ModelParallelStrategy``, ranks in the row-major order of
    :class:`~lightning_recover.comm.topology.ReplicaGrid`.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if tensor_parallel == 1:
        return init_device_mesh(device_type, (shards,), mesh_dim_names=("data_parallel",))
    return init_device_mesh(
        device_type, (shards // tensor_parallel, tensor_parallel), mesh_dim_names=("data_parallel", "tensor_parallel")
    )


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over: ``mesh["data_parallel"]`` of a 2-D replica mesh, else ``mesh``."""
    return mesh["data_parallel"] if mesh.ndim > 1 else mesh


def is_tensor_parallel(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor over a ``"tensor_parallel"`` mesh dimension
    (``parallelize_module`` ran on ``device_mesh["tensor_parallel"]``)."""
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()):
            return True
    return False


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any submodule of ``model`` (or the model) was already wrapped by FSDP2's ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard_model(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """Shard ``model`` over ``mesh`` (its ``"data_parallel"`` dimension) unless the user did
    (``configure_model``); every FSDP unit then sums.

    The default wrapping is one FSDP unit per repeated block (the members of ModuleLists),
    then the root. A model the user sharded keeps its units; only its root is wrapped if the
    user left it out, since parameters outside every unit would never be reduced inside the
    replica and its shard ranks would drift apart.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = data_parallel_mesh(mesh)
    if not is_sharded(model):
        for container in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
            for block in container:
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif not isinstance(model, FSDPModule):
        fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # Both are needed on gloo: the divide factor alone is refused ("PREMUL_SUM").
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)


def require_tensor_parallel(model: torch.nn.Module, tensor_parallel: int) -> None:
    """Refuse ``recover.tensor_parallel > 1`` on a model that ``configure_model`` did not parallelize:
    its TP ranks would each compute the whole model on the same samples, doing the work twice."""
    if tensor_parallel > 1 and not is_tensor_parallel(model):
        raise ConfigurationError(
            f"recover.tensor_parallel={tensor_parallel} but no parameter of {type(model).__name__} is tensor-parallel; "
            'apply parallelize_module(..., self.device_mesh["tensor_parallel"], plan) in configure_model, '
            "or set recover.tensor_parallel=1"
        )


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters inside the replica (every FSDP unit of ``model``)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(sync, recurse=False)


def on_gradient_ready(params: list[torch.nn.Parameter], ready: Callable[[int, Tensor], None]) -> list[Any]:
    """Call ``ready(i, grad)`` once ``params[i].grad`` holds this backward's (accumulated) gradient.

    ``grad`` is its local shard, read when the hook runs: FSDP2 may give a parameter a new
    gradient tensor in backward (seen for the root unit's parameters) instead of
    accumulating into the one it had. A post-accumulate-grad hook: autograd runs it for a
    plain parameter, FSDP2 for a sharded one after its unit's reduce-scatter (not at all
    while gradient sync is off). Returns the handles (``.remove()`` them to undo).
    """

    def hook_for(i: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            assert param.grad is not None
            ready(i, local(param.grad))

        return hook

    return [p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(params)]


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def to_local_tree(obj: Any) -> Any:
    """A copy of ``obj`` with every tensor replaced by a detached CPU copy of its local shard."""
    if isinstance(obj, Tensor):
        return local(obj).detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_local_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_local_tree(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_local_tree(v) for v in obj)
    return obj
