"""Adopting another plugin's interface (generic-veth chaining, CNI ADD with a prevResult).

Upstream ``plugins/cilium-cni/chaining/generic-veth`` (reference: cilium-upstream.md): the
previous plugin created the veth and configured the address; the agent checks the interface
and address are there and the host-side peer is in the host netns, records the endpoint
(``chained``, no address of ours) and runs enforcement on the peer. The prevResult itself is
parsed by :mod:`cilia_agent.endpoint.chaining`.
"""

from __future__ import annotations

import asyncio

from cilia_agent.endpoint.chaining import PrevResult
from cilia_agent.endpoint.errors import EndpointConflict, InvalidRequest
from cilia_agent.endpoint.netlink import find_host_peer, inspect_interface
from cilia_agent.endpoint.params import AddParams
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.endpoint.table import EndpointTable


class ChainedAdds(EndpointTable):
    """The chained half of an Add (called by ``EndpointAdds`` under the key's lock)."""

    async def _create_chained(
        self, p: AddParams, key: tuple[str, str], prev: PrevResult
    ) -> EndpointRecord:
        """Adopt the previous plugin's interface (generic-veth chaining)."""
        iface = await self._run(inspect_interface, p.netns, p.ifname)
        if iface is None:
            raise InvalidRequest(
                "ifname",
                f"{p.ifname!r} does not exist in {p.netns}: chaining needs the previous "
                "plugin to create it",
            )
        ip = str(prev.address.ip)
        if ip not in {a.split("/", 1)[0] for a in iface.addresses}:
            raise InvalidRequest(
                "prev_result",
                f"address {prev.address} is not configured on {p.ifname} in {p.netns} "
                f"(it has {iface.addresses or 'no IPv4 address'})",
            )
        peer = await self._run(find_host_peer, iface)
        if peer is None:
            raise InvalidRequest(
                "ifname",
                f"{p.ifname} in {p.netns} is not a veth whose peer is in the host netns "
                "(generic-veth chaining)",
            )
        for other in self._endpoints.values():
            if other.host_ifname == peer.name:
                raise EndpointConflict(other.container_id, other.ifname, other.netns)
        rec = self._new_record(
            p,
            ipv4=ip,
            pool="",
            host_ifname=peer.name,
            host_mac=peer.mac,
            container_mac=iface.mac,
            chained=True,
            prev_result=p.prev_result,
        )
        wrote = False
        try:
            await self._write(rec)
            wrote = True
            self._endpoints[key] = rec
            if self.hooks is not None:
                identity = await self.hooks.create(rec, peer.ifindex, self._identity_writer(rec))
                rec = rec.model_copy(update={"identity": identity})
            rec = rec.model_copy(update={"state": "ready"})
            await self._write(rec)
            self._endpoints[key] = rec
            return rec
        except BaseException:
            # hooks.create undoes itself; the interface and address are the other plugin's
            self._endpoints.pop(key, None)
            if wrote:
                await asyncio.shield(self._remove(*key))
            raise
