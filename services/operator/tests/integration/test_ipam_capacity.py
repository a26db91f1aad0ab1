"""Capacity that comes back is used, capacity handed back stays back (issue 31), on both
stores: a real redis-server and the session's real kube-apiserver.

- A node refused for exhaustion waits; when a block is released, a node deleted or the pool
  extended, the waiting nodes of that pool are reconciled again, oldest first, and a
  waiting node's status says what it waits for. (Before: agents re-send demand only when it
  changes and nothing retried, so the node waited forever.)
- A node hands back its draining blocks (the pool's new CIDRs cannot meet its demand): they
  leave its record and their claims for good, with its demand unchanged, lowered or raised.
  (Before: the record was written before the claims were deleted; the reconcile between
  saw the blocks claimed but unlisted, kept them as reserved and wrote 2-4 of 4 back.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from cluster import running_operator
from stores import kube_cilia
from test_ipam_features import allocation_until, blocks, demand, register

from cilia_operator.app import Operator
from cilia_testkit.kubeapi import KubeAPI

__all__ = ["kube_cilia"]


@pytest.fixture(params=["redis", "kubernetes"])
def store_target(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    """(store, settings) of an operator on a real redis-server or a real kube-apiserver."""
    if request.param == "redis":
        return request.getfixturevalue("redis_url"), {}
    kube: KubeAPI = request.getfixturevalue("kube_cilia")
    return "kubernetes", {"kubeconfig": str(kube.kubeconfig), "store_watch_timeout": 5,
                          "nodes_gc_interval": 0}  # fmt: skip


@asynccontextmanager
async def operator(
    target: tuple[str, dict[str, Any]], pools: list[str]
) -> AsyncIterator[tuple[Operator, Any]]:
    store, settings = target
    async with running_operator(
        store, auto_create_cilium_pod_ip_pools=pools, node_cidr_release_grace_period=0,
        **settings,
    ) as running:  # fmt: skip
        yield running


async def set_pool_cidrs(op: Operator, name: str, cidrs: list[str]) -> None:
    """Change pool ``name``'s CIDRs in the store (as ``kubectl apply`` would on Kubernetes,
    where the operator's Apply is refused)."""
    pool = await op.store.get("CiliumPodIPPool", name)
    pool["spec"]["ipv4"]["cidrs"] = cidrs
    await op.store.update(pool)


async def until(check: Callable[[], Any], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


def node_error(record: dict[str, Any]) -> str:
    return str(((record.get("status") or {}).get("ipam") or {}).get("operator-status", {})
               .get("error", ""))  # fmt: skip


async def test_a_waiting_node_gets_a_released_block_before_a_later_one(
    store_target: tuple[str, dict[str, Any]],
) -> None:
    async with operator(store_target, ["w=ipv4-cidrs:10.239.0.0/25;ipv4-mask-size:26"]) as (
        op, channel,
    ):  # fmt: skip
        await register(channel, "wa")
        await demand(channel, "wa", 100, pool="w")
        held = blocks(await allocation_until(channel, "wa", lambda a: len(blocks(a)) == 2))
        await register(channel, "wc")
        await demand(channel, "wc", 10, pool="w")
        refused = await allocation_until(channel, "wc", lambda a: a.error)
        assert "pool 'w' exhausted" in refused.error
        assert "waiting" in refused.error  # what it waits for
        await register(channel, "wd")
        await demand(channel, "wd", 10, pool="w")
        await allocation_until(channel, "wd", lambda a: a.error)
        # wa hands one block back without changing anything else for wc or wd
        await demand(channel, "wa", 50, pool="w", released=[held[1]])
        # (Kubernetes: status is a subresource, written after spec: wait for both)
        got = await allocation_until(channel, "wc", lambda a: blocks(a) and not a.error)
        assert blocks(got) == [held[1]] and got.error == ""
        later = await op.store.get("CiliumNode", "wd")
        assert "exhausted" in node_error(later) and "waiting" in node_error(later)
        # wa's node record goes: its last block is free again and wd, still waiting, gets it
        await op.store.delete("CiliumNode", "wa")
        got_d = await allocation_until(channel, "wd", lambda a: blocks(a) and not a.error)
        assert blocks(got_d) == [held[0]] and got_d.error == ""


async def test_a_waiting_node_gets_a_block_of_the_extended_pool(
    store_target: tuple[str, dict[str, Any]],
) -> None:
    async with operator(store_target, ["x=ipv4-cidrs:10.238.0.0/26;ipv4-mask-size:26"]) as (
        op, channel,
    ):  # fmt: skip
        await register(channel, "xa")
        await demand(channel, "xa", 10, pool="x")
        await allocation_until(channel, "xa", lambda a: blocks(a))
        await register(channel, "xb")
        await demand(channel, "xb", 10, pool="x")
        await allocation_until(channel, "xb", lambda a: "exhausted" in a.error)
        await set_pool_cidrs(op, "x", ["10.238.0.0/26", "10.238.1.0/26"])
        got = await allocation_until(channel, "xb", lambda a: blocks(a) and not a.error)
        assert blocks(got) == ["10.238.1.0/26"] and got.error == ""


@pytest.mark.parametrize("after", [200, 50, 300], ids=["unchanged", "lowered", "raised"])
async def test_handed_back_draining_blocks_stay_back(
    store_target: tuple[str, dict[str, Any]], after: int
) -> None:
    async with operator(store_target, ["hb=ipv4-cidrs:10.237.0.0/24;ipv4-mask-size:26"]) as (
        op, channel,
    ):  # fmt: skip
        await register(channel, "h1")
        await demand(channel, "h1", 200, pool="hb")
        old = blocks(await allocation_until(channel, "h1", lambda a: len(blocks(a)) == 4))
        # the pool moves to a CIDR too small for the demand: the old blocks drain
        await set_pool_cidrs(op, "hb", ["10.237.1.0/26"])
        await allocation_until(channel, "h1", lambda a: a.draining)
        await demand(channel, "h1", after, pool="hb", released=old)

        async def settled() -> bool:
            record = await op.store.get("CiliumNode", "h1")
            allocated = [b for p in record["spec"]["ipam"]["pools"].get("allocated", [])
                         for b in p["cidrs"]]  # fmt: skip
            claimed = [c["spec"]["cidr"] for c in (await op.store.list("CiliaIPAMBlock")).items]
            pool = await op.store.get("CiliumPodIPPool", "hb")
            draining = (pool.get("status") or {}).get("drainingCIDRs")
            return not set(old) & set(allocated + claimed) and not draining

        await until(settled)
        await asyncio.sleep(1.0)  # and they do not come back
        assert await settled()
        final = await allocation_until(channel, "h1", lambda a: not a.draining)
        assert not set(old) & set(blocks(final))
        assert blocks(final) == ["10.237.1.0/26"]  # the one block the new CIDR has
        if after > 62:
            assert "exhausted" in final.error and "waiting" in final.error
        else:
            assert final.error == ""
