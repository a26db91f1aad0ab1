"""``cilia-operator delete -f FILE`` and ``delete KIND -l SELECTOR`` (issue 31) against a real
redis-server: every object at once, all or nothing, as apply writes."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
from typing import Any

import grpc
import pytest
from cluster import register, running_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc


def cnp(name: str, app: str, namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": app}},
        "spec": {"endpointSelector": {"matchLabels": {"app": app}},
                 "ingress": [{"fromEndpoints": [{"matchLabels": {"app": "client"}}]}]},
    }  # fmt: skip


POOL = {
    "apiVersion": "cilium.io/v2alpha1",
    "kind": "CiliumPodIPPool",
    "metadata": {"name": "spare"},
    "spec": {"ipv4": {"cidrs": ["10.236.0.0/24"], "maskSize": 26}},
}


def manifest(*docs: dict[str, Any]) -> str:
    return "\n---\n".join(json.dumps(d) for d in docs)


async def names(op: Any, kind: str) -> list[str]:
    return sorted(o["metadata"]["name"] for o in (await op.store.list(kind)).items)


async def test_delete_f_deletes_every_object_of_the_manifest_or_none(redis_url: str) -> None:
    docs = [cnp("a", "web"), cnp("b", "web", "prod"), cnp("c", "db"), POOL]
    async with running_operator(redis_url) as (op, channel):
        stub = pb_grpc.ResourceServiceStub(channel)
        await stub.Apply(pb.ApplyRequest(manifest=manifest(*docs)))
        # one object the manifest names is missing: nothing is deleted
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Delete(pb.DeleteRequest(manifest=manifest(*docs, cnp("gone", "x"))))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        assert "ciliumnetworkpolicy.cilium.io/gone -n default" in (missing.value.details() or "")
        assert await names(op, "CiliumNetworkPolicy") == ["a", "b", "c"]
        assert await names(op, "CiliumPodIPPool") == ["default", "spare"]
        # a pool a node holds blocks of: refused, nothing deleted
        await register(channel, "dm1")
        await pb_grpc.IPAMServiceStub(channel).UpdateDemand(pb.UpdateDemandRequest(
            node_name="dm1", demands=[pb.PoolDemand(pool="spare", needed_ipv4=5)]))  # fmt: skip
        async with asyncio.timeout(10):
            while not (await op.store.list("CiliaIPAMBlock")).items:
                await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as held:
            await stub.Delete(pb.DeleteRequest(manifest=manifest(*docs)))
        assert held.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "in use by node(s) dm1" in (held.value.details() or "")
        assert await names(op, "CiliumNetworkPolicy") == ["a", "b", "c"]
        # without the pool: all three policies go in one step
        reply = await stub.Delete(pb.DeleteRequest(manifest=manifest(*docs[:3])))
        assert [(r.kind, r.namespace, r.name, r.action) for r in reply.resources] == [
            ("CiliumNetworkPolicy", "default", "a", "deleted"),
            ("CiliumNetworkPolicy", "prod", "b", "deleted"),
            ("CiliumNetworkPolicy", "default", "c", "deleted"),
        ]
        assert await names(op, "CiliumNetworkPolicy") == []


async def test_delete_l_deletes_the_kinds_objects_whose_labels_match(redis_url: str) -> None:
    docs = [cnp("w1", "web"), cnp("w2", "web"), cnp("d1", "db"), cnp("w3", "web", "prod")]
    async with running_operator(redis_url) as (op, channel):
        stub = pb_grpc.ResourceServiceStub(channel)
        await stub.Apply(pb.ApplyRequest(manifest=manifest(*docs)))
        reply = await stub.Delete(
            pb.DeleteRequest(kind="cnp", label_selector="app=web", namespace="default")
        )
        assert sorted(r.name for r in reply.resources) == ["w1", "w2"]
        assert await names(op, "CiliumNetworkPolicy") == ["d1", "w3"]  # other namespace kept
        none = await stub.Delete(pb.DeleteRequest(kind="cnp", label_selector="app=nothing"))
        assert list(none.resources) == []
        kept = await stub.Delete(pb.DeleteRequest(kind="cnp", label_selector="app!=db,app"))
        assert list(kept.resources) == []  # d1 is db; w3 is in prod
        for bad in ("app in (web)", "=web", "!app=web"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Delete(pb.DeleteRequest(kind="cnp", label_selector=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not understood" in (err.value.details() or "")
        assert await names(op, "CiliumNetworkPolicy") == ["d1", "w3"]


async def test_cli_delete_f_and_l(redis_url: str, tmp_path: pathlib.Path) -> None:
    docs = [cnp("c1", "web"), cnp("c2", "db")]
    path = tmp_path / "policies.yaml"
    path.write_text(manifest(*docs))
    async with running_operator(redis_url) as (op, channel):
        await pb_grpc.ResourceServiceStub(channel).Apply(pb.ApplyRequest(manifest=manifest(*docs)))

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "cilia_operator", "delete", *args, "--server", op.address],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip

        by_label = await asyncio.to_thread(run, "cnp", "-l", "app=db")
        assert by_label.returncode == 0, by_label.stderr
        assert by_label.stdout == "ciliumnetworkpolicy.cilium.io/c2 deleted (namespace default)\n"
        refused = await asyncio.to_thread(run, "-f", str(path))  # c2 is gone: nothing deleted
        assert refused.returncode != 0
        assert "not found: ciliumnetworkpolicy.cilium.io/c2 -n default" in refused.stderr
        assert await names(op, "CiliumNetworkPolicy") == ["c1"]
        path.write_text(manifest(docs[0]))
        done = await asyncio.to_thread(run, "-f", str(path))
        assert done.returncode == 0, done.stderr
        assert "ciliumnetworkpolicy.cilium.io/c1 deleted" in done.stdout
        assert await names(op, "CiliumNetworkPolicy") == []
        usage = await asyncio.to_thread(run, "-l", "app=web")
        assert usage.returncode == 2 and "takes a KIND" in usage.stderr
