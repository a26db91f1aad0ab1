"""LocalNode: router IP from the first CIDR, persisted state, readiness and its observers."""

from __future__ import annotations

import asyncio
import ipaddress
import pathlib
from concurrent.futures import ThreadPoolExecutor

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.endpoint import StateStore
from cilia_agent.ipam import IPAM
from cilia_agent.node import LocalNode


def _node(tmp_path: pathlib.Path) -> tuple[LocalNode, IPAM]:
    ipam = IPAM(pending_ttl=1.0)
    store = StateStore(tmp_path)
    return LocalNode(ipam, store, ThreadPoolExecutor(1), "default", "multi-pool"), ipam


def test_ready_only_when_registered_with_a_router_and_a_free_address(
    tmp_path: pathlib.Path,
) -> None:
    async def main() -> None:
        node, ipam = _node(tmp_path)
        written: list[str] = []

        async def write() -> None:
            written.append("conflist")

        node.on_ready(write)
        node.restore({})
        await node.check_ready()
        assert node.not_ready_reason == "not registered with the operator yet"
        await node.registered(cp.RegisterResponse(default_pool="blue"))
        assert node.default_pool == "blue"
        assert node.not_ready_reason == "no CIDR allocated to this node yet"
        ipam.add_cidrs("blue", ["10.9.0.0/30"])
        await node.router_ip_changed()
        assert node.router_ip == ipaddress.IPv4Address("10.9.0.1")
        await node.check_ready()
        await node.check_ready()
        assert node.ready and node.not_ready_reason is None
        assert written == ["conflist"], "observers run once, when first ready"

    asyncio.run(main())


def test_restart_restores_router_ip_allocation_and_default_pool(tmp_path: pathlib.Path) -> None:
    async def main() -> None:
        node, _ipam = _node(tmp_path)
        node.restore({"default": ["10.8.0.0/29"]})
        await node.persist()
        first_router = node.router_ip
        again, ipam2 = _node(tmp_path)
        again.restore({})
        assert again.router_ip == first_router
        assert ipam2.cidrs() == {"default": ["10.8.0.0/29"]}
        assert again.state.registered, "a static allocation counts as registered"
        # the router IP is occupied again, by the router: never handed to a pod
        assert first_router is not None
        assert ipam2.allocated() == {first_router: "router"}

    asyncio.run(main())
