"""Every watch stream's first listing reaches a client with grpcio's default limits (4 MiB
received at most, the agent's default ``--operator-max-message-bytes``) however large the
cluster: 10,000 policies of ~5 KB, 50,000 endpoints, 20,000 Services, 5,000 nodes.

The objects are written straight into a real redis-server in one transaction (fast), then
an operator serves them to a plain ``grpc.aio`` channel with default options. Before the
streams were paged by bytes, the policy listing went out 1,000 per message (about 5.4 MB)
and the client got ``RESOURCE_EXHAUSTED … Received message larger than max``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import pytest
from cluster import running_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.config import Config
from cilia_operator.endpoint import records
from cilia_operator.store import Resource, Snapshot, Write
from cilia_operator.store.redis import RedisStore

GRPC_DEFAULT_MAX_RECEIVE = 4 * 1024 * 1024


def big_policy(i: int) -> Resource:
    """A CiliumNetworkPolicy of about 5 KB as stored JSON."""
    rules = [
        {
            "fromEndpoints": [
                {"matchLabels": {f"app.example.com/tier-{j}": f"frontend-{i}-{j}-" + "x" * 40}}
            ],
            "toPorts": [{"ports": [{"port": str(8000 + j), "protocol": "TCP"}]}],
        }
        for j in range(27)
    ]
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": f"policy-{i:05d}", "namespace": "default"},
        "spec": {"endpointSelector": {"matchLabels": {"app": f"backend-{i}"}}, "ingress": rules},
    }


def endpoint(i: int) -> Resource:
    return records.endpoint_record(
        namespace="default", name=f"pod-{i:05d}", node_name=f"node-{i % 50}",
        node_ip=f"192.0.2.{i % 50 + 1}", ipv4=f"10.{i // 65536 + 1}.{i // 256 % 256}.{i % 256}",
        identity=256 + i % 1000, labels=[f"k8s:app=app-{i % 1000}"], endpoint_id=i % 4000 + 1,
        container_id="",
    )  # fmt: skip


def service(i: int) -> Resource:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"svc-{i:05d}", "namespace": "default"},
        "spec": {
            "selector": {"app": f"app-{i}"},
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
            "clusterIP": f"10.96.{i // 256}.{i % 256}",
            "clusterIPs": [f"10.96.{i // 256}.{i % 256}"],
        },
    }


def node(i: int) -> Resource:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNode",
        "metadata": {"name": f"node-{i:05d}"},
        "spec": {
            "addresses": [{"type": "InternalIP", "ip": f"172.16.{i // 256}.{i % 256}"}],
        },
    }


async def prefill(redis_url: str, kind: str, objects: Sequence[Resource]) -> None:
    """Write ``objects`` before the operator starts, one store transaction per 10,000
    (Redis: MULTI/EXEC)."""
    store = RedisStore(redis_url)
    try:
        for start in range(0, len(objects), 10000):
            part = objects[start : start + 10000]

            async def plan(_: Snapshot, part: Sequence[Resource] = part) -> list[Write]:
                return [Write("create", o) for o in part]

            await store.transact([kind], plan)
    finally:
        await store.close()


async def first_listing(
    responses: AsyncIterator[Any], count: Callable[[Any], int]
) -> tuple[int, int, int]:
    """Read until ``synced``: (events, messages, largest message in bytes)."""
    events = messages = largest = 0
    async for response in responses:
        events += count(response)
        messages += 1
        largest = max(largest, response.ByteSize())
        if response.synced:
            return events, messages, largest
    raise AssertionError("stream ended before synced")


@pytest.mark.timeout(180)  # cluster size on a loaded 2-core machine
async def test_10000_policies_of_5kb_reach_a_client_with_default_limits(redis_url: str) -> None:
    policies = [big_policy(i) for i in range(10000)]
    assert 4500 < len(json.dumps(policies[0])) < 5500
    await prefill(redis_url, "CiliumNetworkPolicy", policies)
    async with (
        running_operator(redis_url) as (op, _),
        grpc.aio.insecure_channel(op.address) as channel,  # grpcio's defaults
    ):
        started = time.monotonic()
        stream = pb_grpc.PolicyServiceStub(channel).WatchPolicies(pb.WatchPoliciesRequest())
        events, messages, largest = await first_listing(stream, lambda r: len(r.events))
        stream.cancel()
    assert events == 10000
    assert largest <= GRPC_DEFAULT_MAX_RECEIVE
    assert messages >= 12  # ~50 MB in messages of at most 4 MiB
    print(f"10,000 policies: {messages} messages, largest {largest} B, "
          f"{time.monotonic() - started:.1f} s")  # fmt: skip


@pytest.mark.timeout(180)  # cluster size on a loaded 2-core machine
async def test_50000_endpoints_reach_a_client_with_default_limits(redis_url: str) -> None:
    started = time.monotonic()
    await prefill(redis_url, records.KIND, [endpoint(i) for i in range(50000)])
    written = time.monotonic()
    async with (
        running_operator(redis_url, enable_cilium_endpoint_slice=False) as (op, _),
        grpc.aio.insecure_channel(op.address) as channel,
    ):
        ipcache = pb_grpc.EndpointServiceStub(channel).WatchIPCache(pb.WatchIPCacheRequest())
        events, messages, largest = await first_listing(ipcache, lambda r: len(r.events))
        ipcache.cancel()
    assert events == 50000  # one /32 per endpoint, no node registered
    assert largest <= GRPC_DEFAULT_MAX_RECEIVE
    print(f"50,000 endpoints: written in {written - started:.1f} s, listed in "
          f"{time.monotonic() - written:.1f} s, {messages} messages, largest {largest} B")  # fmt: skip


@pytest.mark.timeout(180)  # cluster size on a loaded 2-core machine
async def test_20000_services_reach_a_client_with_default_limits(redis_url: str) -> None:
    started = time.monotonic()
    await prefill(redis_url, "Service", [service(i) for i in range(20000)])
    written = time.monotonic()
    async with (
        running_operator(redis_url) as (op, _),
        grpc.aio.insecure_channel(op.address) as channel,
    ):
        request = pb.WatchServicesRequest(node_name="n1")
        stream = pb_grpc.ServiceServiceStub(channel).WatchServices(request)
        events, messages, largest = await first_listing(stream, lambda r: len(r.events))
        stream.cancel()
    assert events == 20000
    assert largest <= GRPC_DEFAULT_MAX_RECEIVE
    print(f"20,000 Services: written in {written - started:.1f} s, listed in "
          f"{time.monotonic() - written:.1f} s, {messages} messages, largest {largest} B")  # fmt: skip


async def test_5000_nodes_with_small_pages_reach_the_client_in_several_messages(
    redis_url: str,
) -> None:
    """WatchNodes sent its whole listing in one message; now it is paged too (here with
    ``--watch-max-message-bytes`` at its minimum to show the bound is the flag)."""
    await prefill(redis_url, "CiliumNode", [node(i) for i in range(5000)])
    small = {"watch_max_message_bytes": 64 * 1024, "apply_max_record_bytes": 32 * 1024}
    limit = [("grpc.max_receive_message_length", 64 * 1024)]
    async with (
        running_operator(redis_url, **small) as (op, _),
        grpc.aio.insecure_channel(op.address, options=limit) as channel,
    ):
        stream = pb_grpc.NodeServiceStub(channel).WatchNodes(pb.WatchNodesRequest())
        events, messages, largest = await first_listing(stream, lambda r: len(r.events))
        stream.cancel()
    assert events == 5000
    assert messages > 1
    assert largest <= 64 * 1024


def test_pages_bound_count_and_bytes_and_keep_order() -> None:
    from cilia_operator.controlplane.streams import pages

    items = [pb.PolicyEvent(name=f"p{i}", json="x" * 1000) for i in range(100)]
    parts = pages(items, 30, 10 * 1024)
    assert [e.name for part in parts for e in part] == [e.name for e in items]
    assert all(len(p) <= 30 for p in parts)
    assert all(pb.WatchPoliciesResponse(events=p, synced=True).ByteSize() <= 10 * 1024
               for p in parts)  # fmt: skip
    assert len(parts) == 10  # 9 per page of 10 KiB
    assert pages([], 10, 1024) == [[]]


def test_watch_max_message_bytes_must_exceed_the_record_limit() -> None:
    with pytest.raises(ValueError, match="--watch-max-message-bytes 1048576: must exceed"):
        Config(watch_max_message_bytes=1024 * 1024)
