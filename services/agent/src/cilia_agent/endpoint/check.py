"""Checking an attachment (CNI CHECK): what the agent recorded against what is in the kernel.

Compares the endpoint record with the pod's interface (addresses, MAC, MTU, routes), the host
veth and the enforcement hooks' health, and reports every difference in one
:class:`~cilia_agent.endpoint.errors.CheckFailed`. IPv4 only.
"""

from __future__ import annotations

import ipaddress

from cilia_agent.endpoint.chaining import parse_prev_result
from cilia_agent.endpoint.errors import (
    AgentNotReady,
    CheckFailed,
    InvalidRequest,
    UnknownAttachment,
)
from cilia_agent.endpoint.netlink import NetnsInterface, host_link_index, inspect_interface
from cilia_agent.endpoint.params import CheckParams, Keys, Lines, shown, validate_ifname
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.endpoint.table import EndpointTable


class EndpointChecks(EndpointTable):
    """CNI CHECK of one attachment."""

    async def check(self, c: CheckParams) -> EndpointRecord:
        """Verify an attachment (CNI CHECK); returns its record when everything matches.

        Checked: the endpoint exists and is ready; its netns exists (and is the one
        given); the interface exists there and carries every expected address (the
        request's, else the record's /32), the MAC (when given) and every expected
        route (the request's, else the default route via the router; a route with an
        empty gateway matches any gateway); the host veth exists; the enforcement
        hooks report no problem (programs attached, endpoint map entry present).
        When the request lists addresses (the runtime's prevResult), the address the
        agent assigned (or the chained prevResult's) must be among them. The interface
        MTU must be the one configured at Add (not checked for chained endpoints).
        IPv6 addresses and routes in the request are not checked (IPv4 only).

        Raises:
            InvalidRequest: ``container_id``/``ifname`` invalid.
            UnknownAttachment: no endpoint for the key.
            AgentNotReady: the agent or the endpoint is not ready.
            CheckFailed: every difference found, in one message.
        """
        if not c.container_id:
            raise InvalidRequest("container_id", "must not be empty")
        validate_ifname(c.ifname)
        rec = self._endpoints.get((c.container_id, c.ifname))
        if rec is None:
            raise UnknownAttachment(c.container_id, c.ifname)
        if rec.state != "ready":
            raise AgentNotReady(f"endpoint {rec.id} is {rec.state}")
        reason = self.node.not_ready_reason
        if reason is not None and not rec.chained:
            raise AgentNotReady(reason)
        diffs: Lines = []
        if c.netns and c.netns != rec.netns:
            diffs.append(f"netns: expected {c.netns}, the endpoint is in {rec.netns}")
        iface: NetnsInterface | None = None
        if not self.datapath.netns_exists(rec.netns):
            diffs.append(f"netns {rec.netns} does not exist")
        else:
            iface = await self._run(inspect_interface, rec.netns, rec.ifname)
            if iface is None:
                diffs.append(f"interface {rec.ifname} not found in {rec.netns}")
        if iface is not None:
            diffs += self._compare(rec, c, iface)
        if not await self._run(host_link_index, rec.host_ifname):
            diffs.append(f"host veth {rec.host_ifname} does not exist")
        elif self.hooks is not None:
            diffs += await self.hooks.health(rec)
        if diffs:
            raise CheckFailed(c.container_id, c.ifname, diffs)
        return rec

    def _expected_routes(self, rec: EndpointRecord) -> Keys:
        if rec.chained:
            prev = parse_prev_result(rec.prev_result, rec.ifname)
            return [(r["dst"], r["gw"]) for r in prev.routes]
        router = self.node.router_ip
        return [("0.0.0.0/0", str(router) if router else "")]

    def _compare(self, rec: EndpointRecord, c: CheckParams, iface: NetnsInterface) -> Lines:
        diffs: Lines = []
        have = {ipaddress.ip_interface(a) for a in iface.addresses}
        expected = c.addresses or (
            [str(parse_prev_result(rec.prev_result, rec.ifname).address)]
            if rec.chained
            else [f"{rec.ipv4}/32"]
        )
        assigned = ipaddress.ip_interface(
            str(parse_prev_result(rec.prev_result, rec.ifname).address)
            if rec.chained
            else f"{rec.ipv4}/32"
        )
        wanted: set[ipaddress.IPv4Interface | ipaddress.IPv6Interface] = set()
        for text in expected:
            try:
                want = ipaddress.ip_interface(text)
            except ValueError:
                diffs.append(f"expected address {shown(text)} is not an address")
                continue
            wanted.add(want)
            if want.version == 4 and want not in have:
                diffs.append(
                    f"address {want} missing on {rec.ifname} "
                    f"(has {', '.join(sorted(iface.addresses)) or 'none'})"
                )
        if c.addresses and assigned not in wanted:
            diffs.append(
                f"address {assigned} assigned at Add is not in the request's addresses "
                f"(prevResult.ips: {', '.join(sorted(map(str, wanted))) or 'none'})"
            )
        if not rec.chained and iface.mtu and iface.mtu != rec.mtu:
            diffs.append(f"mtu: expected {rec.mtu}, {rec.ifname} has {iface.mtu}")
        if c.mac and c.mac.lower() != iface.mac:
            diffs.append(f"mac: expected {c.mac.lower()}, {rec.ifname} has {iface.mac}")
        routes = c.routes or self._expected_routes(rec)
        have_routes = [(ipaddress.ip_network(d, strict=False), g) for d, g in iface.routes]
        for dst, gw in routes:
            try:
                net = ipaddress.ip_network(dst, strict=False)
            except ValueError:
                diffs.append(f"expected route {dst!r} is not a CIDR")
                continue
            if net.version != 4:
                continue
            if not any(n == net and (not gw or g == gw) for n, g in have_routes):
                via = f" via {gw}" if gw else ""
                diffs.append(f"route {net}{via} missing in {rec.netns}")
        return diffs
