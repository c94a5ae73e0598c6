"""``ReplicaEnvironment``: one rank of the MPI world as Lightning's cluster environment sees it.

Ranks are started by ``mpiexec`` (or Slurm) and read their place from Open MPI's
environment; Lightning must never spawn or renumber them.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override


class ReplicaEnvironment(ClusterEnvironment):
    """Cluster environment of one rank in the MPI world (``OMPI_COMM_WORLD_*`` / ``PMIX_RANK``)."""

    def __init__(self) -> None:
        self._rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMIX_RANK", "0")))
        self._world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
        self._local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0"))

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    @override
    def main_port(self) -> int:
        return 0

    @staticmethod
    @override
    def detect() -> bool:
        return "OMPI_COMM_WORLD_RANK" in os.environ

    @override
    def world_size(self) -> int:
        return self._world

    @override
    def set_world_size(self, size: int) -> None:
        self._world = size

    @override
    def global_rank(self) -> int:
        return self._rank

    @override
    def set_global_rank(self, rank: int) -> None:
        self._rank = rank

    @override
    def local_rank(self) -> int:
        return self._local

    @override
    def node_rank(self) -> int:
        return 0
