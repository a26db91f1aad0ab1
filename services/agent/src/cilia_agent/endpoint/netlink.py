"""Read-only netlink views the endpoint manager needs for CHECK and chaining.

:func:`inspect_interface` reads one interface inside a pod's netns (MAC,
IPv4 addresses, IPv4 routes of the main table, and its veth peer link);
:func:`find_host_peer` finds the host-side end of a veth whose container side
another plugin created (generic-veth chaining, upstream
``plugins/cilium-cni/chaining/generic-veth``: the peer is the link whose
ifindex is the container interface's ``IFLA_LINK``). Every function opens and
closes its own netlink sockets and may run in any thread.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cilia_agent.datapath import DatapathError
from cilia_agent.datapath.netns import iproute_in

RT_TABLE_MAIN = 254
_ENODEV = 19


@dataclass(frozen=True)
class NetnsInterface:
    """One interface inside a netns.

    Attributes:
        ifindex: its index in that netns.
        mac: lower-case ``aa:bb:..`` ("" when it has none).
        kind: link kind (``veth``, ``dummy``, ... ; "" when unknown).
        addresses: IPv4 addresses as ``ip/prefixlen`` strings.
        routes: IPv4 routes of the main table in the netns as ``(dst cidr, gateway or "")``;
            the default route is ``("0.0.0.0/0", gw)``. Routes of every device are listed.
        peer_ifindex: ``IFLA_LINK`` (a veth's peer index in the peer's netns; 0 = none).
        peer_netnsid: ``IFLA_LINK_NETNSID`` (-1 when the peer is in the same netns).
        mtu: ``IFLA_MTU`` in bytes (0 when the kernel did not report it).
    """

    ifindex: int
    mac: str
    kind: str
    addresses: list[str] = field(default_factory=list)
    routes: list[tuple[str, str]] = field(default_factory=list)
    peer_ifindex: int = 0
    peer_netnsid: int = -1
    mtu: int = 0


@dataclass(frozen=True)
class HostPeer:
    """The host-side end of a container veth: name, MAC and ifindex in the host netns."""

    name: str
    mac: str
    ifindex: int


def _get_link(ipr: IPRoute, **kw: Any) -> Any:
    try:
        return ipr.link("get", **kw)[0]
    except NetlinkError as exc:
        if exc.code == _ENODEV:
            return None
        raise


def _kind(msg: Any) -> str:
    info = msg.get("IFLA_LINKINFO")
    if info is None:
        return ""
    return str(info.get("IFLA_INFO_KIND") or "")


def _routes(ipr: IPRoute) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for r in ipr.get_routes(family=socket.AF_INET, table=RT_TABLE_MAIN):
        dst = r.get("RTA_DST") or "0.0.0.0"
        out.append((f"{dst}/{r['dst_len']}", str(r.get("RTA_GATEWAY") or "")))
    return out


def inspect_interface(netns: str, ifname: str) -> NetnsInterface | None:
    """Return the interface ``ifname`` inside ``netns``, or None when it does not exist.

    Raises:
        NetnsNotFound: ``netns`` does not exist or is not a netns.
        DatapathError: netlink failed.
    """
    try:
        with iproute_in(netns) as ns:
            msg = _get_link(ns, ifname=ifname)
            if msg is None:
                return None
            idx = int(msg["index"])
            addrs = [
                f"{a.get('IFA_ADDRESS')}/{a['prefixlen']}"
                for a in ns.addr("dump", index=idx)
                if a["family"] == socket.AF_INET
            ]
            netnsid = msg.get("IFLA_LINK_NETNSID")
            return NetnsInterface(
                ifindex=idx,
                mac=str(msg.get("IFLA_ADDRESS") or "").lower(),
                kind=_kind(msg),
                addresses=addrs,
                routes=_routes(ns),
                peer_ifindex=int(msg.get("IFLA_LINK") or 0),
                peer_netnsid=int(netnsid) if netnsid is not None else -1,
                mtu=int(msg.get("IFLA_MTU") or 0),
            )
    except NetlinkError as exc:
        raise DatapathError(f"cannot read {ifname} in {netns}: {exc}") from exc


def find_host_peer(container: NetnsInterface) -> HostPeer | None:
    """The host-netns end of the veth ``container`` (None when it is not in the host netns).

    The candidate is the host link with index ``container.peer_ifindex``; it must be a
    veth whose own ``IFLA_LINK`` is ``container.ifindex`` (indexes are per netns, so a
    same-numbered unrelated host link is refused).

    Raises:
        DatapathError: netlink failed.
    """
    if container.kind and container.kind != "veth":
        return None
    if container.peer_ifindex <= 0 or container.peer_netnsid < 0:
        return None
    try:
        with IPRoute() as ipr:
            msg = _get_link(ipr, index=container.peer_ifindex)
    except NetlinkError as exc:
        raise DatapathError(f"cannot read host link {container.peer_ifindex}: {exc}") from exc
    if msg is None or _kind(msg) != "veth":
        return None
    if int(msg.get("IFLA_LINK") or 0) != container.ifindex:
        return None
    return HostPeer(
        name=str(msg.get_attr("IFLA_IFNAME")),
        mac=str(msg.get("IFLA_ADDRESS") or "").lower(),
        ifindex=int(msg["index"]),
    )


def host_link_index(name: str) -> int:
    """Index of host link ``name``, 0 when absent."""
    try:
        return socket.if_nametoindex(name)
    except OSError:
        return 0


def bpf_filter_names(ifindex: int, parents: tuple[str, ...]) -> dict[str, list[str]]:
    """``parent -> [bpf program name, ...]`` of the tc filters on host link ``ifindex``.

    ``parents`` are tc handles such as ``"ffff:fff2"`` (clsact ingress). A missing
    device or qdisc gives empty lists.
    """
    out: dict[str, list[str]] = {p: [] for p in parents}
    with IPRoute() as ipr:
        for parent in parents:
            try:
                msgs = ipr.get_filters(index=ifindex, parent=parent)
            except NetlinkError:
                continue
            for m in msgs:
                opts = m.get("TCA_OPTIONS")
                name = opts.get("TCA_BPF_NAME") if opts is not None else None
                if m.get("TCA_KIND") == "bpf" and name:
                    out[parent].append(str(name))
    return out
