"""FSDP2 inside a replica: shard the model over the replica's S ranks, and read local shards.

The replica-local FSDP2 reduce-scatter must *sum* (the constant ``B * S`` divisor is
applied once, after the cross-replica sum), and the cross-replica reduction works on each
parameter's local shard. Checkpoints hold local shards too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer


def shard_model(model: torch.nn.Module, shards: int, device_type: str) -> None:
    """One FSDP unit per repeated block (the members of ModuleLists), then the root; all units sum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(device_type, (shards,))
    if not any(isinstance(m, FSDPModule) for m in model.modules()):
        for container in [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]:
            for block in container:
                fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # Both are needed on gloo: the divide factor alone is refused ("PREMUL_SUM").
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)


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


def load_local_optimizer_state(opt: Optimizer, state: dict[str, Any]) -> None:
    """Load a state saved by :func:`to_local_tree`: per-parameter tensors become DTensors again."""
    from torch.distributed.tensor import DTensor

    opt.load_state_dict(state)
    for group in opt.param_groups:
        for p in group["params"]:
            if not hasattr(p, "device_mesh"):
                continue
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == p.to_local().shape:
                    opt.state[p][key] = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False)
