"""Policies through ResourceService.Apply and PolicyService.WatchPolicies against a real
redis-server; the CLI (get/delete with namespaces) as a subprocess."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import grpc
import pytest
from cluster import allocate, register, running_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc

ALLOW = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: allow-frontend}
spec:
  endpointSelector: {matchLabels: {app: backend}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: frontend}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
"""

NETPOL = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db, namespace: prod}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress: [{from: [{podSelector: {matchLabels: {app: api}}}], ports: [{port: 5432}]}]
"""

BAD = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: bad, namespace: prod}
spec:
  endpointSelector: {}
  egress:
  - toPorts: [{ports: [{port: "53", protocol: GRE}]}]
"""


async def test_valid_policy_is_created_in_namespace_default_and_reapply_is_unchanged(
    redis_url: str,
) -> None:
    async with running_operator(redis_url) as (op, channel):
        stub = pb_grpc.ResourceServiceStub(channel)
        reply = await stub.Apply(pb.ApplyRequest(manifest=ALLOW + "---" + NETPOL))
        assert [(r.kind, r.namespace, r.name, r.action) for r in reply.resources] == [
            ("CiliumNetworkPolicy", "default", "allow-frontend", "created"),
            ("NetworkPolicy", "prod", "db", "created"),
        ]
        stored = await op.store.get("CiliumNetworkPolicy", "allow-frontend", "default")
        assert stored["metadata"]["namespace"] == "default"
        assert stored["spec"]["ingress"][0]["toPorts"] == [
            {"ports": [{"port": "8080", "protocol": "TCP"}]}
        ]
        again = await stub.Apply(pb.ApplyRequest(manifest=ALLOW))
        assert [r.action for r in again.resources] == ["unchanged"]
        changed = await stub.Apply(pb.ApplyRequest(manifest=ALLOW.replace("8080", "9090")))
        assert [r.action for r in changed.resources] == ["configured"]
        got = await stub.Get(pb.GetRequest(kind="cnp", name="allow-frontend"))
        assert "9090" in got.resource.json
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Get(pb.GetRequest(kind="cnp", name="allow-frontend", namespace="prod"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_multi_document_apply_with_one_invalid_cnp_changes_nothing(redis_url: str) -> None:
    async with running_operator(redis_url) as (op, channel):
        stub = pb_grpc.ResourceServiceStub(channel)
        before = [
            (await op.store.list(k)).resource_version
            for k in ("CiliumNetworkPolicy", "NetworkPolicy")
        ]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Apply(pb.ApplyRequest(manifest=ALLOW + "---" + NETPOL + "---" + BAD))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert "document 2 (CiliumNetworkPolicy prod/bad)" in details
        assert "spec.egress[0].toPorts[0].ports[0].protocol: 'GRE' is not one of" in details
        after = [
            (await op.store.list(k)).resource_version
            for k in ("CiliumNetworkPolicy", "NetworkPolicy")
        ]
        assert after == before
        assert not (await op.store.list("CiliumNetworkPolicy")).items
        assert not (await op.store.list("NetworkPolicy")).items
        with pytest.raises(grpc.aio.AioRpcError) as managed:
            await stub.Apply(pb.ApplyRequest(manifest=(
                "apiVersion: cilium.io/v2\nkind: CiliumIdentity\nmetadata: {name: '300'}\n")))  # fmt: skip
        assert "written by the operator" in (managed.value.details() or "")


async def test_watch_policies_lists_then_streams_upserts_and_deletes(redis_url: str) -> None:
    up, down = pb.EVENT_TYPE_UPSERT, pb.EVENT_TYPE_DELETE
    async with running_operator(redis_url) as (_, channel):
        resources = pb_grpc.ResourceServiceStub(channel)
        await resources.Apply(pb.ApplyRequest(manifest=NETPOL))
        stream = pb_grpc.PolicyServiceStub(channel).WatchPolicies(pb.WatchPoliciesRequest())
        initial = await asyncio.wait_for(stream.read(), 10)
        assert initial.synced
        assert [(e.type, e.kind, e.namespace, e.name) for e in initial.events] == [
            (up, "NetworkPolicy", "prod", "db")
        ]
        await resources.Apply(pb.ApplyRequest(manifest=ALLOW))
        message = await asyncio.wait_for(stream.read(), 10)
        [event] = message.events
        assert (event.type, event.kind, event.namespace, event.name) == (
            up, "CiliumNetworkPolicy", "default", "allow-frontend",
        )  # fmt: skip
        body = json.loads(event.json)
        assert body["spec"]["endpointSelector"] == {"matchLabels": {"app": "backend"}}
        assert body["metadata"]["namespace"] == "default" and event.resource_version
        await resources.Delete(pb.DeleteRequest(kind="cnp", name="allow-frontend"))
        message = await asyncio.wait_for(stream.read(), 10)
        assert [(e.type, e.kind, e.namespace, e.name, e.json) for e in message.events] == [
            (down, "CiliumNetworkPolicy", "default", "allow-frontend", "")
        ]
        stream.cancel()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cilia_operator", *args], capture_output=True, text=True, timeout=30
    )


async def test_cli_gets_and_deletes_policies_identities_and_endpoints(
    redis_url: str, tmp_path: Any
) -> None:
    manifest = tmp_path / "policy.yaml"
    manifest.write_text(ALLOW + "---" + ALLOW.replace("{name: allow-frontend}",
                        "{name: allow-frontend, namespace: prod}"))  # fmt: skip
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    async with running_operator(redis_url) as (op, channel):
        server = ("--server", op.address)

        async def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return await asyncio.to_thread(_cli, *args, *server)

        applied = await cli("apply", "-f", str(manifest))
        assert applied.stdout == ("ciliumnetworkpolicy.cilium.io/allow-frontend created\n" * 2), (
            applied.stderr
        )
        failed = await cli("apply", "-f", str(bad))
        assert (
            failed.returncode == 2
            and "spec.egress[0].toPorts[0].ports[0].protocol" in failed.stderr
        )
        listed = await cli("get", "cnp")
        assert [i["metadata"]["namespace"] for i in json.loads(listed.stdout)["items"]] == [
            "default"
        ]
        everywhere = await cli("get", "ciliumnetworkpolicies", "-A")
        assert len(json.loads(everywhere.stdout)["items"]) == 2
        one = await cli("get", "cnp", "allow-frontend", "-n", "prod", "-o", "yaml")
        assert "namespace: prod" in one.stdout
        deleted = await cli("delete", "cnp", "allow-frontend", "-n", "prod")
        assert deleted.stdout == "ciliumnetworkpolicy.cilium.io/allow-frontend deleted\n"
        gone = await cli("get", "cnp", "allow-frontend", "-n", "prod")
        assert gone.returncode == 2 and "NOT_FOUND" in gone.stderr

        await register(channel, "n1", "192.0.2.1")
        identity = (await allocate(channel, ["k8s:app=web"])).identity.id
        await pb_grpc.EndpointServiceStub(channel).UpsertEndpoint(
            pb.UpsertEndpointRequest(endpoint=pb.EndpointRecord(
                namespace="prod", name="web-1", node_name="n1", ipv4="10.251.0.4",
                identity=identity)))  # fmt: skip
        ids = json.loads((await cli("get", "ciliumid")).stdout)["items"]
        assert [i["metadata"]["name"] for i in ids] == [str(identity)]
        assert ids[0]["security-labels"] == {"k8s:app": "web"}
        cep = json.loads((await cli("get", "cep", "web-1", "-n", "prod")).stdout)
        assert cep["status"]["identity"]["id"] == identity
        assert (await cli("delete", "cep", "web-1", "-n", "prod")).returncode == 0
        assert (await cli("delete", "ciliumidentities", str(identity))).returncode == 0
        assert not (await op.store.list("CiliumIdentity")).items
        assert len((await op.store.list("CiliaIdentityKey")).items) == 1  # keys are kept
        assert not (await op.store.list("CiliumEndpoint")).items


CLUSTERWIDE = """
apiVersion: cilium.io/v2
kind: CiliumClusterwideNetworkPolicy
metadata: {name: backends-from-frontends}
spec:
  endpointSelector: {matchLabels: {app: backend}}
  enableDefaultDeny: {egress: false}
  ingress:
  - fromEndpoints: [{matchLabels: {app: frontend}}]
"""


async def test_a_clusterwide_policy_is_applied_without_namespace_and_streamed_with_none(
    redis_url: str,
) -> None:
    up, down = pb.EVENT_TYPE_UPSERT, pb.EVENT_TYPE_DELETE
    async with running_operator(redis_url) as (_, channel):
        resources = pb_grpc.ResourceServiceStub(channel)
        reply = await resources.Apply(pb.ApplyRequest(manifest=CLUSTERWIDE))
        assert [(r.kind, r.namespace, r.name, r.action) for r in reply.resources] == [
            ("CiliumClusterwideNetworkPolicy", "", "backends-from-frontends", "created")
        ]
        stream = pb_grpc.PolicyServiceStub(channel).WatchPolicies(pb.WatchPoliciesRequest())
        initial = await asyncio.wait_for(stream.read(), 10)
        assert [(e.type, e.kind, e.namespace, e.name) for e in initial.events] == [
            (up, "CiliumClusterwideNetworkPolicy", "", "backends-from-frontends")
        ]
        assert "namespace" not in json.loads(initial.events[0].json)["metadata"]
        # a namespace on a cluster-scoped policy is refused, nothing written
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await resources.Apply(
                pb.ApplyRequest(manifest=CLUSTERWIDE.replace("{name: b", "{namespace: x, name: b"))
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "metadata.namespace" in (refused.value.details() or "")
        await resources.Delete(pb.DeleteRequest(kind="ccnp", name="backends-from-frontends"))
        message = await asyncio.wait_for(stream.read(), 10)
        assert [(e.type, e.kind, e.namespace, e.name) for e in message.events] == [
            (down, "CiliumClusterwideNetworkPolicy", "", "backends-from-frontends")
        ]
        stream.cancel()
