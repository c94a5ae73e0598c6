"""Probes of the fake hosts (:mod:`benchmarks.rigs.fake_cluster`) shared by the launched fake-host tests.

A host fault is only judged once the test has seen what it did to the network: whether
one host can still reach another decides whether a partition or a flap is in force.
"""

from __future__ import annotations

import sys

from benchmarks.rigs.fake_cluster import FakeCluster


def reachable(cluster: FakeCluster, src: int, dst: int, timeout: float = 1.0) -> bool:
    """A TCP connect from host ``src`` to a closed port of host ``dst``: refused = reachable, timeout = cut off."""
    code = (
        "import socket,sys\n"
        f"try: socket.create_connection(({cluster.hosts[dst].address!r}, 9), timeout={timeout})\n"
        "except ConnectionRefusedError: sys.exit(0)\n"
        "except OSError: sys.exit(1)\n"
    )
    return cluster.run(src, [sys.executable, "-c", code], check=False).returncode == 0
