"""Tensor parallel inside a replica, the pure parts: the replica's grid, the setting, the refusal of an unparallelized model."""

from __future__ import annotations

import pytest
import torch

from lightning_recover.comm.topology import ReplicaGrid
from lightning_recover.config import ConfigurationError, RecoverConfig
from lightning_recover.strategies.sharding import require_tensor_parallel


def test_grid_is_row_major_data_parallel_by_tensor_parallel() -> None:
    grid = ReplicaGrid(shards=6, tensor_parallel=3)
    assert grid.data_parallel == 2
    assert [(grid.data_index(s), grid.tensor_index(s)) for s in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [ReplicaGrid(4).data_index(s) for s in range(4)] == [0, 1, 2, 3], "no TP: every shard is its own data index"
    with pytest.raises(ValueError, match="shard 6 out of range"):
        grid.data_index(6)
    with pytest.raises(ValueError, match="does not divide shards=4"):
        ReplicaGrid(shards=4, tensor_parallel=3)


def test_tensor_parallel_setting_divides_shards() -> None:
    assert RecoverConfig(shards=4, tensor_parallel=2).data_parallel == 2
    assert RecoverConfig(shards=4).data_parallel == 4
    with pytest.raises(ConfigurationError, match=r"a divisor of recover.shards=4, got 3 \(recover.tensor_parallel=3\)"):
        RecoverConfig(shards=4, tensor_parallel=3)
    with pytest.raises(ConfigurationError, match="tensor_parallel must be a positive integer"):
        RecoverConfig(tensor_parallel=0)


def test_tensor_parallel_without_parallelize_module_is_refused() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    require_tensor_parallel(model, 1)  # no TP asked: nothing to check
    with pytest.raises(ConfigurationError, match=r"recover.tensor_parallel=2 but no parameter of Sequential is tensor-parallel"):
        require_tensor_parallel(model, 2)
