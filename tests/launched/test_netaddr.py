"""lightning_recover.comm.netaddr: the address other hosts reach, checked inside fake hosts whose own
name resolves to 127.0.1.1 (Debian's /etc/hosts), where gethostbyname(gethostname()) is wrong."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from lightning_recover.comm import netaddr
from benchmarks.rigs.fake_cluster import FakeCluster

ROOT = Path(__file__).resolve().parents[2]


def in_host(cluster: FakeCluster, host: int, code: str, env: dict[str, str] | None = None) -> Any:
    """Run python ``code`` (which prints one JSON value) inside ``host``; return the value."""
    prelude = "import json, os, socket, sys; from lightning_recover.comm import netaddr\n"
    argv = ["env", f"PYTHONPATH={ROOT}", *[f"{k}={v}" for k, v in (env or {}).items()], sys.executable, "-c", prelude + code]
    return json.loads(cluster.run(host, argv).stdout)


def test_route_address_is_the_cluster_address_where_the_own_name_is_loopback(fake_cluster: Callable[..., FakeCluster]) -> None:
    cluster = fake_cluster(2, own_name_loopback=True)
    a, b = cluster.hosts
    got = in_host(cluster, 0, f"print(json.dumps([socket.gethostbyname(socket.gethostname()), netaddr.reachable_address([{a.name!r}, {b.name!r}])]))")
    assert got == ["127.0.1.1", a.address]  # the old rule's answer, and the one the other host reaches
    # gloo is pointed at the interface holding that address (it would bind 127.0.1.1 by itself).
    chosen = in_host(cluster, 1, f"print(json.dumps([netaddr.prepare_gloo([{a.name!r}, {b.name!r}]), os.environ.get('GLOO_SOCKET_IFNAME')]))")
    assert chosen == [b.iface, b.iface]
    # A user's GLOO_SOCKET_IFNAME is left alone.
    kept = in_host(cluster, 1, f"print(json.dumps([netaddr.prepare_gloo([{a.name!r}, {b.name!r}]), os.environ['GLOO_SOCKET_IFNAME']]))",
                   env={"GLOO_SOCKET_IFNAME": "lo"})
    assert kept == [None, "lo"]


def test_one_host_meets_on_the_loopback_and_leaves_gloo_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    me = socket.gethostname()
    assert netaddr.reachable_address([me, me]) == "127.0.0.1"
    assert netaddr.prepare_gloo([me]) is None
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert netaddr.interface_of("127.0.0.1") == "lo"
    assert netaddr.interface_of("192.0.2.77") is None  # TEST-NET-1: held by no interface


def test_peers_resolving_to_loopback_are_an_error_naming_them() -> None:
    with pytest.raises(OSError, match=r"localhost -> 127\.0\.0\.1.*make the peers' names resolve"):
        netaddr.reachable_address(["this-host", "localhost"], me="this-host")
    with pytest.raises(OSError, match=r"cannot resolve host 'no-such-host\.invalid'"):
        netaddr.reachable_address(["this-host", "no-such-host.invalid"], me="this-host")
