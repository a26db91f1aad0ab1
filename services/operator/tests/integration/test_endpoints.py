"""EndpointService against a real redis-server: CiliumEndpoint records and the ipcache
stream (endpoints and nodes, then changes; relist after the watch history is trimmed)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from cluster import register, running_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.controlplane.streams import Changed, Listed, follow
from cilia_operator.store.base import NotFound
from cilia_operator.store.redis import RedisStore


def record(name: str, ip: str, identity: int, node: str = "n1", ns: str = "") -> pb.EndpointRecord:
    return pb.EndpointRecord(
        namespace=ns, name=name, node_name=node, ipv4=ip, identity=identity,
        labels=["k8s:app=" + name], endpoint_id=len(name), container_id="cid-" + name,
    )  # fmt: skip


def entries(message: pb.WatchIPCacheResponse) -> list[tuple[Any, ...]]:
    return [
        (e.type, e.entry.cidr, e.entry.identity, e.entry.node_name, e.entry.host_ip, e.entry.owner)
        for e in message.events
    ]


async def test_ipcache_streams_nodes_and_endpoints_then_upserts_and_deletes(redis_url: str) -> None:
    up, down = pb.EVENT_TYPE_UPSERT, pb.EVENT_TYPE_DELETE
    async with running_operator(redis_url) as (op, channel):
        endpoints = pb_grpc.EndpointServiceStub(channel)
        await register(channel, "n1", "192.0.2.1")
        await endpoints.UpsertEndpoint(
            pb.UpsertEndpointRequest(endpoint=record("web", "10.251.0.5", 300))
        )
        stream = endpoints.WatchIPCache(pb.WatchIPCacheRequest())
        initial = await asyncio.wait_for(stream.read(), 10)
        assert initial.synced
        assert sorted(entries(initial)) == [
            (up, "10.251.0.5/32", 300, "n1", "192.0.2.1", "default/web"),
            (up, "192.0.2.1/32", 6, "n1", "192.0.2.1", ""),
        ]
        await register(channel, "n2", "192.0.2.2")
        assert entries(await asyncio.wait_for(stream.read(), 10)) == [
            (up, "192.0.2.2/32", 6, "n2", "192.0.2.2", "")
        ]
        await endpoints.UpsertEndpoint(
            pb.UpsertEndpointRequest(endpoint=record("db", "10.251.1.7", 301, "n2", "prod"))
        )
        assert entries(await asyncio.wait_for(stream.read(), 10)) == [
            (up, "10.251.1.7/32", 301, "n2", "192.0.2.2", "prod/db")
        ]
        # same record again: nothing is written, nothing is streamed
        before = (await op.store.list("CiliumEndpoint")).resource_version
        await endpoints.UpsertEndpoint(
            pb.UpsertEndpointRequest(endpoint=record("db", "10.251.1.7", 301, "n2", "prod"))
        )
        assert (await op.store.list("CiliumEndpoint")).resource_version == before
        # identity change of an endpoint is one upsert
        await endpoints.UpsertEndpoint(
            pb.UpsertEndpointRequest(endpoint=record("web", "10.251.0.5", 310))
        )
        assert entries(await asyncio.wait_for(stream.read(), 10)) == [
            (up, "10.251.0.5/32", 310, "n1", "192.0.2.1", "default/web")
        ]
        await endpoints.DeleteEndpoint(
            pb.DeleteEndpointRequest(namespace="prod", name="db", node_name="n2")
        )
        assert entries(await asyncio.wait_for(stream.read(), 10)) == [
            (down, "10.251.1.7/32", 301, "n2", "192.0.2.2", "prod/db")
        ]
        # deleting an absent endpoint succeeds
        await endpoints.DeleteEndpoint(pb.DeleteEndpointRequest(namespace="prod", name="db"))
        stream.cancel()


async def test_endpoint_records_are_cilium_endpoints_and_foreign_deletes_are_refused(
    redis_url: str,
) -> None:
    async with running_operator(redis_url) as (op, channel):
        endpoints = pb_grpc.EndpointServiceStub(channel)
        await register(channel, "n1", "192.0.2.1")
        await endpoints.UpsertEndpoint(
            pb.UpsertEndpointRequest(endpoint=record("web", "10.251.0.5", 300))
        )
        cep = await op.store.get("CiliumEndpoint", "web", "default")
        assert cep["apiVersion"] == "cilium.io/v2"
        assert cep["status"]["identity"] == {"id": 300, "labels": ["k8s:app=web"]}
        assert cep["status"]["networking"]["addressing"] == [{"ipv4": "10.251.0.5"}]
        assert cep["status"]["networking"]["node"] == "192.0.2.1"
        assert cep["status"]["external-identifiers"]["container-id"] == "cid-web"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await endpoints.DeleteEndpoint(pb.DeleteEndpointRequest(name="web", node_name="n9"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "belongs to node 'n1'" in (err.value.details() or "")
        # a stale DEL of an older sandbox of the same pod leaves the newer record alone
        with pytest.raises(grpc.aio.AioRpcError) as stale:
            await endpoints.DeleteEndpoint(
                pb.DeleteEndpointRequest(name="web", node_name="n1", container_id="cid-old")
            )
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "belongs to container 'cid-web'" in (stale.value.details() or "")
        assert await op.store.get("CiliumEndpoint", "web", "default")
        await endpoints.DeleteEndpoint(
            pb.DeleteEndpointRequest(name="web", node_name="n1", container_id="cid-web")
        )
        with pytest.raises(NotFound):
            await op.store.get("CiliumEndpoint", "web", "default")
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await endpoints.UpsertEndpoint(
                pb.UpsertEndpointRequest(endpoint=record("x", "10.1", 300))
            )
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ipv4" in (bad.value.details() or "")


async def test_watch_that_falls_behind_the_trimmed_history_relists(redis_url: str) -> None:
    store = RedisStore(redis_url, event_history=1, watch_block_timeout=0.2)
    writer = RedisStore(redis_url, event_history=1)
    items = follow(store, ["CiliumEndpoint"], queue_size=1)
    try:
        first = await anext(items)
        assert isinstance(first, Listed) and first.ready and first.items == []
        for i in range(5):  # the consumer does not read: the watch blocks on its queue
            await writer.create({"apiVersion": "cilium.io/v2", "kind": "CiliumEndpoint",
                                 "metadata": {"name": f"e{i}", "namespace": "default"}})  # fmt: skip
        await asyncio.sleep(0.3)
        names: set[str] = set()
        relists = 0
        async with asyncio.timeout(10):
            async for item in items:
                if isinstance(item, Listed):
                    relists += 1
                    assert item.ready
                    names = {o["metadata"]["name"] for o in item.items}
                elif isinstance(item, Changed):
                    names.add(item.event.object["metadata"]["name"])
                if relists and names == {f"e{i}" for i in range(5)}:
                    break
        assert relists >= 1
    finally:
        await items.aclose()
        await store.close()
        await writer.close()


async def test_ipcache_stream_relists_and_still_converges_with_a_tiny_history(
    redis_url: str,
) -> None:
    async with running_operator(redis_url, store_event_history=1, watch_buffer_size=1) as (
        _,
        channel,
    ):
        endpoints = pb_grpc.EndpointServiceStub(channel)
        stream = endpoints.WatchIPCache(pb.WatchIPCacheRequest())
        assert (await asyncio.wait_for(stream.read(), 10)).synced
        for i in range(20):
            await endpoints.UpsertEndpoint(
                pb.UpsertEndpointRequest(endpoint=record(f"p{i}", f"10.251.2.{i}", 300 + i))
            )
        for i in range(0, 20, 2):
            await endpoints.DeleteEndpoint(pb.DeleteEndpointRequest(name=f"p{i}"))
        state: dict[str, int] = {}
        async with asyncio.timeout(10):
            while set(state) != {f"10.251.2.{i}/32" for i in range(1, 20, 2)}:
                message = await stream.read()
                for e in message.events:
                    if e.type == pb.EVENT_TYPE_DELETE:
                        state.pop(e.entry.cidr, None)
                    else:
                        state[e.entry.cidr] = e.entry.identity
        assert state == {f"10.251.2.{i}/32": 300 + i for i in range(1, 20, 2)}
        stream.cancel()
