"""IPAM edges against a real redis-server: single-address (/32) blocks for a non-default
pool."""

from __future__ import annotations

import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
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
