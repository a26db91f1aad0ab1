"""Linux pod plumbing with pyroute2 (DESIGN.md §4 "Pod plumbing").

Per node: a dummy device ``--host-device-name`` holding the router IP /32
(on kernels without the dummy driver, a veth pair ``<name>``/``<name>_net``
shaped like upstream's ``cilium_host``/``cilium_net``),
``net.ipv4.ip_forward=1`` and the iptables chain (see :mod:`.iptables`).
Per pod: a veth pair, host side ``lxc`` + 11 hex chars of
sha256(container_id + "/" + ifname), peer created directly inside the pod's netns
as ``ifname`` (one RTM_NEWLINK); pod IP /32 on it, default
route via the router IP ``onlink``; on the host a /32 route to the pod via the
``lxc`` device.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cilia_agent.datapath import rtnl
from cilia_agent.datapath.errors import (
    DatapathError,
    DefaultRouteExists,
    HostNetns,
    InterfaceExists,
    NetnsNotFound,
)
from cilia_agent.datapath.iptables import Iptables
from cilia_agent.datapath.netns import iproute_in, is_netns, is_own_netns

log = logging.getLogger(__name__)

RTNH_F_ONLINK = 4
RT_TABLE_MAIN = 254
IP_FORWARD = pathlib.Path("/proc/sys/net/ipv4/ip_forward")
IFNAMSIZ = 15
LOOPBACK_INDEX = 1  # lo is ifindex 1 in every network namespace
_ENODEV = 19
_EEXIST = 17


def host_ifname(container_id: str, ifname: str) -> str:
    """Host-side veth name: ``lxc`` + first 11 hex chars of sha256(container_id/ifname)."""
    return "lxc" + hashlib.sha256(f"{container_id}/{ifname}".encode()).hexdigest()[:11]


@dataclass(frozen=True)
class PlumbRequest:
    """What :meth:`LinuxDatapath.plumb` needs for one pod.

    Attributes:
        container_id, ifname: the attachment key.
        netns: netns path (e.g. ``/var/run/netns/pod1``).
        ipv4: the pod IP (a /32 is configured).
        router_ip: the node's router IP (gateway of the default route).
        mtu: MTU of both veth ends (bytes).
    """

    container_id: str
    ifname: str
    netns: str
    ipv4: ipaddress.IPv4Address
    router_ip: ipaddress.IPv4Address
    mtu: int


@dataclass(frozen=True)
class PlumbResult:
    """Names and MACs of both veth ends, and the host end's ifindex (0 = unknown)."""

    host_ifname: str
    host_mac: str
    container_mac: str
    host_ifindex: int = 0


def _first(ipr: IPRoute, name: str) -> int | None:
    msg = _get(ipr, name)
    return int(msg["index"]) if msg is not None else None


def _get(ipr: IPRoute, name: str) -> Any:
    """The link message of ``name`` (one RTM_GETLINK), or None when absent."""
    try:
        return ipr.link("get", ifname=name)[0]
    except NetlinkError as exc:
        if exc.code == 19:  # ENODEV
            return None
        raise


def _raw_link(ns: rtnl.Rtnl, name: str) -> rtnl.Link | None:
    """The link ``name`` of ``ns`` (one RTM_GETLINK), or None when absent.

    Raises:
        NetlinkError: the kernel refused for another reason than ENODEV.
    """
    reply = ns.request(rtnl.get_link(name))[0]
    if reply.error == _ENODEV:
        return None
    reply.check(f"reading link {name}")
    return rtnl.parse_link(reply.messages[0][1]) if reply.messages else None


def _raw_default_route_dev(ns: rtnl.Rtnl) -> str | None:
    """Name (else ``ifindex N``) of the device of an IPv4 default route in ``ns``'s main
    table, or None when there is none (one route dump, one RTM_GETLINK when found).

    Raises:
        NetlinkError: the kernel refused the dump.
    """
    for payload in ns.dump(rtnl.RTM_GETROUTE, rtnl.main_routes()):
        route = rtnl.parse_route(payload)
        if route.table != RT_TABLE_MAIN or route.dst_len != 0:
            continue
        if not route.oif:
            return "a gateway"
        reply = ns.request(rtnl.get_link(index=route.oif))[0]
        name = rtnl.parse_link(reply.messages[0][1]).name if reply.messages else ""
        return name or f"ifindex {route.oif}"
    return None


class LinuxDatapath:
    """Node and pod plumbing in the host network namespace.

    Args:
        host_device_name: name of the dummy device holding the router IP.
        install_iptables_rules: manage the ``CILIA_FORWARD`` chain.
        iptables: the iptables runner (its timeout is a CLI flag).

    Every method is synchronous and may be called from any thread; each call
    opens and closes its own netlink sockets.
    """

    def __init__(
        self,
        host_device_name: str,
        *,
        install_iptables_rules: bool = True,
        iptables: Iptables | None = None,
    ) -> None:
        self.host_device_name = host_device_name
        self.install_iptables_rules = install_iptables_rules
        self.iptables = iptables or Iptables()

    # --- node ------------------------------------------------------------------
    def setup_node(self, router_ip: ipaddress.IPv4Address | None) -> None:
        """Enable forwarding, install iptables rules and the host device.

        The host device gets ``router_ip``/32 when given (it is created up
        without an address otherwise). Idempotent.

        Raises:
            DatapathError: a sysctl, netlink or iptables operation failed.
        """
        try:
            if IP_FORWARD.read_text().strip() != "1":
                IP_FORWARD.write_text("1")
        except OSError as exc:
            raise DatapathError(f"cannot set net.ipv4.ip_forward=1: {exc}") from exc
        if self.install_iptables_rules:
            self.iptables.ensure_forward_rules()
        try:
            with IPRoute() as ipr:
                idx = _first(ipr, self.host_device_name)
                if idx is None:
                    idx = self._create_host_device(ipr)
                ipr.link("set", index=idx, state="up")
                peer = _first(ipr, self.host_peer_name)
                if peer is not None:
                    ipr.link("set", index=peer, state="up")
                if router_ip is not None:
                    have = {
                        (a.get("IFA_ADDRESS"), a["prefixlen"])
                        for a in ipr.addr("dump", index=idx)
                        if a["family"] == 2
                    }
                    if (str(router_ip), 32) not in have:
                        ipr.addr("add", index=idx, address=str(router_ip), prefixlen=32)
        except NetlinkError as exc:
            raise DatapathError(
                f"cannot set up host device {self.host_device_name}: {exc}"
            ) from exc

    @property
    def host_peer_name(self) -> str:
        """Peer of the host device when it is a veth pair (``cilia_host`` → ``cilia_net``)."""
        name = self.host_device_name
        if name.endswith("_host"):
            return name[: -len("_host")] + "_net"
        return name[:11] + "_net"

    def _create_host_device(self, ipr: IPRoute) -> int:
        kind = "dummy"
        try:
            ipr.link("add", ifname=self.host_device_name, kind="dummy")
        except NetlinkError as exc:
            if exc.code != 95:  # EOPNOTSUPP: this kernel has no dummy driver
                raise
            kind = "veth"
            ipr.link("add", ifname=self.host_device_name, kind="veth", peer=self.host_peer_name)
        idx = _first(ipr, self.host_device_name)
        if idx is None:
            raise DatapathError(f"host device {self.host_device_name} vanished after creation")
        log.info("created host device", extra={"device": self.host_device_name, "kind": kind})
        return idx

    # --- pods --------------------------------------------------------------------
    def plumb(self, req: PlumbRequest) -> PlumbResult:
        """Create and configure the pod's veth pair; returns names and MACs.

        Netlink requests, packed by :mod:`.rtnl` (pyroute2 cost ~0.5-1 ms of CPU apiece
        here), six round trips: in the pod's netns ``ifname`` must not exist and there
        must be no IPv4 default route (two); one RTM_NEWLINK creates the pair — the host
        end up, the peer directly in the netns under its final name (no temporary name and
        rename) — sent together with the RTM_GETLINK of the host end (its index and MAC);
        a host veth of the same key left over by a crash (EEXIST) is deleted and the pair
        created again; then the host /32 route; the peer's index and MAC in the netns; and
        in one batch the peer up, ``lo`` up, the pod address and its default route.

        On failure everything this call created is removed before raising.

        Raises:
            NetnsNotFound: ``req.netns`` does not exist or is not a netns.
            InterfaceExists: ``req.ifname`` already exists in the netns.
            DefaultRouteExists: the netns already has an IPv4 default route (e.g. our
                ``eth0`` when this is ``net1``); nothing is created.
            HostNetns: ``req.netns`` is the agent's own namespace; nothing is created.
            DatapathError: any other netlink failure.
        """
        if is_own_netns(req.netns):
            raise HostNetns(req.netns)
        host = host_ifname(req.container_id, req.ifname)
        try:
            ns = rtnl.Rtnl.open_in(req.netns)
        except OSError as exc:
            raise DatapathError(f"cannot open a netlink socket in {req.netns}: {exc}") from exc
        with ns, rtnl.Rtnl.open() as ipr:
            created = False
            try:
                if _raw_link(ns, req.ifname) is not None:
                    raise InterfaceExists(req.ifname, req.netns)
                via = _raw_default_route_dev(ns)
                if via is not None:
                    raise DefaultRouteExists(req.netns, via)
                made, got = self._add_veth_raw(ipr, host, req)
                if made.error == _EEXIST and self._delete_link_raw(ipr, host):
                    log.warning(
                        "removed stale host veth",
                        extra={"container_id": req.container_id, "host_ifname": host},
                    )
                    made, got = self._add_veth_raw(ipr, host, req)
                made.check(f"creating veth {host}")
                created = True
                if got.error or not got.messages:
                    raise DatapathError(f"veth {host} vanished after creation")
                hlink = rtnl.parse_link(got.messages[0][1])
                ipr.request(
                    rtnl.new_route(str(req.ipv4), 32, hlink.index, scope=rtnl.RT_SCOPE_LINK)
                )[0].check(f"route {req.ipv4}/32 dev {host}")
                clink = _raw_link(ns, req.ifname)
                if clink is None:
                    raise DatapathError(f"veth peer {req.ifname} not found in {req.netns}")
                for reply, what in zip(
                    ns.request(
                        rtnl.set_up(clink.index),
                        rtnl.set_up(LOOPBACK_INDEX),
                        rtnl.new_addr(clink.index, str(req.ipv4), 32),
                        rtnl.new_route(
                            "0.0.0.0", 0, clink.index, gateway=str(req.router_ip), onlink=True
                        ),
                    ),
                    ("link up", "lo up", "address", "default route"),
                    strict=True,
                ):
                    reply.check(f"{req.ifname} {what}")
                return PlumbResult(host, hlink.mac, clink.mac, hlink.index)
            except (NetlinkError, OSError) as exc:
                if created:
                    self._delete_link_raw(ipr, host)
                code = getattr(exc, "code", None) if isinstance(exc, NetlinkError) else None
                if code == _EEXIST and not created:  # ifname appeared in the netns
                    raise InterfaceExists(req.ifname, req.netns) from exc
                raise DatapathError(
                    f"plumbing {host} <-> {req.ifname} in {req.netns} failed: {exc}"
                ) from exc
            except BaseException:
                if created:
                    self._delete_link_raw(ipr, host)
                raise

    @staticmethod
    def _add_veth_raw(
        ipr: rtnl.Rtnl, host: str, req: PlumbRequest
    ) -> tuple[rtnl.Reply, rtnl.Reply]:
        """One RTM_NEWLINK: host end ``host`` (up) and its peer ``req.ifname`` created in
        ``req.netns`` (down: brought up once the host route exists), sent with the
        RTM_GETLINK of ``host``; returns both replies (unchecked).

        Raises:
            NetnsNotFound: the netns file cannot be opened.
            OSError: the socket failed.
        """
        try:
            fd = os.open(req.netns, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise NetnsNotFound(req.netns, f"cannot be opened: {exc.strerror}") from exc
        try:
            made, got = ipr.request(
                rtnl.new_veth(host, req.ifname, req.mtu, fd), rtnl.get_link(host)
            )
        finally:
            os.close(fd)
        return made, got

    @staticmethod
    def _delete_link_raw(ipr: rtnl.Rtnl, name: str) -> bool:
        """Delete link ``name`` (one RTM_DELLINK); False when it does not exist.

        Raises:
            NetlinkError: the kernel refused for another reason.
        """
        reply = ipr.request(rtnl.del_link(name))[0]
        if reply.error == _ENODEV:
            return False
        reply.check(f"deleting {name}")
        return True

    def move_router_ip(
        self, old: ipaddress.IPv4Address, new: ipaddress.IPv4Address, pods: list[tuple[str, str]]
    ) -> list[str]:
        """Move the router IP from ``old`` to ``new`` without dropping a packet: ``new``/32 is
        added to the host device, each pod's default route (``pods``: ``(netns, ifname)``)
        is replaced in place with one via ``new`` (atomic; the first packet waits for ARP,
        which the host answers since ``new`` is local), then ``old`` is removed.

        Returns one line per pod whose route could not be changed (its netns is gone, or
        it has no such interface); ``old`` stays on the host device when any failed, so
        those pods keep their gateway.

        Raises:
            DatapathError: the host device cannot be changed.
        """
        self.setup_node(new)
        problems: list[str] = []
        for netns, ifname in pods:
            try:
                with iproute_in(netns) as ns:
                    link = _get(ns, ifname)
                    if link is None:
                        problems.append(f"{netns}: no interface {ifname}")
                        continue
                    ns.route(
                        "replace",
                        dst="0.0.0.0/0",
                        gateway=str(new),
                        oif=link["index"],
                        flags=RTNH_F_ONLINK,
                    )
            except (NetlinkError, OSError, NetnsNotFound) as exc:
                problems.append(f"{netns}: {exc}")
        if problems:
            return problems
        try:
            with IPRoute() as ipr:
                idx = _first(ipr, self.host_device_name)
                if idx is not None:
                    try:
                        ipr.addr("del", index=idx, address=str(old), prefixlen=32)
                    except NetlinkError as exc:
                        if exc.code != 99:  # EADDRNOTAVAIL: already gone
                            raise
        except NetlinkError as exc:
            raise DatapathError(
                f"cannot remove the old router IP {old} from {self.host_device_name}: {exc}"
            ) from exc
        return problems

    def unplumb(self, host: str) -> bool:
        """Remove the pod's veth pair by its host side ``host`` (route goes with it).

        Deleting the host side deletes the peer inside the pod's netns too, so
        this works when the netns is already gone. Returns True when something
        was removed, False when ``host`` did not exist.

        Raises:
            DatapathError: netlink failed for a reason other than "already gone".
        """
        try:
            with rtnl.Rtnl.open() as ipr:
                return self._delete_link_raw(ipr, host)
        except (NetlinkError, OSError) as exc:
            raise DatapathError(f"cannot delete {host}: {exc}") from exc

    def link_exists(self, name: str) -> bool:
        """True when a link called ``name`` exists in the host namespace."""
        with IPRoute() as ipr:
            return _first(ipr, name) is not None

    @staticmethod
    def netns_exists(path: str) -> bool:
        """True when the netns path exists."""
        return is_netns(path)


__all__ = [
    "IFNAMSIZ",
    "LinuxDatapath",
    "NetnsNotFound",
    "PlumbRequest",
    "PlumbResult",
    "host_ifname",
]
