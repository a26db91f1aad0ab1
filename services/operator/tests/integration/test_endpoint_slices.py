"""CiliumEndpoints and CiliumEndpointSlices kept by a running operator
(``--store kubernetes --enable-cilium-endpoint-slice``) on the session's REAL kube-apiserver
(the testkit's ``kube_apiserver``: etcd + kube-apiserver, Cilia's CRDs installed).

200 Pods on 3 simulated nodes (Node and Pod objects in the API server; no kubelet runs, so the
test plays the agents: each pod's endpoint comes through ``EndpointService.UpsertEndpoint`` as
an agent's CNI ADD sends it, and a pod deleted from the API server is followed by the
agent's ``DeleteEndpoint``, as its CNI DEL does). The outcomes are read back from the API
server: one CiliumEndpoint per pod, slices grouped by namespace and identity with at most
``--ces-max-ciliumendpoints-per-ces`` members, fewer slice writes than endpoint changes
(batching); deletions shrink and remove slices; the identity GC keeps every identity an
endpoint or a slice references and deletes the others only once the heartbeat timeout has
passed since it first found them unreferenced.

These ran on redis-server before; the slicing is store-independent, so the real API server
(where the operator writes these kinds in the cluster) is the backend that is tested.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from cluster import allocate, register, running_operator
from stores import kube_cilia

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.app import Operator
from cilia_operator.endpoint.slices import CoreEndpoint, Slicer
from cilia_testkit.kubeapi import KubeAPI, unique_name

__all__ = ["kube_cilia"]  # the fixture, imported from stores

NODES = ("node-a", "node-b", "node-c")
MAX = 100
#: --identity-heartbeat-timeout of the GC test (seconds): long enough that two GC runs in a
#: row fall inside it, short enough to wait out.
HEARTBEAT = 1.5
#: Seconds the 200-pod scenario may take (about 20 s on an idle 2-core machine).
SCENARIO_SECONDS = 150.0
#: The pods deleted first (web-0 .. web-139 of the first namespace).
GONE = 140


@asynccontextmanager
async def kube_operator(kube: KubeAPI, **overrides: Any) -> AsyncIterator[tuple[Operator, Any]]:
    """An in-process operator with ``--store kubernetes`` on ``kube`` and a channel to it
    (:func:`cluster.running_operator` with the Kubernetes store)."""
    settings: dict[str, Any] = {"kubeconfig": str(kube.kubeconfig), "store_watch_timeout": 5}
    async with running_operator("kubernetes", **{**settings, **overrides}) as running:
        yield running


def _get(kube: KubeAPI, *argv: str) -> list[dict[str, Any]]:
    out = kube.kubectl("get", *argv, "-o", "json")
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


def _slices(kube: KubeAPI, namespaces: set[str]) -> list[dict[str, Any]]:
    """The API server's CiliumEndpointSlices of ``namespaces`` (other tests' are ignored)."""
    return [s for s in _get(kube, "ciliumendpointslices") if s.get("namespace") in namespaces]


async def _settled(
    kube: KubeAPI, namespaces: set[str], predicate: Any, timeout: float = 30.0
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        got = await asyncio.to_thread(_slices, kube, namespaces)
        if predicate(got) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


def _members(items: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[str, int]]:
    out: dict[tuple[str, str], tuple[str, int]] = {}
    for ces in items:
        for ep in ces["endpoints"]:
            key = (ces["namespace"], ep["name"])
            assert key not in out, f"{key} is in two slices"
            out[key] = (ces["metadata"]["name"], ep["id"])
    return out


def _pods(plan: list[tuple[str, str, int]], first_wave: int) -> str:
    """A List of the plan's Pods; the first ``first_wave`` are labelled ``wave=1``, the rest
    ``wave=2`` (deleted in two collection deletes)."""
    items = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": {"app": name.split("-")[0], "wave": str(wave)},
            },
            "spec": {
                "nodeName": NODES[n % 3],
                "containers": [{"name": "c", "image": "registry.invalid/app:1"}],
            },
        }
        for n, (ns, name, _) in enumerate(plan)
        for wave in [1 if n < first_wave else 2]
    ]
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items})


def _delete_pods(kube: KubeAPI, namespaces: list[str], selector: str) -> None:
    """Delete the selected Pods with grace period 0 (one collection delete per namespace):
    what a kubelet's confirmation does, there being none."""
    from kubernetes import client

    with kube.client() as api:
        core = client.CoreV1Api(api)
        for ns in namespaces:
            core.delete_collection_namespaced_pod(ns, label_selector=selector,
                                                  grace_period_seconds=0)  # fmt: skip
        for ns in namespaces:
            left = core.list_namespaced_pod(ns, label_selector=selector).items
            assert left == [], [p.metadata.name for p in left]


def _identities(kube: KubeAPI) -> set[int]:
    return {int(i["metadata"]["name"]) for i in _get(kube, "ciliumidentities")}


def test_200_pods_of_3_nodes_get_endpoints_sliced_by_namespace_and_identity(
    kube_cilia: KubeAPI,
) -> None:
    # a sync test on a loop of its own: the suite's async tests get 60 s (conftest), and
    # 1,000-odd real API round trips took up to 56 s on this shared 2-core machine
    asyncio.run(asyncio.wait_for(_two_hundred_pods(kube_cilia), SCENARIO_SECONDS))


async def _two_hundred_pods(kube: KubeAPI) -> None:
    shop, ops_ns = unique_name("shop"), unique_name("ops")
    namespaces = {shop, ops_ns}
    for ns in (shop, ops_ns):
        kube.kubectl("create", "namespace", ns)
        kube.kubectl("create", "serviceaccount", "default", "-n", ns, check=False)
    nodes = [{"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}} for n in NODES]
    kube.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                        "items": nodes}))  # fmt: skip
    try:
        async with kube_operator(
            kube,
            enable_cilium_endpoint_slice=True,
            ces_max_ciliumendpoints_per_ces=MAX,  # and upstream's rate limit: 10/s, bursts of 20
            identity_heartbeat_timeout=HEARTBEAT,
        ) as (op, channel):
            for i, node in enumerate(NODES):
                await register(channel, node, f"192.0.2.{10 + i}")
            web = await allocate(
                channel, ["k8s:app=web", f"k8s:io.kubernetes.pod.namespace={shop}"]
            )
            db = await allocate(channel, ["k8s:app=db", f"k8s:io.kubernetes.pod.namespace={shop}"])
            other = await allocate(channel, ["k8s:app=web",
                                             f"k8s:io.kubernetes.pod.namespace={ops_ns}"])  # fmt: skip
            ids = {web.identity.id, db.identity.id, other.identity.id}
            for identity in ids:  # only the endpoints keep them alive from here on
                await pb_grpc.IdentityServiceStub(channel).Release(
                    pb.ReleaseRequest(node_name="n1", id=identity)
                )
            plan: list[tuple[str, str, int]] = (
                [(shop, f"web-{i}", web.identity.id) for i in range(150)]
                + [(shop, f"db-{i}", db.identity.id) for i in range(30)]
                + [(ops_ns, f"web-{i}", other.identity.id) for i in range(20)]
            )
            kube.kubectl("create", "-f", "-", input=_pods(plan, GONE), timeout=120)
            endpoints = pb_grpc.EndpointServiceStub(channel)
            addresses = ipaddress.ip_network("10.1.0.0/16").hosts()
            requests = [
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
                for n, (namespace, name, identity) in enumerate(plan)
            ]
            started = time.monotonic()
            # the agents' CNI ADDs arrive together, as the pods start on every node at once
            await asyncio.gather(*(endpoints.UpsertEndpoint(r) for r in requests))
            # one CiliumEndpoint per pod, in the API server
            ceps = _get(kube, "ciliumendpoints", "-n", shop) + _get(
                kube, "ciliumendpoints", "-n", ops_ns
            )
            assert len(ceps) == 200
            assert {(c["metadata"]["namespace"], c["metadata"]["name"]) for c in ceps} == {
                (ns, name) for ns, name, _ in plan
            }
            items = await _settled(kube, namespaces, lambda got: len(_members(got)) == 200)
            members = _members(items)
            assert len(members) == 200, "every endpoint is in exactly one slice"
            for ces in items:
                assert ces["apiVersion"] == "cilium.io/v2alpha1"
                slice_ids = {ep["id"] for ep in ces["endpoints"]}
                assert len(slice_ids) == 1, f"{ces['metadata']['name']} mixes identities"
                assert len(ces["endpoints"]) <= MAX
                assert ces["metadata"]["name"].startswith("ces-")
                assert all(
                    ep["networking"]["node"].startswith("192.0.2.") for ep in ces["endpoints"]
                )
            # 150 web in shop -> 2 slices, 30 db -> 1, 20 web in ops -> 1
            assert sorted(len(c["endpoints"]) for c in items) == [20, 30, 50, 100]
            synced = op.metrics.registry.get_sample_value(
                "cilium_operator_ces_sync_total", {"outcome": "success"}
            )
            elapsed = time.monotonic() - started
            # a slice changed many times before its turn is written once, and the writes
            # keep to the rate limit (bursts of 20, then 10/s; +1 for the token in flight)
            assert synced is not None and 4 <= synced < 100, f"{synced} writes for 200 endpoints"
            assert synced <= 20 + 10 * elapsed + 1, f"{synced} writes in {elapsed:.1f} s"

            # referenced (by endpoints and slices): never collected, however long it waits
            before = await asyncio.to_thread(_identities, kube)
            assert ids <= before
            await op.identity_gc.run_once()
            await asyncio.sleep(HEARTBEAT + 0.2)
            await op.identity_gc.run_once()
            assert ids <= await asyncio.to_thread(_identities, kube)

            # the pods go (grace 0, as a kubelet confirms it), then the agents' CNI DEL:
            # the slices shrink and go, and never lose a member that stays
            gone, stay = plan[:GONE], plan[GONE:]
            await asyncio.to_thread(_delete_pods, kube, [shop], "wave=1")
            await asyncio.gather(
                *(
                    endpoints.DeleteEndpoint(pb.DeleteEndpointRequest(namespace=ns, name=name))
                    for ns, name, _ in gone
                )
            )
            items = await _settled(kube, namespaces, lambda got: len(_members(got)) == 60)
            after = _members(items)
            assert set(after) == {(ns, name) for ns, name, _ in stay}
            # no churn: every remaining endpoint is still in the slice it was in (the ADDs
            # came concurrently, so which web slice holds web-140..149 is not fixed)
            assert {k: members[k] for k in after} == after
            per_group: dict[tuple[str, int], int] = {}
            for ces in items:
                group = (ces["namespace"], ces["endpoints"][0]["id"])
                per_group[group] = per_group.get(group, 0) + len(ces["endpoints"])
            assert per_group == {
                (shop, web.identity.id): 10,
                (shop, db.identity.id): 30,
                (ops_ns, other.identity.id): 20,
            }
            await asyncio.to_thread(_delete_pods, kube, [shop, ops_ns], "wave=2")
            await asyncio.gather(
                *(
                    endpoints.DeleteEndpoint(pb.DeleteEndpointRequest(namespace=ns, name=name))
                    for ns, name, _ in stay
                )
            )
            assert await _settled(kube, namespaces, lambda got: not got) == []
            assert _get(kube, "ciliumendpoints", "-n", shop) == []
            assert _get(kube, "ciliumendpoints", "-n", ops_ns) == []

            # unreferenced now: marked by the first run, kept within the heartbeat timeout,
            # deleted by the first run after it
            await op.identity_gc.run_once()
            await op.identity_gc.run_once()
            assert ids <= await asyncio.to_thread(_identities, kube), "inside the timeout"
            await asyncio.sleep(HEARTBEAT + 0.2)
            await op.identity_gc.run_once()
            assert not ids & await asyncio.to_thread(_identities, kube)
    finally:
        for ns in (shop, ops_ns):
            kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        kube.kubectl("delete", "nodes", *NODES, check=False)


async def test_the_identity_gc_keeps_an_identity_a_slice_references(kube_cilia: KubeAPI) -> None:
    kube = kube_cilia
    async with kube_operator(kube, identity_heartbeat_timeout=0.0) as (op, channel):
        await register(channel, "node-a")
        kept = await allocate(channel, ["k8s:app=kept"])
        gone = await allocate(channel, ["k8s:app=gone"])
        for identity in (kept, gone):
            await pb_grpc.IdentityServiceStub(channel).Release(
                pb.ReleaseRequest(node_name="n1", id=identity.identity.id)
            )
        # a slice (no CiliumEndpoint behind it) is the only reference to ``kept``
        slicer = Slicer(MAX, new_name=lambda: unique_name("ces"))
        slicer.upsert(
            ("shop", "p"),
            ("shop", kept.identity.id),
            CoreEndpoint("p", kept.identity.id, "10.0.0.9", ""),
        )
        [(_, record)] = slicer.take_dirty()
        assert record is not None
        await op.store.create(record)
        assert [s["metadata"]["name"] for s in _get(kube, "ciliumendpointslices")] == [
            record["metadata"]["name"]
        ]
        for _ in range(2):  # mark, then delete after the (zero) heartbeat timeout
            await op.identity_gc.run_once()
        remaining = _identities(kube)
        assert kept.identity.id in remaining, "referenced by a slice: alive"
        assert gone.identity.id not in remaining, "unreferenced: collected"
