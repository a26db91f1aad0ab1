"""IPAM edges against a real redis-server: single-address (/32) blocks for a non-default
pool; node networks reported after the pool."""

from __future__ import annotations

import json

from cluster import running_operator
from test_ipam_features import allocation_until, apply, blocks, demand, pool_yaml, register


async def test_mask_32_pool_gives_four_pods_the_four_addresses_and_takes_them_back(
    redis_url: str,
) -> None:
    """A /30 carved in /32 blocks: a node asking for 4 addresses gets all four (network
    and broadcast included: no exclusion in single-address blocks); handing them back
    frees them for another node."""
    async with running_operator(redis_url) as (op, channel):
        dry = await apply(channel, pool_yaml("single", ["10.234.0.0/30"], mask=32), True)
        assert "pool single: created with 4 blocks of /32 (1 pod IP each" in dry.effects[0]
        await apply(channel, pool_yaml("single", ["10.234.0.0/30"], mask=32))
        await register(channel, "n1")
        await register(channel, "n2")
        await demand(channel, "n1", 4, pool="single")
        got = await allocation_until(channel, "n1", lambda a: len(blocks(a)) == 4)
        assert sorted(blocks(got)) == [f"10.234.0.{i}/32" for i in range(4)]
        # pods deleted: the agent requests none and hands the blocks back
        await demand(channel, "n1", 0, pool="single", released=blocks(got))
        await allocation_until(channel, "n1", lambda a: not blocks(a))
        await op.controller.drain()
        assert [c for c in (await op.store.list("CiliaIPAMBlock")).items
                if c["spec"]["pool"] == "single"] == []  # fmt: skip
        await demand(channel, "n2", 4, pool="single")
        again = await allocation_until(channel, "n2", lambda a: len(blocks(a)) == 4)
        assert sorted(blocks(again)) == sorted(blocks(got))


async def test_node_network_reported_after_the_pool_is_never_handed_out_and_reported(
    redis_url: str,
) -> None:
    """Pool blue 10.235.0.0/24 in /26 blocks exists; then node n1 reports eth1
    10.235.0.64/26. n2 asks for every block: it gets the other three, never the one
    overlapping n1's network; the conflict is on n1's status and on the pool. Once n1
    stops reporting it, the block is handed out."""
    async with running_operator(redis_url) as (op, channel):
        await apply(channel, pool_yaml("blue", ["10.235.0.0/24"], mask=26))
        await register(channel, "n1", [("eth1", "10.235.0.64/26")])
        await register(channel, "n2")
        await demand(channel, "n2", 4 * 62, pool="blue")
        got = await allocation_until(channel, "n2", lambda a: a.error)
        assert sorted(blocks(got)) == ["10.235.0.0/26", "10.235.0.128/26", "10.235.0.192/26"]
        assert "exhausted" in got.error
        await op.controller.drain()
        n1 = await op.store.get("CiliumNode", "n1")
        error = n1["status"]["ipam"]["operator-status"]["error"]
        assert (
            "interface eth1 subnet 10.235.0.64/26 overlaps pool 'blue' CIDR 10.235.0.0/24" in error
        )
        pool = await op.store.get("CiliumPodIPPool", "blue")
        assert pool["status"]["nodeNetworkConflicts"] == [
            "node 'n1' interface eth1 subnet 10.235.0.64/26 overlaps CIDR 10.235.0.0/24: "
            "no block overlapping it is handed out"
        ]
        await register(channel, "n1", [])  # the network is gone: resolved
        done = await allocation_until(channel, "n2", lambda a: len(blocks(a)) == 4)
        assert "10.235.0.64/26" in blocks(done) and not done.error
        await op.controller.drain()
        pool = await op.store.get("CiliumPodIPPool", "blue")
        assert "nodeNetworkConflicts" not in (pool.get("status") or {})


async def test_an_overlapping_pool_that_got_past_apply_is_marked_and_never_allocated_from(
    redis_url: str,
) -> None:
    """Pools written straight to the store (as a Kubernetes API server without a webhook
    would accept them): the later of two overlapping pools is refused by the controller,
    its status says why, no node gets a block from it; once the older one is deleted it
    is used."""
    async with running_operator(redis_url) as (op, channel):
        await apply(channel, pool_yaml("older", ["10.236.0.0/24"], mask=26))
        newer = json.loads(json.dumps(POOL_DOC))
        await op.store.create(newer)  # 10.236.0.128/25: overlaps "older"
        await register(channel, "n1")
        await demand(channel, "n1", 10, pool="newer")
        got = await allocation_until(channel, "n1", lambda a: a.error)
        assert not blocks(got)
        assert (
            "pool 'newer' not allocated from: spec.ipv4.cidrs[0]: 10.236.0.128/25 overlaps"
            in got.error
        )
        await op.controller.drain()
        stored = await op.store.get("CiliumPodIPPool", "newer")
        assert stored["status"]["conflict"] == (
            "spec.ipv4.cidrs[0]: 10.236.0.128/25 overlaps pool 'older' CIDR 10.236.0.0/24"
        )
        await op.store.delete("CiliumPodIPPool", "older")
        done = await allocation_until(channel, "n1", lambda a: blocks(a))
        assert blocks(done) == ["10.236.0.128/26"]
        await op.controller.drain()
        assert "conflict" not in (
            (await op.store.get("CiliumPodIPPool", "newer")).get("status") or {}
        )


POOL_DOC = {
    "apiVersion": "cilium.io/v2alpha1",
    "kind": "CiliumPodIPPool",
    "metadata": {"name": "newer"},
    "spec": {"ipv4": {"cidrs": ["10.236.0.128/25"], "maskSize": 26}},
}
