"""Which address of this host ranks on other hosts can reach: for rendezvous stores and gloo.

A replica (or a data-plane group) whose ranks run on several hosts meets at a ``TCPStore``
hosted by one of them, and gloo then connects every pair of ranks directly. Both need an
address of this host that the *other* hosts reach. ``gethostbyname(gethostname())`` is not
one on Debian-style nodes, whose ``/etc/hosts`` maps the node's own name to ``127.0.1.1``;
gloo makes the same mistake by itself (it binds to what the hostname resolves to), unless
``GLOO_SOCKET_IFNAME`` names an interface.

The rule here: this host's address is the *source address of its route to a peer host*
(resolve the peer's name, ``connect`` a UDP socket to it -- nothing is sent -- and read the
local end). That is the interface the peer's traffic actually comes in on, whatever this
host's own name resolves to, and on a cluster whose MPI runs over that network it is the
interface Open MPI's TCP transports use too. It needs the peers' names to resolve to their
cluster addresses on this host (DNS or ``/etc/hosts``), which a working MPI job needs anyway.
On a host with several routes to different peers, the route to the first peer (by name) is
taken; set ``GLOO_SOCKET_IFNAME`` to choose another interface for gloo.

Pure standard library.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Sequence

#: ioctl that reads an interface's IPv4 address (linux/sockios.h).
_SIOCGIFADDR = 0x8915


def route_address(peer_host: str) -> str:
    """This host's source address on its route to ``peer_host`` (a name or an address); sends nothing."""
    try:
        peer = socket.gethostbyname(peer_host)
    except OSError as exc:
        raise OSError(
            f"cannot resolve host {peer_host!r} (a rank of this job runs there): {exc}; make its name resolve on this "
            "host (DNS or /etc/hosts)"
        ) from exc
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # UDP connect only picks the route; the port is irrelevant
        return str(s.getsockname()[0])


def reachable_address(hosts: Sequence[str], me: str | None = None) -> str:
    """The address ranks on the other hosts of ``hosts`` reach this host at; ``127.0.0.1`` when all are on one host.

    ``hosts``: where the members run, this rank among them (so one distinct name is this
    host). ``me``: this host's name (default ``socket.gethostname()``)."""
    if len(set(hosts)) <= 1:
        return "127.0.0.1"
    me = me if me is not None else socket.gethostname()
    others = sorted(set(hosts) - {me})
    tried = []
    for peer in others:
        addr = route_address(peer)
        if not ipaddress.ip_address(addr).is_loopback:
            return addr
        tried.append(f"{peer} -> {addr}")
    raise OSError(
        f"every peer host of {me!r} resolves to a loopback route here ({', '.join(tried)}), so no address of this host "
        "is reachable from them; make the peers' names resolve to their cluster addresses (DNS or /etc/hosts)"
    )


def interface_of(address: str) -> str | None:
    """The name of the interface holding IPv4 ``address``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def prepare_gloo(hosts: Sequence[str]) -> str | None:
    """Point gloo at the interface other hosts reach (``GLOO_SOCKET_IFNAME``) when ``hosts`` span hosts.

    Left alone when the user set ``GLOO_SOCKET_IFNAME``, or all of ``hosts`` are this host
    (gloo's own choice then works). Returns the interface chosen, else None. Must run
    before the gloo group is created: gloo reads the variable then."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    addr = reachable_address(hosts)
    if ipaddress.ip_address(addr).is_loopback:
        return None
    name = interface_of(addr)
    if name is None:
        raise OSError(f"no interface of this host holds {addr} (its route to a peer host); set GLOO_SOCKET_IFNAME to the cluster interface")
    os.environ["GLOO_SOCKET_IFNAME"] = name
    return name
