"""cluster-pool range changes against a real redis-server: a replaced
--cluster-pool-ipv4-cidr never gives a node a second podCIDR, its old blocks keep serving
and show as draining; special-purpose ranges are refused at start."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

import pytest
from cluster import running_operator
from test_ipam_features import allocation_until, demand, register, status

from cilia_operator.app import Operator, StartupError
from cilia_operator.config import Config

OLD = {
    "ipam": "cluster-pool",
    "cluster_pool_ipv4_cidr": ["10.252.8.0/23"],
    "cluster_pool_ipv4_mask_size": 24,
    "auto_create_cilium_pod_ip_pools": [],
}
NEW = {**OLD, "cluster_pool_ipv4_cidr": ["10.252.12.0/23"]}


async def pod_cidrs(op: Operator, name: str) -> list[str]:
    return list((await op.store.get("CiliumNode", name))["spec"]["ipam"].get("podCIDRs", []))


async def test_replaced_cluster_pool_cidr_keeps_one_pod_cidr_per_node_shown_draining(
    redis_url: str,
) -> None:
    async with running_operator(redis_url, **OLD) as (op, channel):
        for name in ("c1", "c2"):
            await register(channel, name)
        before = {n: list((await allocation_until(channel, n, lambda a: a.pod_cidrs)).pod_cidrs)
                  for n in ("c1", "c2")}  # fmt: skip
    async with running_operator(redis_url, **NEW) as (op, channel):
        await register(channel, "c3")
        c3 = await allocation_until(channel, "c3", lambda a: a.pod_cidrs)
        assert ipaddress.ip_network(c3.pod_cidrs[0]).subnet_of(
            ipaddress.ip_network("10.252.12.0/23")
        )
        for name in ("c1", "c2"):
            await register(channel, name)  # agents restart too
            await demand(channel, name, 300)  # and ask for more than one block holds
        await op.controller.drain()
        await asyncio.sleep(0.2)
        await op.controller.drain()
        for name in ("c1", "c2"):
            assert await pod_cidrs(op, name) == before[name]  # exactly one: the old one
            allocation = await allocation_until(channel, name, lambda a: a.draining)
            assert [(d.pool, list(d.cidrs)) for d in allocation.draining] == [
                ("cluster-pool", before[name])
            ]
        got = await status(channel)
        cluster = next(p for p in got.pools if p.name == "cluster-pool")
        assert list(cluster.cidrs) == ["10.252.12.0/23"]
        assert sorted(cluster.draining_cidrs) == sorted(before["c1"] + before["c2"])
        assert cluster.blocks_allocated == 1 and cluster.blocks_total == 2
        # the new range was not used up by the old nodes: one block left for a fourth node
        await register(channel, "c4")
        c4 = await allocation_until(channel, "c4", lambda a: a.pod_cidrs or a.error)
        assert len(c4.pod_cidrs) == 1 and c4.pod_cidrs[0] != c3.pod_cidrs[0], c4


@pytest.mark.parametrize(
    ("cidr", "name"),
    [
        ("127.0.0.0/16", "loopback"),
        ("169.254.0.0/16", "link-local"),
        ("224.0.0.0/16", "multicast"),
        ("0.0.0.0/16", '"this network"'),
        ("240.0.0.0/16", "reserved"),
    ],
)
async def test_special_purpose_cluster_pool_cidr_is_refused_at_start(
    redis_url: str, cidr: str, name: str
) -> None:
    for mode in ("cluster-pool", "multi-pool"):
        op = Operator(
            Config(store=redis_url, listen="127.0.0.1:0", prometheus_serve_addr="", ipam=mode,
                   cluster_pool_ipv4_cidr=[cidr], auto_create_cilium_pod_ip_pools=[])
        )  # fmt: skip
        with pytest.raises(StartupError) as info:
            await op.start()
        assert f"--cluster-pool-ipv4-cidr: {cidr} overlaps the {name} range" in str(info.value)
    nodes: Any = await _nodes(redis_url)
    assert nodes == []


async def _nodes(redis_url: str) -> list[Any]:
    from cilia_operator.store.redis import RedisStore

    store = RedisStore(redis_url)
    try:
        return (await store.list("CiliumNode")).items
    finally:
        await store.close()
