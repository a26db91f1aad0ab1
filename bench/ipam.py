"""Operator IPAM: allocation at scale and demand-to-delivery latency.

``python -m bench ipam [--nodes 5000] [--pools 10] [--store-nodes 500] [--rounds 50]``

1. **Allocation, in memory** (``cilia_operator.ipam.allocator.MultiPoolAllocator``):
   ``--nodes`` nodes across ``--pools`` pools (``10.{64+4i}.0.0/14`` each, /24 blocks, node
   ``k`` asks pool ``k mod pools`` for 300 addresses = 2 blocks). Wall time and peak
   Python memory (``tracemalloc``). Baselines measured in the same run: the same work
   for ``--nodes / 10`` nodes (the scaling ratio; linear = 10x), and a naive first-fit
   allocator (scan every block of the pool from the start, skip held ones) over the same
   pools and demands for those ``--nodes / 10`` nodes (it is quadratic). Time comes from
   an untraced run, memory from a second, traced one.
2. **Allocation through the controller and a real Redis** (claims + CiliumNode writes,
   one reconcile per node, ``--store-nodes`` nodes): per-node time.
3. **Demand-to-delivery latency** for one node: a real operator (in-process, gRPC on
   a free port) over a real ``redis-server``; the client holds ``WatchAllocations``
   open, sends ``UpdateDemand`` asking for one more block, and stops the clock when
   the stream delivers an allocation holding it; then hands the block back. ``--rounds``
   rounds, p50/p99. Baseline in the same run: an ``UpdateDemand`` that needs no new
   block (the RPC and its store write alone).

Output: a table and JSON in ``--results-dir`` (``ipam-<UTC time>.json``,
``ipam-latest.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import pathlib
import sys
import time
import tracemalloc
from typing import Any

from cilia_testkit.redis import RedisServer

ROOT = pathlib.Path(__file__).resolve().parents[1]
Net = ipaddress.IPv4Network


def pools_for(count: int) -> list[Any]:
    """``count`` pools of a /14 each (1024 blocks of /24)."""
    from cilia_operator.ipam.pool import PoolSpec

    return [PoolSpec(f"pool{i}", (Net(f"10.{64 + 4 * i}.0.0/14"),), 24) for i in range(count)]


def run_allocator(nodes: int, pools: list[Any]) -> tuple[float, int, int]:
    """Seconds (untraced run), peak bytes (a second, traced run) and blocks handed out
    for ``nodes`` nodes."""
    elapsed, handed = _allocate(nodes, pools)
    tracemalloc.start()
    _allocate(nodes, pools)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return elapsed, peak, handed


def _allocate(nodes: int, pools: list[Any]) -> tuple[float, int]:
    from cilia_operator.ipam.allocator import MultiPoolAllocator

    start = time.perf_counter()
    alloc = MultiPoolAllocator()
    for spec in pools:
        alloc.upsert_pool(spec)
    alloc.restore([])
    handed = 0
    for k in range(nodes):
        pool = pools[k % len(pools)].name
        result = alloc.reconcile(f"node-{k}", {pool: 300}, {})
        assert not result.errors, result.errors
        handed += len(result.added)
    return time.perf_counter() - start, handed


def run_naive(nodes: int, pools: list[Any]) -> float:
    """Seconds for the same work with a naive first-fit: every allocation scans the
    pool's blocks from the first (quadratic; run at the small node count)."""
    start = time.perf_counter()
    held: set[Net] = set()
    for k in range(nodes):
        spec = pools[k % len(pools)]
        have = 0
        while have < 300:
            for cidr in spec.cidrs:
                found = next((b for b in cidr.subnets(new_prefix=24) if b not in held), None)
                if found is not None:
                    held.add(found)
                    have += spec.usable(found)
                    break
            else:
                raise RuntimeError("naive allocator exhausted")
    return time.perf_counter() - start


async def run_controller(url: str, nodes: int, pools: list[Any]) -> float:
    """Seconds per node for reconcile (claims + node write) over Redis."""
    from cilia_operator.ipam import node as node_records
    from cilia_operator.ipam.controller import IPAMController
    from cilia_operator.ipam.pool import pool_manifest
    from cilia_operator.metrics import Metrics
    from cilia_operator.store.redis import RedisStore

    store = RedisStore(url, prefix="bench-ctl/")
    try:
        for spec in pools:
            await store.create(pool_manifest(spec))
        for k in range(nodes):
            record = node_records.new_node(f"node-{k}")
            pool = pools[k % len(pools)].name
            record = node_records.with_demand(record, {pool: 300}, [])
            await store.create(record)
        controller = IPAMController(store, Metrics())
        await controller.start(run=False)
        start = time.perf_counter()
        for k in range(nodes):
            await controller.reconcile(f"node-{k}")
        return (time.perf_counter() - start) / nodes
    finally:
        await store.close()


async def run_latency(url: str, rounds: int) -> tuple[list[float], list[float]]:
    """Demand-to-delivery latencies and no-new-block UpdateDemand latencies (seconds)."""
    import grpc

    from cilia.controlplane.v1 import controlplane_pb2 as pb
    from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
    from cilia_operator.app import Operator
    from cilia_operator.config import Config

    op = Operator(
        Config(
            store=url,
            listen="127.0.0.1:0",
            prometheus_serve_addr="",
            auto_create_cilium_pod_ip_pools=["default=ipv4-cidrs:10.32.0.0/16;ipv4-mask-size:24"],
            identity_gc_interval=0,
            store_key_prefix="bench-lat/",
            shutdown_grace_period=0.1,
        )
    )
    await op.start()
    channel = grpc.aio.insecure_channel(op.address)
    ipam = pb_grpc.IPAMServiceStub(channel)  # type: ignore[no-untyped-call]
    try:
        await pb_grpc.NodeServiceStub(channel).Register(  # type: ignore[no-untyped-call]
            pb.RegisterRequest(node_name="bench-node", addresses=["192.0.2.1"])
        )
        stream = ipam.WatchAllocations(pb.WatchAllocationsRequest(node_name="bench-node"))
        await stream.read()

        def held(message: Any) -> list[str]:
            return [c for p in message.allocation.pools for c in p.cidrs]

        async def until(pred: Any) -> Any:
            while True:
                message = await stream.read()
                if pred(message):
                    return message

        def demand(n: int, released: list[str]) -> Any:
            return pb.UpdateDemandRequest(
                node_name="bench-node",
                demands=[pb.PoolDemand(pool="default", needed_ipv4=n)],
                released=[pb.PoolCIDRs(pool="default", cidrs=released)] if released else [],
            )

        await ipam.UpdateDemand(demand(100, []))
        first = held(await until(lambda m: len(held(m)) == 1))
        deliver, baseline = [], []
        for i in range(rounds):
            start = time.perf_counter()
            await ipam.UpdateDemand(demand(300, []))
            message = await until(lambda m: len(held(m)) == 2)
            deliver.append(time.perf_counter() - start)
            extra = [c for c in held(message) if c not in first]
            await ipam.UpdateDemand(demand(100, extra))
            await until(lambda m: len(held(m)) == 1)
            start = time.perf_counter()
            await ipam.UpdateDemand(demand(100 + (i % 2), []))  # no new block needed
            baseline.append(time.perf_counter() - start)
        stream.cancel()
        return deliver, baseline
    finally:
        await channel.close()
        await op.stop()


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench ipam", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--nodes", type=int, default=5000, help="nodes allocated in memory (default: 5000)"
    )
    parser.add_argument("--pools", type=int, default=10, help="pools (default: 10)")
    parser.add_argument(
        "--store-nodes",
        type=int,
        default=500,
        help="nodes reconciled through the controller over Redis (default: 500)",
    )
    parser.add_argument(
        "--rounds", type=int, default=50, help="demand-to-delivery rounds (default: 50)"
    )
    parser.add_argument(
        "--results-dir",
        default=str(ROOT / "bench/results"),
        help="where the JSON goes (default: bench/results)",
    )
    args = parser.parse_args(argv)  # fmt: skip
    if args.nodes < 10 or not 1 <= args.pools <= 16:
        parser.error("--nodes must be >= 10 and --pools 1..16")
    pools = pools_for(args.pools)
    small = args.nodes // 10
    t_small, m_small, _ = run_allocator(small, pools)
    t_full, m_full, blocks = run_allocator(args.nodes, pools)
    t_naive = run_naive(small, pools)
    with RedisServer() as server:  # a private redis-server on a unix socket
        per_node = asyncio.run(run_controller(server.url, args.store_nodes, pools))
        deliver, baseline = asyncio.run(run_latency(server.url, args.rounds))
    out: dict[str, Any] = {
        "nodes": args.nodes,
        "pools": args.pools,
        "blocks_handed_out": blocks,
        "allocator_seconds": t_full,
        "allocator_peak_bytes": m_full,
        "baseline_small_nodes": small,
        "baseline_small_seconds": t_small,
        "baseline_small_peak_bytes": m_small,
        "scaling_ratio_time": t_full / t_small,
        "naive_first_fit_nodes": small,
        "naive_first_fit_seconds": t_naive,
        "speedup_vs_naive_same_nodes": t_naive / t_small,
        "controller_redis_nodes": args.store_nodes,
        "controller_redis_ms_per_node": per_node * 1000,
        "delivery_p50_ms": pct(deliver, 0.5) * 1000,
        "delivery_p99_ms": pct(deliver, 0.99) * 1000,
        "baseline_updatedemand_p50_ms": pct(baseline, 0.5) * 1000,
        "baseline_updatedemand_p99_ms": pct(baseline, 0.99) * 1000,
        "delivery_over_baseline_p50": pct(deliver, 0.5) / pct(baseline, 0.5),
        "rounds": args.rounds,
    }
    print(f"IPAM allocation: {args.nodes} nodes x 2 blocks across {args.pools} pools")
    print(
        f"  allocator            {t_full * 1000:9.1f} ms   peak {m_full / 1e6:7.2f} MB   "
        f"({blocks} blocks)"
    )
    print(
        f"  {small} nodes (base)     {t_small * 1000:9.1f} ms   peak {m_small / 1e6:7.2f} MB   "
        f"-> time x{t_full / t_small:.1f} for x10 nodes"
    )
    print(
        f"  naive first-fit      {t_naive * 1000:9.1f} ms   ({small} nodes)        "
        f"-> allocator is x{t_naive / t_small:.1f} faster on the same {small} nodes"
    )
    print(
        f"  controller + Redis   {per_node * 1000:9.2f} ms/node ({args.store_nodes} nodes: "
        "claims + CiliumNode write)"
    )
    print(f"Demand-to-delivery, one node, {args.rounds} rounds (real operator + Redis)")
    print(
        f"  UpdateDemand -> WatchAllocations  p50 {out['delivery_p50_ms']:7.2f} ms  "
        f"p99 {out['delivery_p99_ms']:7.2f} ms"
    )
    print(f"  baseline UpdateDemand (no block)  p50 {out['baseline_updatedemand_p50_ms']:7.2f} ms  "
          f"p99 {out['baseline_updatedemand_p99_ms']:7.2f} ms  -> x{out['delivery_over_baseline_p50']:.1f}")  # fmt: skip
    results = pathlib.Path(args.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    text = json.dumps(out, indent=2)
    (results / f"ipam-{stamp}.json").write_text(text)
    (results / "ipam-latest.json").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
