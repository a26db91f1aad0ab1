"""A Kubernetes Node that goes takes its CiliumNode, its block, its routes and its ipcache
entries with it (``ipam/nodegc.py``), on the session's REAL kube-apiserver.

No kube-controller-manager runs in this test (the test kit starts one only on request), so
the API server's garbage collector never acts on the ownerReference: the operator's own Node
watch is what deletes the CiliumNode here. The test plays two agents over gRPC (Register,
UpdateDemand, Allocate, UpsertEndpoint, WatchNodes, WatchIPCache) against an in-process operator with
``--store kubernetes`` and the default release grace (30 s): the block of a node whose Node
was deleted must be free long before that.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from cluster import running_operator
from stores import kube_cilia

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.ipam.nodegc import NodeGC
from cilia_operator.store.kubernetes import KubernetesStore
from cilia_testkit.kubeapi import KubeAPI, unique_name

__all__ = ["kube_cilia"]

#: The target of issue 27: a deleted Node is gone everywhere within this many seconds.
GONE_SECONDS = 10.0
DOCKER0 = "172.17.0.1"
POD_IP = "10.251.0.5"


def _node(kube: KubeAPI, name: str, internal_ip: str) -> str:
    """Create core Node ``name`` with ``InternalIP`` ``internal_ip``; returns its uid."""
    doc = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
    kube.kubectl("create", "-f", "-", input=json.dumps(doc))
    status = {"status": {"addresses": [{"type": "InternalIP", "address": internal_ip},
                                       {"type": "Hostname", "address": name}]}}  # fmt: skip
    kube.kubectl("patch", "node", name, "--subresource=status", "--type=merge",
                 "-p", json.dumps(status))  # fmt: skip
    got = json.loads(kube.kubectl("get", "node", name, "-o", "json").stdout)
    return str(got["metadata"]["uid"])


def _cilium_node(kube: KubeAPI, name: str) -> dict[str, Any] | None:
    out = kube.kubectl("get", "ciliumnode", name, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _claimed_by(kube: KubeAPI, node: str) -> list[str]:
    out = kube.kubectl("get", "ciliaipamblocks", "-o", "json")
    return [
        str(b["metadata"]["name"])
        for b in json.loads(out.stdout)["items"]
        if json.dumps(b).find(f'"{node}"') >= 0
    ]


async def _until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


def test_a_deleted_node_loses_its_ciliumnode_block_routes_and_ipcache_entry_within_10s(
    kube_cilia: KubeAPI,
) -> None:
    kube = kube_cilia
    gone, stays = unique_name("nl-gone"), unique_name("nl-stays")
    gone_uid = _node(kube, gone, "192.0.2.21")
    _node(kube, stays, "192.0.2.22")
    # a pod the deleted node ran (its Pod object outlives the Node: no pod GC runs here)
    ns = unique_name("nl")
    kube.kubectl("create", "namespace", ns)
    kube.kubectl("create", "serviceaccount", "default", "-n", ns, check=False)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "namespace": ns},
           "spec": {"nodeName": gone,
                    "containers": [{"name": "c", "image": "registry.invalid/app:1"}]}}  # fmt: skip
    kube.kubectl("create", "-f", "-", input=json.dumps(pod))
    try:

        async def scenario() -> dict[str, float]:
            settings = {"kubeconfig": str(kube.kubeconfig), "store_watch_timeout": 5}
            async with running_operator("kubernetes", **settings) as (_op, channel):
                node = pb_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
                ipam = pb_grpc.IPAMServiceStub(channel)  # type: ignore[no-untyped-call]
                # the agent of `gone` lists docker0 first, as netlink may
                await node.Register(pb.RegisterRequest(node_name=gone,
                                                       addresses=[DOCKER0, "192.0.2.21"]))  # fmt: skip
                await node.Register(pb.RegisterRequest(node_name=stays, addresses=["192.0.2.22"]))
                await ipam.UpdateDemand(pb.UpdateDemandRequest(
                    node_name=gone, demands=[pb.PoolDemand(pool="default", needed_ipv4=8)]))  # fmt: skip
                assert await _until(lambda: bool(_claimed_by(kube, gone)), 10), "no block"
                identity = (await pb_grpc.IdentityServiceStub(channel).Allocate(  # type: ignore[no-untyped-call]
                    pb.AllocateRequest(node_name=gone, labels=["k8s:app=web"]))).identity.id  # fmt: skip
                await pb_grpc.EndpointServiceStub(channel).UpsertEndpoint(  # type: ignore[no-untyped-call]
                    pb.UpsertEndpointRequest(endpoint=pb.EndpointRecord(
                        namespace=ns, name="web", node_name=gone, ipv4=POD_IP,
                        identity=identity, labels=["k8s:app=web"], endpoint_id=1)))  # fmt: skip

                record = _cilium_node(kube, gone)
                assert record is not None
                assert record["metadata"]["ownerReferences"] == [
                    {"apiVersion": "v1", "kind": "Node", "name": gone, "uid": gone_uid}
                ]
                # the Node's InternalIP leads: peers route to it, not to docker0
                assert [a["ip"] for a in record["spec"]["addresses"]] == ["192.0.2.21", DOCKER0]

                # a peer's view: the node stream and the ipcache stream
                nodes_stream = node.WatchNodes(pb.WatchNodesRequest())
                first = await nodes_stream.read()
                listed = {e.node.name: list(e.node.addresses) for e in first.events}
                assert listed[gone][0] == "192.0.2.21"
                ipcache = pb_grpc.EndpointServiceStub(channel).WatchIPCache(  # type: ignore[no-untyped-call]
                    pb.WatchIPCacheRequest()
                )
                entries: set[str] = set()
                while True:
                    msg = await ipcache.read()
                    entries |= {e.entry.cidr for e in msg.events}
                    if msg.synced:
                        break
                assert {"192.0.2.21/32", f"{POD_IP}/32"} <= entries

                t0 = time.monotonic()
                await asyncio.to_thread(kube.kubectl, "delete", "node", gone)
                took: dict[str, float] = {}

                async def node_deleted() -> None:
                    while True:
                        msg = await nodes_stream.read()
                        if any(e.type == pb.EVENT_TYPE_DELETE and e.node.name == gone
                               for e in msg.events):  # fmt: skip
                            took["node stream"] = time.monotonic() - t0
                            return

                async def ipcache_deleted() -> None:
                    left = {"192.0.2.21/32", f"{POD_IP}/32"}  # the node's and its pod's
                    while left:
                        msg = await ipcache.read()
                        left -= {e.entry.cidr for e in msg.events
                                 if e.type == pb.EVENT_TYPE_DELETE}  # fmt: skip
                    took["ipcache"] = time.monotonic() - t0

                await asyncio.wait_for(
                    asyncio.gather(node_deleted(), ipcache_deleted()), GONE_SECONDS
                )
                assert await _until(lambda: _cilium_node(kube, gone) is None, GONE_SECONDS)
                took["ciliumnode"] = time.monotonic() - t0
                assert await _until(lambda: not _claimed_by(kube, gone), GONE_SECONDS), (
                    "the block is still claimed: held for the release grace?"
                )
                took["block"] = time.monotonic() - t0
                nodes_stream.cancel()
                ipcache.cancel()
                # the other node is untouched
                assert _cilium_node(kube, stays) is not None
                return took

        took = asyncio.run(scenario())
        assert max(took.values()) < GONE_SECONDS, took
        print("deleted Node gone in", {k: round(v, 2) for k, v in took.items()})
    finally:
        kube.kubectl("delete", "node", gone, stays, "--ignore-not-found")
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_ciliumnode_without_a_node_goes_only_on_the_second_gc_pass(kube_cilia: KubeAPI) -> None:
    kube = kube_cilia
    orphan = unique_name("nl-orphan")

    async def scenario() -> tuple[list[str], list[str], bool]:
        settings = {"kubeconfig": str(kube.kubeconfig), "store_watch_timeout": 5,
                    "nodes_gc_interval": 0}  # fmt: skip
        async with running_operator("kubernetes", **settings) as (op, channel):
            assert op.node_gc is not None
            await asyncio.wait_for(op.node_gc.listed.wait(), 10)  # its start-up pass is done
            node = pb_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
            await node.Register(pb.RegisterRequest(node_name=orphan, addresses=["192.0.2.31"]))
            first = await op.node_gc.run_once()
            kept = _cilium_node(kube, orphan) is not None
            second = await op.node_gc.run_once()
            return first, second, kept

    first, second, kept_after_first = asyncio.run(scenario())
    assert orphan not in first and kept_after_first
    assert orphan in second and _cilium_node(kube, orphan) is None


def test_an_orphan_rewritten_between_the_read_and_the_delete_still_goes_on_the_second_pass(
    kube_cilia: KubeAPI,
) -> None:
    """The IPAM controller may write an orphan's CiliumNode (its podCIDRs) between the GC's
    read and its delete: the API server then answers 409 Conflict. The GC reads it again
    instead of keeping it for another pass (a CI run once saw the second pass delete none)."""
    kube = kube_cilia
    orphan = unique_name("nl-rewritten")
    doc = {"apiVersion": "cilium.io/v2", "kind": "CiliumNode", "metadata": {"name": orphan},
           "spec": {"addresses": [{"type": "InternalIP", "ip": "192.0.2.41"}]}}  # fmt: skip
    kube.kubectl("create", "-f", "-", input=json.dumps(doc))

    class RewritesBeforeFirstDelete(KubernetesStore):
        rewrites = 0

        async def delete(self, kind: str, name: str, *args: Any, **kwargs: Any) -> Any:
            if name == orphan and not self.rewrites:
                self.rewrites += 1
                record = await self.get(kind, name)
                record["metadata"].setdefault("labels", {})["rewritten"] = "yes"
                await self.update(record)  # the resourceVersion the GC read is now stale
            return await super().delete(kind, name, *args, **kwargs)

    async def scenario() -> tuple[list[str], list[str], int]:
        store = RewritesBeforeFirstDelete(kubeconfig=str(kube.kubeconfig))
        gc = NodeGC(store, interval=0)
        gc.k8s_nodes = {}  # no Node of that name
        first = await gc.run_once()
        second = await gc.run_once()
        return first, second, store.rewrites

    try:
        first, second, rewrites = asyncio.run(scenario())
        assert rewrites == 1, "the delete was never raced"
        assert orphan not in first
        assert orphan in second and _cilium_node(kube, orphan) is None
    finally:
        kube.kubectl("delete", "ciliumnode", orphan, "--ignore-not-found")


#: Seconds kube-controller-manager's garbage collector may take: it discovers the CRDs'
#: resources (its monitors) before it acts, then follows the owner's deletion event.
KCM_GC_SECONDS = 90.0


def test_the_ownerreference_lets_kube_controller_managers_gc_delete_it_with_no_operator(
    kube_cilia: KubeAPI,
) -> None:
    kube = kube_cilia
    name = unique_name("nl-owned")
    _node(kube, name, "192.0.2.41")

    async def register() -> None:
        settings = {"kubeconfig": str(kube.kubeconfig), "store_watch_timeout": 5}
        async with running_operator("kubernetes", **settings) as (_op, channel):
            node = pb_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
            await node.Register(pb.RegisterRequest(node_name=name, addresses=["192.0.2.41"]))

    try:
        asyncio.run(register())  # the operator is gone again: only the API server acts now
        assert (_cilium_node(kube, name) or {}).get("metadata", {}).get("ownerReferences")
        kube.controller_manager()
        kube.kubectl("delete", "node", name)
        t0 = time.monotonic()
        deadline = t0 + KCM_GC_SECONDS
        while _cilium_node(kube, name) is not None:
            assert time.monotonic() < deadline, "kube-controller-manager's GC left it"
            time.sleep(0.5)
        print(f"garbage-collected by kube-controller-manager in {time.monotonic() - t0:.1f}s")
    finally:
        kube.stop_controller_manager()
        kube.kubectl("delete", "node", name, "--ignore-not-found")


def test_standalone_a_deleted_ciliumnode_takes_its_pods_ipcache_entries_at_once(
    redis_url: str,
) -> None:
    """``cilia-operator delete ciliumnodes`` (standalone node leave): the node's pods leave
    the ipcache stream at once, not at the next endpoint GC period (5 min by default)."""

    async def scenario() -> float:
        async with running_operator(redis_url) as (op, channel):
            node = pb_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
            for name, address in (("n1", "192.0.2.51"), ("n2", "192.0.2.52")):
                await node.Register(pb.RegisterRequest(node_name=name, addresses=[address]))
            identity = (await pb_grpc.IdentityServiceStub(channel).Allocate(  # type: ignore[no-untyped-call]
                pb.AllocateRequest(node_name="n2", labels=["k8s:app=web"]))).identity.id  # fmt: skip
            for pod, ip, owner in (("a", "10.251.0.7", "n1"), ("b", POD_IP, "n2")):
                await pb_grpc.EndpointServiceStub(channel).UpsertEndpoint(  # type: ignore[no-untyped-call]
                    pb.UpsertEndpointRequest(endpoint=pb.EndpointRecord(
                        namespace="default", name=pod, node_name=owner, ipv4=ip,
                        identity=identity, labels=["k8s:app=web"], endpoint_id=1)))  # fmt: skip
            ipcache = pb_grpc.EndpointServiceStub(channel).WatchIPCache(  # type: ignore[no-untyped-call]
                pb.WatchIPCacheRequest()
            )
            while not (await ipcache.read()).synced:
                pass
            t0 = time.monotonic()
            await op.store.delete("CiliumNode", "n2")
            left = {"192.0.2.52/32", f"{POD_IP}/32"}
            async with asyncio.timeout(GONE_SECONDS):
                while left:
                    msg = await ipcache.read()
                    deleted = {e.entry.cidr for e in msg.events if e.type == pb.EVENT_TYPE_DELETE}
                    assert "10.251.0.7/32" not in deleted  # n1's pod stays
                    left -= deleted
            ipcache.cancel()
            return time.monotonic() - t0

    took = asyncio.run(scenario())
    print(f"standalone node's pod left the ipcache in {took:.2f}s")
