"""This node's own address and the MTU of the device that carries it (pyroute2).

The node address is what other nodes route this node's pod CIDRs to (native routing) and
send the tunnel to (VXLAN), what the node registers first with the operator and what Hubble
advertises. It is never "the first IPv4 address the kernel lists": a host whose docker0
(172.17.0.1) or a second NIC comes first would send every peer to an address they cannot
reach. The rule (upstream ``ipv4-node``, default ``auto``):

1. ``--ipv4-node`` given: that address (the device holding it, if any, gives the MTU);
2. ``auto``: the source address the kernel picks for the IPv4 default route of the main
   table (lowest metric first): its ``src`` when the route has one, else the answer of a
   route lookup to its gateway (``ip route get <gateway>``), the device being the route's;
3. no default route: the first global IPv4 address of the lowest-numbered eligible
   interface (an address on an agent device, ``lo`` or a pod veth never counts).

In Kubernetes mode the operator records the Node's ``InternalIP`` first, whatever the agent
registers, so peers use that (see the operator's NodeService).

The MTU (``--mtu 0``) is the MTU of that device: the routes to other nodes leave through it
(upstream detects the MTU the same way, from the device of the node's address).

Blocking netlink: run it in a worker thread.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cilia_agent.datapath import rtnl

log = logging.getLogger(__name__)

RTN_UNICAST = 1
RT_TABLE_MAIN = 254
RTA_OIF, RTA_GATEWAY, RTA_PRIORITY, RTA_PREFSRC, RTA_TABLE = 4, 5, 6, 7, 15
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst/src len, tos, table, proto, scope, type, flags
DEFAULT_MTU = 1500
"""The MTU used when no device carries the node address (an explicit ``--ipv4-node`` that is
not local), as Ethernet's."""


@dataclass(frozen=True)
class NodeAddress:
    """This node's address, its device and that device's MTU.

    Attributes:
        address: IPv4 address ("" when the host has none).
        device: interface holding it or routing to it ("" when unknown).
        mtu: the device's MTU (:data:`DEFAULT_MTU` when unknown).
        how: which rule chose it (``ipv4-node``, ``default route``, ``first global address``).
    """

    address: str
    device: str
    mtu: int
    how: str


def _link(ipr: IPRoute, index: int) -> tuple[str, int]:
    try:
        link = ipr.get_links(index)[0]
    except (NetlinkError, IndexError):
        return "", DEFAULT_MTU
    return str(link.get_attr("IFLA_IFNAME") or ""), int(link.get_attr("IFLA_MTU") or DEFAULT_MTU)


def _global_addresses(
    ipr: IPRoute, exclude: tuple[str, ...], prefixes: tuple[str, ...]
) -> list[tuple[int, str]]:
    """``(ifindex, address)`` of every global IPv4 address on an eligible interface, by
    ifindex and then in the kernel's order (primary before secondary)."""
    out: list[tuple[int, str]] = []
    for msg in ipr.addr("dump", family=socket.AF_INET):
        if msg["scope"] != 0:
            continue
        try:
            ifname = socket.if_indextoname(msg["index"])
        except OSError:
            continue
        if ifname == "lo" or ifname in exclude or ifname.startswith(prefixes):
            continue
        addr = msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS")
        if addr:
            out.append((int(msg["index"]), str(addr)))
    out.sort(key=lambda item: item[0])  # stable: the kernel's order within one interface
    return out


def _default_route() -> tuple[str, str, int] | None:
    """``(source, gateway, oif)`` of the main table's IPv4 default route with the lowest
    metric, source "" when the route names none; None without one.

    One dump the kernel filters to the main table (a strict
    :class:`~cilia_agent.datapath.rtnl.Rtnl` socket), parsed with the project's small rtnl
    reader: the pods' /32 routes are in that table too and pyroute2 parsed each of them
    (12 ms of CPU at 200 pods, every ``--node-address-check-interval``; 1.3 ms this way). A
    multipath default route (no single gateway or device) falls back to rule 3, unless it
    names its ``src``.
    """
    best: tuple[int, str, str, int] | None = None
    with rtnl.Rtnl.open(strict=True) as sock:
        payloads = sock.dump(rtnl.RTM_GETROUTE, rtnl.main_routes())
    for payload in payloads:
        _f, dst_len, _s, _t, table, _p, _sc, rtype, _fl = _RTMSG.unpack_from(payload)
        if dst_len != 0 or rtype != RTN_UNICAST:
            continue  # not a default route, or a blackhole/unreachable one
        attrs = rtnl.parse_attrs(payload, _RTMSG.size)
        if RTA_TABLE in attrs:
            table = struct.unpack("=I", attrs[RTA_TABLE])[0]
        if table != RT_TABLE_MAIN:
            continue  # a kernel without strict dumps sent every table
        metric = struct.unpack("=I", attrs[RTA_PRIORITY])[0] if RTA_PRIORITY in attrs else 0
        oif = struct.unpack("=I", attrs[RTA_OIF])[0] if RTA_OIF in attrs else 0
        gateway = socket.inet_ntoa(attrs[RTA_GATEWAY]) if RTA_GATEWAY in attrs else ""
        source = socket.inet_ntoa(attrs[RTA_PREFSRC]) if RTA_PREFSRC in attrs else ""
        if best is None or metric < best[0]:
            best = (metric, source, gateway, oif)
    return None if best is None else best[1:]


def detect_node_address(
    ipv4_node: str = "auto",
    exclude: tuple[str, ...] = (),
    exclude_prefixes: tuple[str, ...] = ("lxc", "cilia_"),
) -> NodeAddress:
    """This node's address by the module docstring's rule.

    Args:
        ipv4_node: ``--ipv4-node`` (``auto`` or an IPv4 address).
        exclude, exclude_prefixes: interfaces whose addresses never count (the agent's own
            devices, pod veths).

    Raises:
        NetlinkError, OSError: netlink refused a dump.
    """
    with IPRoute() as ipr:
        addresses = _global_addresses(ipr, exclude, exclude_prefixes)
        if ipv4_node != "auto":
            wanted = str(ipaddress.IPv4Address(ipv4_node))
            index = next((i for i, a in addresses if a == wanted), 0)
            if not index:
                try:
                    found = ipr.route("get", dst=wanted)
                    index = int(found[0].get_attr("RTA_OIF") or 0) if found else 0
                except NetlinkError:
                    index = 0
            device, mtu = _link(ipr, index) if index else ("", DEFAULT_MTU)
            return NodeAddress(wanted, device, mtu, "ipv4-node")
        default = _default_route()
        if default is not None:
            source, gateway, oif = default
            if not source and gateway:
                try:
                    found = ipr.route("get", dst=gateway)
                except NetlinkError:
                    found = []
                if found:
                    source = str(found[0].get_attr("RTA_PREFSRC") or "")
                    oif = int(found[0].get_attr("RTA_OIF") or oif)
            if not source and oif:  # a device route without gateway: its first address
                source = next((a for i, a in addresses if i == oif), "")
            if source and any(a == source for _, a in addresses):
                device, mtu = _link(ipr, oif)
                return NodeAddress(source, device, mtu, "default route")
        if not addresses:
            return NodeAddress("", "", DEFAULT_MTU, "none")
        index, address = addresses[0]
        device, mtu = _link(ipr, index)
        return NodeAddress(address, device, mtu, "first global address")


def node_first(addresses: list[str], node: str) -> list[str]:
    """``addresses`` with ``node`` moved (or added) to the front; ``node`` "" keeps them."""
    if not node:
        return list(addresses)
    return [node, *(a for a in addresses if a != node)]
