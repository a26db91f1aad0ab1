"""The CiliumEndpoint GC (``endpoint/gc.py``) of a running operator: records of a node
whose CiliumNode is gone are deleted (redis-server), and in Kubernetes mode records whose
Pod is gone (the session's real kube-apiserver); a record rewritten since the GC listed it
stays; the per-run bound holds; once its endpoints are gone, an identity is no longer kept
alive by them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from cluster import allocate, register, running_operator
from stores import kube_cilia
from test_endpoint_slices import kube_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.endpoint import records
from cilia_operator.kinds import NODE
from cilia_operator.store import Resource
from cilia_testkit.kubeapi import KubeAPI, unique_name

__all__ = ["kube_cilia"]  # the fixture, imported from stores


async def _upsert(channel: Any, ns: str, name: str, node: str, ip: str, identity: int) -> None:
    await pb_grpc.EndpointServiceStub(channel).UpsertEndpoint(
        pb.UpsertEndpointRequest(endpoint=pb.EndpointRecord(
            namespace=ns, name=name, node_name=node, ipv4=ip, identity=identity,
            labels=["k8s:app=gc"], endpoint_id=1)))  # fmt: skip


async def _names(op: Any) -> set[str]:
    return {o["metadata"]["name"] for o in (await op.store.list(records.KIND)).items}


async def test_records_of_a_departed_node_are_deleted_and_its_identity_then_dies(
    redis_url: str,
) -> None:
    async with running_operator(redis_url, cilium_endpoint_gc_max_per_run=2) as (op, channel):
        await register(channel, "n1", "192.0.2.11")
        await register(channel, "n2", "192.0.2.12")
        stays = (await allocate(channel, ["k8s:app=stays"], "n1")).identity.id
        leaves = (await allocate(channel, ["k8s:app=leaves"], "n2")).identity.id
        await pb_grpc.IdentityServiceStub(channel).Release(
            pb.ReleaseRequest(node_name="n2", id=leaves)
        )
        await _upsert(channel, "default", "a", "n1", "10.251.0.1", stays)
        for i in range(3):
            await _upsert(channel, "default", f"b{i}", "n2", f"10.251.1.{i + 1}", leaves)
        nothing = await op.endpoint_gc.run_once()
        assert (nothing.kept, nothing.node_gone, nothing.skipped) == (4, 0, 0)
        assert (await op.identity_gc.run_once()).alive == 2

        await op.store.delete(NODE.kind, "n2")  # the node left with its pods running
        first = await op.endpoint_gc.run_once()
        assert first.kept == 1 and first.node_gone <= 2, "bounded per run"
        # the leader's node watch runs a pass of its own when it sees the CiliumNode go
        # (app: on_node_deleted), beside these: a record it took first is skipped here
        for _ in range(3):
            if await _names(op) == {"a"}:
                break
            assert (await op.endpoint_gc.run_once()).node_gone <= 2, "bounded per run"
        assert await _names(op) == {"a"}
        success = op.metrics.endpoint_gc_objects.labels("success")._value.get()
        assert success == 3
        # nothing references the departed node's identity any more: the identity GC marks it
        result = await op.identity_gc.run_once()
        assert (result.alive, result.marked) == (1, 1)


async def test_a_record_rewritten_since_the_listing_is_kept(redis_url: str) -> None:
    async with running_operator(redis_url) as (op, channel):
        await register(channel, "n1")
        identity = (await allocate(channel, ["k8s:app=gc"], "n1")).identity.id
        await _upsert(channel, "default", "p", "gone-node", "10.251.0.7", identity)
        store = op.store
        listed = store.list

        async def list_then_rewrite(kind: str) -> Any:
            result = await listed(kind)
            if kind == records.KIND:  # an agent rewrites the record right after the listing
                [record] = result.items
                moved: Resource = json.loads(json.dumps(record))
                moved["status"]["networking"]["node-name"] = "n1"
                await store.update(moved)
            return result

        store.list = list_then_rewrite  # type: ignore[method-assign]
        try:
            result = await op.endpoint_gc.run_once()
        finally:
            del store.list
        assert (result.node_gone, result.skipped) == (0, 1)
        [record] = (await store.list(records.KIND)).items
        assert records.node_name_of(record) == "n1"


async def test_kubernetes_mode_deletes_records_whose_pod_is_gone(kube_cilia: KubeAPI) -> None:
    kube = kube_cilia
    ns = unique_name("gc")
    kube.kubectl("create", "namespace", ns)
    kube.kubectl("create", "serviceaccount", "default", "-n", ns, check=False)
    kube.kubectl("apply", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "gc-node"}}))  # fmt: skip
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "alive", "namespace": ns},
        "spec": {"nodeName": "gc-node",
                 "containers": [{"name": "c", "image": "registry.invalid/app:1"}]},
    }  # fmt: skip
    kube.kubectl("create", "-f", "-", input=json.dumps(pod))
    try:
        async with kube_operator(kube, cilium_endpoint_gc_interval=0.3) as (op, channel):
            await register(channel, "gc-node", "192.0.2.30")
            identity = (await allocate(channel, ["k8s:app=gc"], "gc-node")).identity.id
            await _upsert(channel, ns, "alive", "gc-node", "10.251.2.1", identity)
            await _upsert(channel, ns, "deleted", "gc-node", "10.251.2.2", identity)
            async with asyncio.timeout(20):  # the periodic runs, not run_once
                while (names := await _names(op)) != {"alive"}:
                    await asyncio.sleep(0.1)
            out = kube.kubectl("get", "ciliumendpoints", "-n", ns, "-o", "json")
            assert [o["metadata"]["name"] for o in json.loads(out.stdout)["items"]] == ["alive"]
            assert names == {"alive"}
    finally:
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        kube.kubectl("delete", "node", "gc-node", check=False)
