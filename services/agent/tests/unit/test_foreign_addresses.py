"""A reinstalled agent never hands out an address a running Pod holds.

``helm uninstall``'s cleanup removes the agent's state dir (endpoint records, so IPAM's
memory of addresses in use) while Pods keep running with their interfaces; the reinstalled
agent starts with an empty IPAM. In Kubernetes mode the Add path asks the Pod stream
(``PodCache.holder``: ``status.podIPs`` of this node's Pods) before using an address: one a
running Pod holds is kept under ``pod <ns>/<name>`` and another one is taken; it is freed once
that Pod no longer holds it."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import AsyncIterator
from typing import Any

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.endpoint import EndpointManager
from cilia_agent.endpoint.params import AddParams
from cilia_agent.ipam import IPAM
from cilia_agent.k8s import PodCache

POOL = "default"


def _pod(name: str, ips: list[str]) -> cp.Pod:
    return cp.Pod(namespace="shop", name=name, uid=f"uid-{name}", node_name="node-a", ips=ips)


async def _feed(cache: PodCache, *messages: cp.WatchPodsResponse) -> None:
    async def stream() -> AsyncIterator[cp.WatchPodsResponse]:
        for m in messages:
            yield m

    await cache.consume(stream())


def _manager(cache: PodCache | None) -> tuple[EndpointManager, IPAM]:
    ipam = IPAM()
    ipam.add_cidrs(POOL, ["10.9.0.0/29"])  # hosts .1 … .6
    none: Any = None
    return EndpointManager(ipam=ipam, datapath=none, store=none, metrics=none, executor=none,
                           mtu=1500, node=none, pods=cache), ipam  # fmt: skip


def _params(name: str) -> AddParams:
    return AddParams(container_id=f"c-{name}", ifname="eth0", netns="/x", pod_namespace="shop",
                     pod_name=name)  # fmt: skip


def test_addresses_of_running_pods_without_endpoints_are_skipped_then_freed() -> None:
    async def run() -> None:
        cache = PodCache("node-a", "default", wait_timeout=1.0)
        cache.set_enabled(True)
        listing = [_pod("coredns", ["10.9.0.1"]), _pod("web", ["10.9.0.2"])]
        await _feed(cache, cp.WatchPodsResponse(
            events=[cp.PodEvent(type=cp.EVENT_TYPE_UPSERT, pod=p) for p in listing], synced=True))  # fmt: skip
        m, ipam = _manager(cache)
        got = m._allocate(_params("new"), POOL, "c-new/eth0")
        assert got == ipaddress.IPv4Address("10.9.0.3")
        held = {str(a): o for a, o in ipam.allocated().items()}
        assert held == {"10.9.0.1": "pod shop/coredns", "10.9.0.2": "pod shop/web",
                        "10.9.0.3": "c-new/eth0"}  # fmt: skip
        # a Pod's own address (its sandbox recreated) is not "another Pod's"
        ipam.release(got)
        listing.append(_pod("again", ["10.9.0.4"]))
        await _feed(cache, cp.WatchPodsResponse(  # each stream is a whole new listing
            events=[cp.PodEvent(type=cp.EVENT_TYPE_UPSERT, pod=p) for p in listing], synced=True))  # fmt: skip
        assert str(m._allocate(_params("again"), POOL, "c-again/eth0")) in {"10.9.0.3", "10.9.0.4"}
        # coredns goes: its address is freed at the next allocation, web's stays held
        await _feed(cache, cp.WatchPodsResponse(events=[
            cp.PodEvent(type=cp.EVENT_TYPE_UPSERT, pod=p) for p in listing[1:]], synced=True))  # fmt: skip
        m._allocate(_params("third"), POOL, "c-third/eth0")
        owners = set(ipam.allocated().values())
        assert "pod shop/coredns" not in owners and "pod shop/web" in owners

    asyncio.run(run())


def test_standalone_mode_takes_addresses_as_before() -> None:
    m, _ = _manager(None)
    assert str(m._allocate(_params("a"), POOL, "c-a/eth0")) == "10.9.0.1"
    cache = PodCache("node-a", "default", wait_timeout=1.0)
    cache.set_enabled(False)
    m2, _ = _manager(cache)
    assert str(m2._allocate(_params("a"), POOL, "c-a/eth0")) == "10.9.0.1"
