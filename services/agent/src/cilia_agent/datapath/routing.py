"""Routes to other nodes' pod CIDRs: native routing or a VXLAN tunnel (pyroute2).

``--routing-mode native`` (upstream ``routing-mode=native``): for every other node, each of
its pod CIDRs is routed via that node's address on the shared network::

    10.200.1.0/24 via 192.0.2.12 proto 0xc1

``--routing-mode tunnel --tunnel-protocol vxlan`` (upstream's default mode): one VXLAN
device ``--tunnel-device`` (default ``cilium_vxlan``, UDP ``--tunnel-port`` 8472, VNI
``--tunnel-vni``) whose MAC is derived from the node's own address
(:func:`tunnel_mac`), so no MAC needs to be exchanged; for every other node::

    fdb   <mac of 192.0.2.12> dev cilium_vxlan dst 192.0.2.12 permanent
    neigh 192.0.2.12 lladdr <mac of 192.0.2.12> dev cilium_vxlan permanent
    route 10.200.1.0/24 via 192.0.2.12 dev cilium_vxlan onlink proto 0xc1

The device MTU is the underlay's minus :data:`VXLAN_OVERHEAD` (50 bytes: outer IPv4 20 +
UDP 8 + VXLAN 8 + inner Ethernet 14), and pods get the same MTU.

Every route carries the routing protocol :data:`RTPROT_CILIA`, so a restarted agent finds
the routes it installed and removes only those of nodes that are gone (:meth:`sync`); routes
and tunnel entries are never removed on a plain stop, so traffic between nodes goes on while
the agent is down or restarting.

Everything here is synchronous netlink work for the agent's worker threads.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from socket import AF_INET
from typing import Literal, Protocol

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cilia_agent.config import Config
from cilia_agent.datapath import rtnl
from cilia_agent.datapath.errors import DatapathError

log = logging.getLogger(__name__)

RoutingMode = Literal["native", "tunnel"]
ROUTING_MODES: tuple[RoutingMode, ...] = ("native", "tunnel")

RTPROT_CILIA = 0xC1
"""Routing protocol number marking the routes this agent installed (``ip route ... proto
0xc1``; not a number the kernel or common daemons use)."""

RT_TABLE_MAIN = 254
RTNH_F_ONLINK = 4
NUD_PERMANENT = 0x80
VXLAN_OVERHEAD = 50
"""Bytes VXLAN over IPv4 adds to a packet (outer IPv4 20, UDP 8, VXLAN 8, inner Ethernet 14)."""


@dataclass(frozen=True)
class RemoteNode:
    """Another node as the operator's node stream describes it.

    Attributes:
        name: node name.
        address: the IPv4 address other nodes reach it at ("" when it has none).
        pod_cidrs: every pod CIDR it holds (all pools, draining ones included).
    """

    name: str
    address: str
    pod_cidrs: tuple[str, ...] = field(default_factory=tuple)


class NodeRoutes(Protocol):
    """What the node manager calls (native routing or a tunnel)."""

    def setup(self) -> None:
        """Create what the mode needs on this node (idempotent)."""

    def sync(self, nodes: Sequence[RemoteNode]) -> list[str]:
        """Make the installed routes exactly those of ``nodes``; returns one line per node
        that could not be routed (the reason)."""


def tunnel_mac(address: str) -> str:
    """The tunnel device MAC of the node at ``address``: ``0e:c1`` + its four IPv4 bytes
    (locally administered, unicast), e.g. ``192.0.2.12`` → ``0e:c1:c0:00:02:0c``.

    Raises:
        ValueError: ``address`` is not IPv4.
    """
    packed = ipaddress.IPv4Address(address).packed
    return "0e:c1:" + ":".join(f"{b:02x}" for b in packed)


def _routes() -> dict[str, tuple[str, int]]:
    """Installed routes of :data:`RTPROT_CILIA`: ``cidr -> (gateway, oif)``.

    One dump the kernel filters to the main table and this protocol (a strict
    :class:`~cilia_agent.datapath.rtnl.Rtnl` socket), so the pods' /32 routes are not sent
    and parsed each sync (pyroute2 parsed every route: 25 ms of CPU at 200 pods).

    Raises:
        NetlinkError: the kernel refused the dump.
        OSError: the netlink socket failed.
    """
    out: dict[str, tuple[str, int]] = {}
    with rtnl.Rtnl.open(strict=True) as sock:
        payloads = sock.dump(rtnl.RTM_GETROUTE, rtnl.main_routes(protocol=RTPROT_CILIA))
    for payload in payloads:
        route = rtnl.parse_route(payload)
        if route.protocol != RTPROT_CILIA or route.table != RT_TABLE_MAIN or not route.dst_len:
            continue  # a kernel without strict dumps sent every route
        out[f"{route.dst}/{route.dst_len}"] = (route.gateway, route.oif)
    return out


def _valid(node: RemoteNode) -> tuple[list[str], str]:
    """The node's IPv4 pod CIDRs and the reason it cannot be routed ("" = routable)."""
    if not node.address:
        return [], f"node {node.name}: no address (its routes are withdrawn)"
    try:
        ipaddress.IPv4Address(node.address)
    except ValueError:
        return [], f"node {node.name}: address {node.address!r} is not IPv4"
    cidrs: list[str] = []
    for cidr in node.pod_cidrs:
        try:
            cidrs.append(str(ipaddress.IPv4Network(cidr)))
        except ValueError:
            log.warning("node %s: ignoring pod CIDR %r", node.name, cidr)
    return cidrs, ""


class NativeRouting:
    """:class:`NodeRoutes` for ``--routing-mode native``.

    Args:
        local_cidrs: returns this node's own pod CIDRs (never routed elsewhere).
        direct: ``--auto-direct-node-routes``: route each other node's pod CIDRs via its
            address; False installs none (the network's routers carry pod CIDRs, as
            upstream's native routing without direct routes) and withdraws any this agent
            installed before.
    """

    def __init__(self, local_cidrs: _LocalCidrs, direct: bool = True) -> None:
        self.local_cidrs = local_cidrs
        self.direct = direct

    def setup(self) -> None:
        """Nothing to create: routes use the node's own network."""

    def sync(self, nodes: Sequence[RemoteNode]) -> list[str]:
        """See :class:`NodeRoutes`. A gateway that is not on a directly connected network
        is refused by the kernel: that node's routes are not installed and it is reported.

        Raises:
            DatapathError: the routing table cannot be read.
        """
        problems: list[str] = []
        local = set(self.local_cidrs())
        try:
            with IPRoute() as ipr:
                have = _routes()
                want: dict[str, str] = {}
                names: dict[str, str] = {}
                for node in nodes if self.direct else ():
                    cidrs, reason = _valid(node)
                    if reason:
                        problems.append(reason)
                        continue
                    for cidr in cidrs:
                        if cidr not in local:
                            want[cidr] = node.address
                            names[cidr] = node.name
                for cidr, gateway in want.items():
                    if have.get(cidr, ("", 0))[0] == gateway:
                        continue
                    try:
                        ipr.route(
                            "replace",
                            dst=cidr,
                            gateway=gateway,
                            proto=RTPROT_CILIA,
                            table=RT_TABLE_MAIN,
                        )
                        log.info("route installed", extra={"cidr": cidr, "via": gateway})
                    except NetlinkError as exc:
                        problems.append(
                            f"node {names[cidr]}: route {cidr} via {gateway}: {exc.args[-1]}"
                        )
                for cidr in set(have) - set(want):
                    _delete_route(ipr, cidr)
        except (NetlinkError, OSError) as exc:
            raise DatapathError(f"cannot read or change the routing table: {exc}") from exc
        return problems


class _LocalCidrs(Protocol):
    def __call__(self) -> Iterable[str]: ...


def _unreachable(ipr: IPRoute, address: str) -> str:
    """Why ``address`` is no tunnel endpoint for this node ("" when it is): it must be on
    a network this node is attached to, as in native routing. An address reached only
    through a gateway (the node's default route) is on no network the nodes share: tunnel
    packets would leave towards that gateway, so the node is reported, not routed."""
    try:
        found = ipr.route("get", dst=address)
    except NetlinkError as exc:
        return f"address {address} is not reachable from this node ({exc.args[-1]})"
    gateway = found[0].get_attr("RTA_GATEWAY") if found else None
    if gateway:
        return (
            f"address {address} is on no network this node is attached to "
            f"(reached only via gateway {gateway})"
        )
    return ""


def _delete_route(ipr: IPRoute, cidr: str) -> None:
    try:
        ipr.route("del", dst=cidr, proto=RTPROT_CILIA, table=RT_TABLE_MAIN)
        log.info("route withdrawn", extra={"cidr": cidr})
    except NetlinkError as exc:
        if exc.code != 3:  # ESRCH: already gone
            log.warning("cannot withdraw route %s: %s", cidr, exc)


class VxlanTunnel:
    """:class:`NodeRoutes` for ``--routing-mode tunnel --tunnel-protocol vxlan``.

    Args:
        device: ``--tunnel-device``.
        port: ``--tunnel-port`` (UDP).
        vni: ``--tunnel-vni``.
        local_address: this node's address (the tunnel source; its MAC derives from it).
        mtu: the tunnel device MTU (underlay MTU - :data:`VXLAN_OVERHEAD`).
        local_cidrs: returns this node's own pod CIDRs (never routed elsewhere).
    """

    def __init__(
        self,
        *,
        device: str,
        port: int,
        vni: int,
        local_address: str,
        mtu: int,
        local_cidrs: _LocalCidrs,
    ) -> None:
        self.device = device
        self.port = port
        self.vni = vni
        self.local_address = local_address
        self.mtu = mtu
        self.local_cidrs = local_cidrs

    def _index(self, ipr: IPRoute) -> int | None:
        found = ipr.link_lookup(ifname=self.device)
        return int(found[0]) if found else None

    def setup(self) -> None:
        """Create the VXLAN device (or fix the MTU/MAC of an existing one) and bring it up.

        Raises:
            DatapathError: netlink refused (e.g. the port is taken by another VXLAN device).
        """
        mac = tunnel_mac(self.local_address)
        try:
            with IPRoute() as ipr:
                idx = self._index(ipr)
                if idx is None:
                    ipr.link(
                        "add",
                        ifname=self.device,
                        kind="vxlan",
                        vxlan_id=self.vni,
                        vxlan_port=self.port,
                        vxlan_local=self.local_address,
                        vxlan_learning=0,
                        address=mac,
                        mtu=self.mtu,
                    )
                    idx = self._index(ipr)
                    log.info(
                        "tunnel device created",
                        extra={"device": self.device, "vni": self.vni, "port": self.port},
                    )
                assert idx is not None
                link = ipr.get_links(idx)[0]
                if link.get_attr("IFLA_MTU") != self.mtu:
                    ipr.link("set", index=idx, mtu=self.mtu)
                if link.get_attr("IFLA_ADDRESS") != mac:
                    # a new address flushes the device's neighbours: only when it differs, so
                    # a restarted agent keeps forwarding through the entries it left
                    ipr.link("set", index=idx, address=mac)
                ipr.link("set", index=idx, state="up")
        except NetlinkError as exc:
            raise DatapathError(
                f"cannot create VXLAN device {self.device} (VNI {self.vni}, UDP {self.port}): "
                f"{exc.args[-1]}"
            ) from exc

    def sync(self, nodes: Sequence[RemoteNode]) -> list[str]:
        """See :class:`NodeRoutes`: FDB, neighbour and route per other node; the entries of
        nodes no longer listed are removed.

        Raises:
            DatapathError: the tunnel device is missing or netlink refused a read.
        """
        problems: list[str] = []
        local = set(self.local_cidrs())
        try:
            with IPRoute() as ipr:
                idx = self._index(ipr)
                if idx is None:
                    raise DatapathError(f"tunnel device {self.device} does not exist")
                have = _routes()
                neighbours, fdb = self._peers(ipr, idx)
                want: dict[str, str] = {}
                addresses: set[str] = set()
                for node in nodes:
                    cidrs, reason = _valid(node)
                    if reason:
                        problems.append(reason)
                        continue
                    if node.address == self.local_address:
                        continue
                    unreachable = _unreachable(ipr, node.address)
                    if unreachable:
                        problems.append(f"node {node.name}: {unreachable}")
                        continue
                    addresses.add(node.address)
                    for cidr in cidrs:
                        if cidr not in local:
                            want[cidr] = node.address
                for address in addresses:
                    self._add_peer(
                        ipr, idx, address, fdb=address in fdb, neigh=address in neighbours
                    )
                for cidr, gateway in want.items():
                    if have.get(cidr) == (gateway, idx):
                        continue
                    ipr.route(
                        "replace",
                        dst=cidr,
                        gateway=gateway,
                        oif=idx,
                        flags=RTNH_F_ONLINK,
                        proto=RTPROT_CILIA,
                        table=RT_TABLE_MAIN,
                    )
                    log.info("tunnel route installed", extra={"cidr": cidr, "node": gateway})
                for cidr in set(have) - set(want):
                    _delete_route(ipr, cidr)
                for address in (neighbours | fdb) - addresses:
                    self._delete_peer(ipr, idx, address)
        except (NetlinkError, OSError) as exc:
            raise DatapathError(f"tunnel {self.device}: {exc.args[-1]}") from exc
        return problems

    def _peers(self, ipr: IPRoute, idx: int) -> tuple[set[str], set[str]]:
        """``(neighbours, fdb)``: addresses with a permanent neighbour entry, and with an FDB
        entry, on the tunnel device (a peer half set up by an interrupted sync is completed
        or removed)."""
        neighbours: set[str] = set()
        for neigh in ipr.get_neighbours(family=AF_INET, ifindex=idx):
            if neigh["state"] & NUD_PERMANENT:
                dst = neigh.get_attr("NDA_DST")
                if dst:
                    neighbours.add(dst)
        fdb: set[str] = set()
        for entry in ipr.fdb("dump", ifindex=idx):
            dst = entry.get_attr("NDA_DST")
            if dst and entry["ifindex"] == idx:
                fdb.add(dst)
        return neighbours, fdb

    def _add_peer(self, ipr: IPRoute, idx: int, address: str, *, fdb: bool, neigh: bool) -> None:
        """The FDB and neighbour entries of a peer that lacks them."""
        mac = tunnel_mac(address)
        if not fdb:
            ipr.fdb("append", ifindex=idx, lladdr=mac, dst=address, state=NUD_PERMANENT)
        if not neigh:
            ipr.neigh("replace", dst=address, lladdr=mac, ifindex=idx, state=NUD_PERMANENT)
        if not fdb or not neigh:
            log.info("tunnel peer added", extra={"node": address, "mac": mac})

    def _delete_peer(self, ipr: IPRoute, idx: int, address: str) -> None:
        mac = tunnel_mac(address)
        try:
            ipr.neigh("del", dst=address, ifindex=idx)
        except NetlinkError as exc:
            log.warning("tunnel peer %s: cannot remove its neighbour entry: %s", address, exc)
        try:
            ipr.fdb("del", ifindex=idx, lladdr=mac, dst=address)
        except NetlinkError as exc:
            log.warning("tunnel peer %s: cannot remove its FDB entry: %s", address, exc)
        log.info("tunnel peer removed", extra={"node": address})


def node_routes(
    cfg: Config, addresses: Sequence[str], local_cidrs: _LocalCidrs, mtu: int = 0
) -> NodeRoutes:
    """The :class:`NodeRoutes` of ``--routing-mode`` (``addresses``: this node's, the first is
    the node address and the tunnel source; ``mtu``: the pods' MTU, already minus the VXLAN
    overhead in tunnel mode, which the tunnel device gets; 0 = :meth:`Config.pod_mtu`).

    Raises:
        DatapathError: tunnel mode on a node without an IPv4 address.
    """
    if cfg.routing_mode == "native":
        return NativeRouting(local_cidrs, direct=cfg.auto_direct_node_routes)
    if not addresses:
        raise DatapathError(
            "--routing-mode tunnel: this node has no IPv4 address to send the tunnel from"
        )
    return VxlanTunnel(
        device=cfg.tunnel_device,
        port=cfg.tunnel_port,
        vni=cfg.tunnel_vni,
        local_address=addresses[0],
        mtu=mtu or cfg.pod_mtu(),
        local_cidrs=local_cidrs,
    )
