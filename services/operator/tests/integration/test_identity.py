"""IdentityService against a real redis-server: uniqueness under concurrency (also across
two operator replicas), restart, exhaustion, GC, and the identity watch stream."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from cluster import allocate, register, running_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.identity.allocator import IdentityAllocator
from cilia_operator.identity.labels import LabelSet
from cilia_operator.store.redis import RedisStore

WEB = ["k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"]
DB = ["k8s:app=db", "k8s:io.kubernetes.pod.namespace=default"]


async def test_concurrent_allocations_of_one_label_set_on_two_replicas_get_one_id(
    redis_url: str,
) -> None:
    async with (
        running_operator(redis_url) as (op_a, chan_a),
        running_operator(redis_url, auto_create_cilium_pod_ip_pools=[]) as (_, chan_b),
    ):
        calls = [
            allocate(chan_a if i % 2 else chan_b, list(reversed(WEB)) if i % 3 else WEB, f"n{i}")
            for i in range(20)
        ]
        replies = await asyncio.gather(*calls)
        ids = {r.identity.id for r in replies}
        assert len(ids) == 1 and ids.pop() >= 256
        assert sum(r.created for r in replies) == 1
        assert all(list(r.identity.labels) == sorted(WEB) for r in replies)
        stored = (await op_a.store.list("CiliumIdentity")).items
        assert len(stored) == 1
        assert stored[0]["security-labels"] == {
            "k8s:app": "web",
            "k8s:io.kubernetes.pod.namespace": "default",
        }
        refs = stored[0]["metadata"]["annotations"]["cilia.io/node-references"].split(",")
        assert sorted(refs) == sorted(f"n{i}" for i in range(20))


async def test_racing_allocators_never_give_two_label_sets_the_same_id(redis_url: str) -> None:
    # three "replicas" with a narrow range (many id collisions), 30 label sets x 3 calls
    stores = [RedisStore(redis_url) for _ in range(3)]
    allocators = [IdentityAllocator(s, max_id=300) for s in stores]
    sets = [LabelSet.parse([f"k8s:app=a{i}"]) for i in range(30)]
    rng = random.Random(7)
    try:
        wanted = [s for s in sets for _ in range(3)]
        rng.shuffle(wanted)
        results = await asyncio.gather(*(rng.choice(allocators).allocate("n", s) for s in wanted))
        ids: dict[LabelSet, set[int]] = {}
        for labels, (identity, _) in zip(wanted, results, strict=True):
            ids.setdefault(labels, set()).add(identity)
        assert all(len(v) == 1 for v in ids.values()), ids  # one label set -> one id
        final = {labels: v.pop() for labels, v in ids.items()}
        assert len(set(final.values())) == len(sets)  # one id -> one label set
        assert all(256 <= i <= 300 for i in final.values())
        assert sum(created for _, created in results) == len(sets)
        stored = (await stores[0].list("CiliumIdentity")).items
        assert {int(o["metadata"]["name"]) for o in stored} == set(final.values())
    finally:
        for s in stores:
            await s.close()


async def test_different_label_sets_get_different_ids_from_256_and_survive_a_restart(
    redis_url: str,
) -> None:
    async with running_operator(redis_url) as (_, channel):
        web = (await allocate(channel, WEB)).identity.id
        db = (await allocate(channel, DB)).identity.id
        assert web != db and min(web, db) >= 256
        again = await allocate(channel, WEB, "other-node")
        assert again.identity.id == web and not again.created
        reserved = await allocate(channel, ["reserved:host"])
        assert (reserved.identity.id, reserved.created) == (1, False)
    async with running_operator(redis_url) as (_, channel):
        assert (await allocate(channel, DB)).identity.id == db
        assert (await allocate(channel, WEB)).identity.id == web
        fresh = (await allocate(channel, ["k8s:app=new"])).identity.id
        assert fresh not in (web, db) and fresh >= 256


async def test_exhausted_identity_range_is_resource_exhausted(redis_url: str) -> None:
    async with running_operator(redis_url, identity_max_id=257) as (_, channel):
        assert {(await allocate(channel, [f"k8s:app={n}"])).identity.id for n in "ab"} == {
            256,
            257,
        }
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await allocate(channel, ["k8s:app=c"])
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--identity-max-id" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await allocate(channel, ["app=web"])
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_gc_deletes_released_identities_after_the_timeout_and_keeps_referenced_ones(
    redis_url: str,
) -> None:
    async with running_operator(redis_url, identity_gc_interval=0.2,
                                identity_heartbeat_timeout=0.6) as (op, channel):  # fmt: skip
        await register(channel, "n1")
        by_endpoint = (await allocate(channel, ["k8s:app=ep"], "n1")).identity.id
        by_node = (await allocate(channel, ["k8s:app=node"], "n1")).identity.id
        released = (await allocate(channel, ["k8s:app=gone"], "n1")).identity.id
        orphan = (await allocate(channel, ["k8s:app=orphan"], "unregistered")).identity.id
        await pb_grpc.EndpointServiceStub(channel).UpsertEndpoint(
            pb.UpsertEndpointRequest(endpoint=pb.EndpointRecord(
                namespace="default", name="pod", node_name="n1", ipv4="10.251.0.9",
                identity=by_endpoint, labels=["k8s:app=ep"], endpoint_id=1)))  # fmt: skip
        identities = pb_grpc.IdentityServiceStub(channel)
        for identity in (by_endpoint, released):
            await identities.Release(pb.ReleaseRequest(node_name="n1", id=identity))
        await asyncio.sleep(0.3)  # one run: the dead ones are marked, nothing deleted yet
        names = {o["metadata"]["name"] for o in (await op.store.list("CiliumIdentity")).items}
        assert names == {str(i) for i in (by_endpoint, by_node, released, orphan)}
        async with asyncio.timeout(10):
            while True:
                items = (await op.store.list("CiliumIdentity")).items
                if len(items) == 2:
                    break
                await asyncio.sleep(0.1)
        assert {o["metadata"]["name"] for o in items} == {str(by_endpoint), str(by_node)}
        assert all("io.cilium.heartbeat" not in (o["metadata"].get("annotations") or {})
                   for o in items)  # fmt: skip
        # the label set comes back: a new record under its old (free) number
        back = await allocate(channel, ["k8s:app=gone"], "n1")
        assert back.created and back.identity.id == released
        assert len((await op.store.list("CiliaIdentityKey")).items) == 4


async def test_allocate_after_gc_mark_clears_it_so_the_identity_survives(redis_url: str) -> None:
    async with running_operator(redis_url) as (op, channel):
        identity = (await allocate(channel, WEB, "n1")).identity.id
        await pb_grpc.IdentityServiceStub(channel).Release(
            pb.ReleaseRequest(node_name="n1", id=identity)
        )
        assert (await op.identity_gc.run_once()).marked == 1
        await allocate(channel, WEB, "n1")
        op.identity_gc.heartbeat_timeout = 0
        result = await op.identity_gc.run_once()
        assert result.deleted == 0 and result.alive == 0 and result.marked == 1  # n1 unregistered
        await register(channel, "n1")
        assert (await op.identity_gc.run_once()).alive == 1


async def test_watch_identities_lists_then_streams_creations_and_deletions(redis_url: str) -> None:
    async with running_operator(redis_url, watch_list_chunk_size=2) as (_, channel):
        ids = [(await allocate(channel, [f"k8s:app=w{i}"])).identity.id for i in range(3)]
        stream = pb_grpc.IdentityServiceStub(channel).WatchIdentities(pb.WatchIdentitiesRequest())
        first, second = await stream.read(), await stream.read()
        assert not first.synced and second.synced  # 3 identities in chunks of 2
        listed = {e.identity.id: list(e.identity.labels) for e in [*first.events, *second.events]}
        assert listed == {ids[i]: [f"k8s:app=w{i}"] for i in range(3)}
        new = (await allocate(channel, ["k8s:app=late"])).identity.id
        message = await asyncio.wait_for(stream.read(), 10)
        assert [(e.type, e.identity.id, list(e.identity.labels)) for e in message.events] == [
            (pb.EVENT_TYPE_UPSERT, new, ["k8s:app=late"])
        ]
        await allocate(channel, ["k8s:app=late"], "second-node")  # reference only: no event
        await pb_grpc.ResourceServiceStub(channel).Delete(
            pb.DeleteRequest(kind="ciliumid", name=str(ids[0]))
        )
        message = await asyncio.wait_for(stream.read(), 10)
        assert [(e.type, e.identity.id, list(e.identity.labels)) for e in message.events] == [
            (pb.EVENT_TYPE_DELETE, ids[0], ["k8s:app=w0"])
        ]
        stream.cancel()
