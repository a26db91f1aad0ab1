"""CiliumEndpointSlices kept by a running operator (``--enable-cilium-endpoint-slice``) over
real redis-server: 200 endpoints of 3 nodes upserted through EndpointService, sliced by
namespace and identity, at most ``--ces-max-ciliumendpoints-per-ces`` per slice; deletions
shrink and remove slices; the identity GC keeps an identity a slice still references."""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

from cluster import allocate, register, running_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.endpoint import slices
from cilia_operator.endpoint.slices import CoreEndpoint, Slicer

NODES = ("node-a", "node-b", "node-c")
MAX = 100


async def _slices(op: Any) -> list[dict[str, Any]]:
    return list((await op.store.list(slices.KIND)).items)


async def _settled(op: Any, predicate: Any, timeout: float = 30.0) -> list[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = await _slices(op)
        if predicate(got) or loop.time() > deadline:
            return got
        await asyncio.sleep(0.1)


def _members(items: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[str, int]]:
    out: dict[tuple[str, str], tuple[str, int]] = {}
    for ces in items:
        for ep in ces["endpoints"]:
            key = (ces["namespace"], ep["name"])
            assert key not in out, f"{key} is in two slices"
            out[key] = (ces["metadata"]["name"], ep["id"])
    return out


async def test_200_endpoints_of_3_nodes_are_sliced_by_namespace_and_identity(
    redis_url: str,
) -> None:
    async with running_operator(
        redis_url,
        enable_cilium_endpoint_slice=True,
        ces_max_ciliumendpoints_per_ces=MAX,  # and upstream's rate limit: 10/s, bursts of 20
    ) as (op, channel):
        for i, node in enumerate(NODES):
            await register(channel, node, f"192.0.2.{10 + i}")
        web = await allocate(channel, ["k8s:app=web", "k8s:io.kubernetes.pod.namespace=shop"])
        db = await allocate(channel, ["k8s:app=db", "k8s:io.kubernetes.pod.namespace=shop"])
        ops = await allocate(channel, ["k8s:app=web", "k8s:io.kubernetes.pod.namespace=ops"])
        endpoints = pb_grpc.EndpointServiceStub(channel)
        plan: list[tuple[str, str, int]] = (
            [("shop", f"web-{i}", web.identity.id) for i in range(150)]
            + [("shop", f"db-{i}", db.identity.id) for i in range(30)]
            + [("ops", f"web-{i}", ops.identity.id) for i in range(20)]
        )
        addresses = ipaddress.ip_network("10.1.0.0/16").hosts()
        for n, (namespace, name, identity) in enumerate(plan):
            await endpoints.UpsertEndpoint(
                pb.UpsertEndpointRequest(
                    endpoint=pb.EndpointRecord(
                        namespace=namespace,
                        name=name,
                        node_name=NODES[n % 3],
                        ipv4=str(next(addresses)),
                        identity=identity,
                        endpoint_id=n + 1,
                    )
                )
            )
        items = await _settled(op, lambda got: len(_members(got)) == 200)
        members = _members(items)
        assert len(members) == 200, "every endpoint is in exactly one slice"
        for ces in items:
            ids = {ep["id"] for ep in ces["endpoints"]}
            assert len(ids) == 1, f"{ces['metadata']['name']} mixes identities {ids}"
            assert len(ces["endpoints"]) <= MAX
            assert ces["metadata"]["name"].startswith("ces-")
            assert all(ep["networking"]["node"].startswith("192.0.2.") for ep in ces["endpoints"])
        # 150 web in shop -> 2 slices, 30 db -> 1, 20 web in ops -> 1
        assert sorted(len(c["endpoints"]) for c in items) == [20, 30, 50, 100]
        synced = op.metrics.registry.get_sample_value(
            "cilium_operator_ces_sync_total", {"outcome": "success"}
        )
        # a slice changed many times before its turn is written once
        assert synced is not None and 4 <= synced < 100, f"{synced} writes for 200 endpoints"
        # the pods go: the slices shrink and go, and never lose a member that stays
        for namespace, name, _ in plan[:140]:
            await endpoints.DeleteEndpoint(pb.DeleteEndpointRequest(namespace=namespace, name=name))
        items = await _settled(op, lambda got: len(_members(got)) == 60)
        assert sorted(len(c["endpoints"]) for c in items) == [10, 20, 30], [
            (c["namespace"], len(c["endpoints"])) for c in items
        ]
        assert set(_members(items)) == {(ns, name) for ns, name, _ in plan[140:]}
        for namespace, name, _ in plan[140:]:
            await endpoints.DeleteEndpoint(pb.DeleteEndpointRequest(namespace=namespace, name=name))
        assert await _settled(op, lambda got: not got) == []


async def test_the_identity_gc_keeps_an_identity_a_slice_references(redis_url: str) -> None:
    async with running_operator(redis_url, identity_heartbeat_timeout=0.0) as (op, channel):
        await register(channel, "node-a")
        kept = await allocate(channel, ["k8s:app=kept"])
        gone = await allocate(channel, ["k8s:app=gone"])
        await pb_grpc.IdentityServiceStub(channel).Release(
            pb.ReleaseRequest(node_name="node-a", id=kept.identity.id)
        )
        await pb_grpc.IdentityServiceStub(channel).Release(
            pb.ReleaseRequest(node_name="node-a", id=gone.identity.id)
        )
        slicer = Slicer(MAX, new_name=lambda: "ces-fixed")
        slicer.upsert(
            ("shop", "p"),
            ("shop", kept.identity.id),
            CoreEndpoint("p", kept.identity.id, "10.0.0.9", ""),
        )
        [(_, record)] = slicer.take_dirty()
        assert record is not None
        await op.store.create(record)
        for _ in range(2):  # mark, then delete after the (zero) heartbeat timeout
            await op.identity_gc.run_once()
        remaining = {
            int(r["metadata"]["name"]) for r in (await op.store.list("CiliumIdentity")).items
        }
        assert kept.identity.id in remaining, "referenced by a slice: alive"
        assert gone.identity.id not in remaining, "unreferenced: collected"
