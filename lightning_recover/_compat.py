"""The torch APIs the package relies on, with the first torch release that has each public.

Installation, not the protocol: the lower bound on torch in ``pyproject.toml`` is the
newest release in :data:`TORCH_APIS` (:data:`MIN_TORCH`), with no upper bound, so any
current CUDA build of torch installs. ``tests/inprocess/test_packaging.py`` keeps the two in step:
it checks that every entry exists in the installed torch, that every FSDP2 / DTensor /
``torch.distributed`` submodule API the package's source touches has an entry, and that
``pyproject.toml`` says ``torch>=MIN_TORCH``. Adding a newer torch API means adding its
row here (and the bound moves with it).

Where a release was checked, and how:

* ``FSDPModule.set_gradient_divide_factor`` and ``set_force_sum_reduction_for_comms``
  arrived together in pytorch/pytorch#155915 ("Allow forcing FSDP2 to always use SUM
  reductions", June 2025, which also renamed ``set_reduce_scatter_divide_factor``),
  before the 2.8 branch cut; code that supports both releases falls back to
  ``set_reduce_scatter_divide_factor`` on torch < 2.8. Both are needed on gloo (see
  :mod:`lightning_recover.strategies.sharding`), so they need 2.8.
* ``FSDPModule.set_custom_all_gather`` and ``set_custom_reduce_scatter`` (the replica
  plane, :mod:`lightning_recover.comm.replica_plane`): pytorch/pytorch#155189
  ("support custom all_gather and reduce_scatter comms"), approved in July 2025, after the
  2.8 branch cut, so 2.9 is the floor.
* ``torch.distributed.fsdp.fully_shard`` / ``FSDPModule``: the public FSDP2 path since 2.6
  (``torch.distributed._composable.fsdp`` before).
* ``torch.distributed.tensor``: public DTensor since 2.5 (``torch.distributed._tensor`` before).
* ``torch.distributed.device_mesh.init_device_mesh``: public since 2.2.
* ``torch.distributed.device_mesh.DeviceMesh``: public since 2.2 (the same module).
"""

from __future__ import annotations

#: Dotted torch API -> the torch release (major.minor) from which it is public: the first
#: one for the entries listed above the table, an early release known to have it for the
#: long-standing rest.
TORCH_APIS: dict[str, str] = {
    "torch.distributed.fsdp.fully_shard": "2.6",
    "torch.distributed.fsdp.FSDPModule": "2.6",
    "torch.distributed.fsdp.FSDPModule.set_gradient_divide_factor": "2.8",
    "torch.distributed.fsdp.FSDPModule.set_force_sum_reduction_for_comms": "2.8",
    "torch.distributed.fsdp.FSDPModule.set_requires_gradient_sync": "2.6",
    "torch.distributed.fsdp.FSDPModule.set_custom_all_gather": "2.9",
    "torch.distributed.fsdp.FSDPModule.set_custom_reduce_scatter": "2.9",
    "torch.distributed.device_mesh.init_device_mesh": "2.2",
    "torch.distributed.device_mesh.DeviceMesh": "2.2",
    "torch.distributed.tensor.DTensor": "2.5",
    "torch.distributed.tensor.DTensor.from_local": "2.5",
    "torch.distributed.tensor.DTensor.to_local": "2.5",
    "torch.distributed.tensor.DTensor.full_tensor": "2.5",
    "torch.distributed.tensor.DTensor.placements": "2.5",
    "torch.distributed.tensor.DTensor.device_mesh": "2.5",
    # TCPStore(port=0, wait_for_workers=False) and its .port: the replica-local group's store.
    "torch.distributed.TCPStore": "2.0",
    # The gloo data plane (data_plane.py): a group per world epoch built without the default
    # process group. (Its NCCL twin, ProcessGroupNCCL, exists only in CUDA builds.)
    "torch.distributed.ProcessGroupGloo": "2.0",
    "torch.distributed.PrefixStore": "2.0",
    # Checkpoints (strategies/checkpoint_io.py, recover_hsdp.py): the FSDP2-aware state-dict helpers.
    "torch.distributed.checkpoint.state_dict.StateDictOptions": "2.2",
    "torch.distributed.checkpoint.state_dict.get_model_state_dict": "2.2",
    "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict": "2.2",
    "torch.distributed.checkpoint.state_dict.set_model_state_dict": "2.2",
    "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict": "2.2",
    # The watchdog's progress hooks do nothing while dynamo traces a user's compiled block (probes.py).
    "torch.compiler.is_compiling": "2.3",
}


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


#: The oldest torch every API above exists in: pyproject's lower bound.
MIN_TORCH: str = max(TORCH_APIS.values(), key=_key)
