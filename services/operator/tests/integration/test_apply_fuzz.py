"""Property and fuzz tests of Apply over real gRPC and a real redis-server.

- Random pool layouts applied by concurrent writers: whatever the interleaving, the
  stored pools never overlap and every writer told OK has its pool stored.
- Random manifest text: Apply answers OK or INVALID_ARGUMENT, never UNKNOWN/INTERNAL.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
from typing import Any

import grpc
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_apply_atomic import pool_yaml, resource_server

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.store.redis import RedisStore

BASE = ipaddress.IPv4Network("10.70.0.0/22")
layouts = st.lists(
    st.integers(22, 26).flatmap(
        lambda plen: st.tuples(st.just(plen), st.integers(0, (1 << (plen - BASE.prefixlen)) - 1))
    ),
    min_size=2,
    max_size=8,
)


def cidr(plen: int, index: int) -> ipaddress.IPv4Network:
    return list(BASE.subnets(new_prefix=plen))[index]


async def apply_concurrently(url: str, nets: list[ipaddress.IPv4Network]) -> None:
    store = RedisStore(url)
    try:
        async with resource_server(store) as channel:
            stub = pb_grpc.ResourceServiceStub(channel)

            async def one(i: int, net: ipaddress.IPv4Network) -> bool:
                try:
                    await stub.Apply(pb.ApplyRequest(manifest=pool_yaml(f"w{i}", str(net), 26)))
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() in (
                        grpc.StatusCode.INVALID_ARGUMENT,
                        grpc.StatusCode.ABORTED,
                    ), exc.details()
                    return False
                return True

            ok = await asyncio.gather(*(one(i, n) for i, n in enumerate(nets)))
            stored = {
                o["metadata"]["name"]: ipaddress.IPv4Network(o["spec"]["ipv4"]["cidrs"][0])
                for o in (await store.list("CiliumPodIPPool")).items
            }
    finally:
        await store.close()
    assert set(stored) == {f"w{i}" for i, good in enumerate(ok) if good}
    items = list(stored.items())
    for i, (a, net_a) in enumerate(items):
        for b, net_b in items[:i]:
            assert not net_a.overlaps(net_b), (a, net_a, b, net_b)
    # a writer refused saw a pool it overlaps
    for i, good in enumerate(ok):
        if not good:
            assert any(nets[i].overlaps(n) for n in stored.values()), (nets[i], stored)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(layouts)
def test_concurrent_writers_of_random_layouts_never_store_overlapping_pools(
    redis_url: str, layout: list[tuple[int, int]]
) -> None:
    redis.Redis.from_url(redis_url).flushall()
    asyncio.run(apply_concurrently(redis_url, [cidr(p, i) for p, i in layout]))


POOL = {
    "apiVersion": "cilium.io/v2alpha1",
    "kind": "CiliumPodIPPool",
    "metadata": {"name": "f"},
    "spec": {"ipv4": {"cidrs": ["10.71.0.0/24"], "maskSize": 26}},
}
texts = st.one_of(
    st.text(max_size=300),
    st.builds(
        lambda key, value: json.dumps({**POOL, key: value}),
        st.sampled_from(["metadata", "spec", "kind", "apiVersion", "status", "x"]),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=6),
            lambda inner: (
                st.lists(inner, max_size=3)
                | st.dictionaries(st.text(max_size=5), inner, max_size=3)
            ),
            max_leaves=10,
        ),
    ),
)


async def apply_texts(url: str, manifests: list[str]) -> list[Any]:
    store = RedisStore(url)
    try:
        async with resource_server(store) as channel:
            stub = pb_grpc.ResourceServiceStub(channel)
            codes = []
            for text in manifests:
                try:
                    await stub.Apply(pb.ApplyRequest(manifest=text, dry_run=True))
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            return codes
    finally:
        await store.close()


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(texts, min_size=1, max_size=10))
def test_fuzzed_apply_answers_ok_or_invalid_argument(redis_url: str, manifests: list[str]) -> None:
    codes = asyncio.run(apply_texts(redis_url, manifests))
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, codes
