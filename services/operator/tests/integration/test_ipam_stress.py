"""IPAM under a busy cluster, for a fixed seed, against a real redis-server (issue 31).

50 simulated nodes; each step is one of: a node's demand changes, a node hands back a
block (demand kept or lowered), a pool is extended, a node record is deleted, a deleted
node joins again. Demand goes through the real ``UpdateDemand`` servicer, pool changes are
written to the store and delivered as the watch would; the controller (started without its
own worker) then does all its queued work, step by step, as the worker would. After every
step, from the store and the controller:

- no block is held twice (node records pairwise disjoint; each recorded block is the
  allocator's for that node and claimed for it in the store);
- no node waits while a block it could use is free (a node whose status says a pool is
  exhausted, or that the controller lists as waiting, sees no free block in that pool's
  live CIDRs);
- no block is both free and in a record; no claim outlives its record.

Bounded to about half a minute here; the seed makes a failure reproducible.
"""

from __future__ import annotations

import ipaddress
import itertools
import random
import time
from typing import Any

from test_ipam_properties import Context

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_operator.controlplane.ipam import IPAMServicer
from cilia_operator.ipam import claims
from cilia_operator.ipam import node as nodes
from cilia_operator.ipam.controller import IPAMController
from cilia_operator.ipam.pool import PoolSpec, pool_manifest, pool_specs
from cilia_operator.metrics import Metrics
from cilia_operator.store import WatchEvent, resource_version
from cilia_operator.store.redis import RedisStore

Net = ipaddress.IPv4Network

SEED = 31
STEPS = 1500
NODES = [f"s{i:02d}" for i in range(50)]
MASK = 27  # 30 usable addresses per block
POOLS = {"red": [Net("10.230.0.0/25")], "blue": [Net("10.231.0.0/26")]}
SPARE = {  # CIDRs the pools are extended by, in order
    "red": [Net(f"10.230.{i}.0/26") for i in range(1, 6)],
    "blue": [Net(f"10.231.{i}.0/27") for i in range(1, 6)],
}


class Cluster:
    """One controller (driven step by step) and the servicer agents talk to, on Redis."""

    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.controller = IPAMController(store, Metrics(), conflict_retries=3)
        self.ipam = IPAMServicer(store, self.controller, 3)
        self.ctx = Context()

    async def start(self) -> None:
        for name, cidrs in POOLS.items():
            await self.store.create(pool_manifest(PoolSpec(name, tuple(cidrs), MASK)))
        for name in NODES:
            await self.store.create(nodes.new_node(name))
        await self.controller.start(run=False)
        await self.controller.run_queued()

    async def records(self) -> dict[str, dict[str, Any]]:
        return {o["metadata"]["name"]: o for o in (await self.store.list("CiliumNode")).items}

    async def demand(self, name: str, pool: str, needed: int, released: list[str]) -> None:
        record = await self.records()
        if name not in record:
            return
        others = {p: n for p, n in nodes.requested(record[name]).items() if p != pool}
        demands = [pb.PoolDemand(pool=p, needed_ipv4=n) for p, n in sorted(others.items())]
        demands.append(pb.PoolDemand(pool=pool, needed_ipv4=needed))
        entries = [pb.PoolCIDRs(pool=pool, cidrs=released)] if released else []
        await self.ipam.UpdateDemand(
            pb.UpdateDemandRequest(node_name=name, demands=demands, released=entries), self.ctx
        )

    async def extend(self, pool: str, cidr: Net) -> None:
        obj = await self.store.get("CiliumPodIPPool", pool)
        obj["spec"]["ipv4"]["cidrs"].append(str(cidr))
        stored = await self.store.update(obj)
        await self.controller._on_pool(WatchEvent("MODIFIED", stored, resource_version(stored)))

    async def delete(self, name: str) -> None:
        await self.store.delete("CiliumNode", name)
        self.controller.enqueue(name)  # what the node watch does

    async def join(self, name: str) -> None:
        await self.store.create(nodes.new_node(name))
        self.controller.enqueue(name)

    async def check(self, step: int, what: str) -> None:
        where = f"step {step} ({what}, seed {SEED})"
        records = await self.records()
        specs = pool_specs((await self.store.list("CiliumPodIPPool")).items)
        stored = {c.block: c.node for c in await claims.list_claims(self.store)}
        allocator = self.controller.allocator
        recorded: list[tuple[Net, str, str]] = []
        for name, record in records.items():
            for pool, blocks in nodes.allocated(record).items():
                recorded += [(b, name, pool) for b in blocks]
        recorded.sort()
        for (a, na, _), (b, nb, _) in itertools.pairwise(recorded):
            assert not a.overlaps(b), f"{where}: {a} ({na}) overlaps {b} ({nb})"
        for block, name, _ in recorded:
            holder = allocator.holder(block)
            assert holder is not None and holder.node == name, (
                f"{where}: {block} is in {name}'s record but the allocator has it {holder}"
            )
            assert stored.get(block) == name, (
                f"{where}: {block} is in {name}'s record but claimed by {stored.get(block)}"
            )
        in_records = {b for b, _, _ in recorded}
        for block, name in stored.items():
            assert block in in_records, f"{where}: claim of {block} ({name}) outlives records"
        for pool, spec in specs.items():
            used = {b for b, _, p in recorded if p == pool}
            free = [
                b
                for cidr in spec.cidrs
                for b in cidr.subnets(new_prefix=spec.mask_size)
                if not any(b.overlaps(u) for u in used)
            ]
            said = sorted(
                n
                for n, r in records.items()
                if f"pool {pool!r} exhausted" in nodes.operator_error(r)
            )
            assert said == sorted(self.controller.waiting(pool)), (
                f"{where}: status says {said} wait on {pool}, controller "
                f"{self.controller.waiting(pool)}"
            )
            assert not (said and free), f"{where}: {said} wait on {pool} while {free} are free"


async def test_50_nodes_random_demand_releases_extensions_and_deletions(redis_url: str) -> None:
    store = RedisStore(redis_url, prefix="stress/")
    cluster = Cluster(store)
    rng = random.Random(SEED)
    spare = {pool: list(cidrs) for pool, cidrs in SPARE.items()}
    gone: list[str] = []
    counts: dict[str, int] = {}
    started = time.monotonic()
    try:
        await cluster.start()
        for step in range(STEPS):
            roll = rng.random()
            name = rng.choice(NODES)
            pool = rng.choice(sorted(POOLS))
            if roll < 0.55:
                what = "demand"
                await cluster.demand(name, pool, rng.choice([0, 5, 20, 40, 70, 100]), [])
            elif roll < 0.80:
                what = "release"
                record = (await cluster.records()).get(name)
                mine = nodes.allocated(record).get(pool, []) if record else []
                if mine:
                    kept = nodes.requested(record).get(pool, 0)
                    after = rng.choice([kept, kept // 2, 0])
                    await cluster.demand(name, pool, after, [str(rng.choice(mine))])
            elif roll < 0.87:
                what = "extend"
                if spare[pool]:
                    await cluster.extend(pool, spare[pool].pop(0))
            elif roll < 0.95:
                what = "delete"
                if name not in gone:
                    await cluster.delete(name)
                    gone.append(name)
            else:
                what = "join"
                if gone:
                    back = gone.pop(rng.randrange(len(gone)))
                    await cluster.join(back)
            counts[what] = counts.get(what, 0) + 1
            await cluster.controller.run_queued()
            await cluster.check(step, what)
        waiting = {pool: cluster.controller.waiting(pool) for pool in POOLS}
    finally:
        await cluster.controller.stop()
        await store.close()
    elapsed = time.monotonic() - started
    print(f"{STEPS} steps {counts} in {elapsed:.1f} s; waiting at the end: {waiting}")
    assert counts.get("release", 0) > 30 and counts.get("delete", 0) > 10
    assert any(waiting.values()) or not any(spare.values())  # exhaustion was reached
