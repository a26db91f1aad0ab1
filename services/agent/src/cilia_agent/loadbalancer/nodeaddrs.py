"""The node's own IPv4 addresses in ``cilia_lb4_node_addrs``, for NodePort through them.

``bpf/bpf_sock.c`` stores each NodePort once, as the surrogate ``(0.0.0.0, nodePort)``.
A connect() from a pod or a host process to ``<this node's address>:<nodePort>`` misses
the exact lookup; the socket-LB then looks up the surrogate when the address is in
:data:`~cilia_agent.loadbalancer.layout.NODE_ADDRS_MAP` (upstream's wildcard lookup of
its socket-LB). :func:`sync` makes the map hold exactly the addresses given;
:func:`local_ipv4_addresses` lists this network namespace's global IPv4 addresses (every
interface but ``lo``: the devices' addresses and the router IP on ``cilium_host``).

The map's size is ``--bpf-lb-map-max`` (it is created with the other load-balancer maps).
The agent writes it when the load balancer starts (``manager._build``); an address added
later is served from the next start.
"""

from __future__ import annotations

import ctypes
import ipaddress
import pathlib
import socket
from collections.abc import Iterable

from cilia_agent.datapath.layout import ip_from_map, ip_to_map
from cilia_agent.datapath.libbpf import PinnedMap
from cilia_agent.loadbalancer.layout import NODE_ADDRS_MAP


def local_ipv4_addresses() -> list[str]:
    """Every global-scope IPv4 address of this network namespace but those on ``lo``,
    sorted (a netlink dump).

    Raises:
        OSError: netlink refused the dump.
    """
    from pyroute2 import IPRoute

    out = set()
    with IPRoute() as ipr:
        for msg in ipr.addr("dump", family=socket.AF_INET):
            if msg["scope"] != 0:
                continue
            addr = msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS")
            if addr and not ipaddress.IPv4Address(addr).is_loopback:
                out.add(str(addr))
    return sorted(out, key=ipaddress.IPv4Address)


def sync(pin_dir: pathlib.Path, addresses: Iterable[str]) -> tuple[list[str], list[str]]:
    """Make the pinned map under ``pin_dir`` hold exactly ``addresses`` (IPv4 text).

    Returns:
        ``(added, removed)`` addresses.

    Raises:
        LibbpfError: the map is not pinned there (``bpf_sock.o`` never loaded with this pin
            dir) or cannot be written.
        ValueError: an address is not IPv4.
    """
    wanted = {str(ipaddress.IPv4Address(a)) for a in addresses}
    with PinnedMap(pin_dir / NODE_ADDRS_MAP, ctypes.c_uint32, ctypes.c_uint8) as pinned:
        present = {ip_from_map(int(k.value)): k for k in pinned}
        removed = sorted(set(present) - wanted)
        for addr in removed:
            pinned.delete(present[addr])
        added = sorted(wanted - set(present))
        for addr in added:
            pinned[ctypes.c_uint32(ip_to_map(addr))] = ctypes.c_uint8(1)
    return added, removed
