"""WatchServices with ``--store kubernetes`` on a real kube-apiserver + kube-controller-manager:
the API server allocates the ClusterIP, kube-controller-manager keeps the EndpointSlices, the
operator only reads both and streams them joined.

No kubelet runs, so the test plays it: a Pod's IP and Ready condition are written with
``kubectl patch --subresource=status``, and kube-controller-manager's EndpointSlice
controller then puts (or, once not ready, marks) the address in the Service's slice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from cluster import POOL
from stores import kube_cilia

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.app import Operator
from cilia_operator.config import Config
from cilia_testkit import skips
from cilia_testkit.kubeapi import KubeAPI, binary_missing, unique_name

__all__ = ["kube_cilia"]  # the fixture, imported from stores


@asynccontextmanager
async def kube_operator(kube: KubeAPI) -> AsyncIterator[Any]:
    op = Operator(
        Config(
            store="kubernetes",
            kubeconfig=str(kube.kubeconfig),
            listen="127.0.0.1:0",
            prometheus_serve_addr="",
            auto_create_cilium_pod_ip_pools=[POOL],
            shutdown_grace_period=0.1,
            identity_gc_interval=0,
            store_watch_timeout=5,
        )
    )
    await op.start()
    channel = grpc.aio.insecure_channel(op.address)
    try:
        yield channel
    finally:
        await channel.close()
        await op.stop()


Backends = list[tuple[str, int, bool, bool, bool, str, str]]


def backends(service: pb.Service) -> Backends:
    return [
        (b.ip, b.port, b.ready, b.serving, b.terminating, b.node_name, b.target)
        for p in service.ports
        for b in p.backends
    ]


async def next_event(
    stream: Any, ns: str, want: Callable[[pb.ServiceEvent], bool], timeout: float = 60.0
) -> pb.ServiceEvent:
    """The first event of a Service in ``ns`` for which ``want`` holds (others skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, "the expected event did not come"
        message = await asyncio.wait_for(stream.read(), remaining)
        for event in message.events:
            if event.service.namespace == ns and want(event):
                return event


def pod(ns: str, name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": {"app": "web"}},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "image": "registry.invalid/web:1",
                            "ports": [{"name": "http", "containerPort": 8080}]}],
        },
    }  # fmt: skip


def ready_status(ip: str, ready: bool) -> str:
    flag = "True" if ready else "False"
    return json.dumps({"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": flag}, {"type": "ContainersReady",
                                                            "status": flag}],
    }})  # fmt: skip


async def test_watch_services_streams_api_server_services_with_controller_manager_slices(
    kube_cilia: KubeAPI,
) -> None:
    kube = kube_cilia
    skips.require(binary_missing("kube-controller-manager", kube.bin_dir))
    kube.controller_manager()
    ns = unique_name("svc")
    node = f"{ns}-node"
    kube.kubectl("create", "namespace", ns)
    kube.kubectl("create", "serviceaccount", "default", "-n", ns, check=False)
    node_obj = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}
    kube.kubectl("apply", "-f", "-", input=json.dumps(node_obj))
    try:
        async with kube_operator(kube) as channel:
            stream = pb_grpc.ServiceServiceStub(channel).WatchServices(
                pb.WatchServicesRequest(node_name="n1")
            )
            snapshot: dict[str, pb.Service] = {}
            while True:
                message = await asyncio.wait_for(stream.read(), 30)
                for event in message.events:
                    snapshot[f"{event.service.namespace}/{event.service.name}"] = event.service
                if message.synced:
                    break
            # the API server's own Service, from the default ServiceCIDR
            assert list(snapshot["default/kubernetes"].cluster_ips) == ["10.96.0.1"]

            service = {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": "web", "namespace": ns},
                "spec": {"selector": {"app": "web"},
                         "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
            }  # fmt: skip
            kube.kubectl("apply", "-f", "-", input=json.dumps(service))
            kube.kubectl("apply", "-f", "-", input=json.dumps(pod(ns, "web-1", node)))
            kube.kubectl("patch", "pod", "web-1", "-n", ns, "--subresource=status",
                         "--type=merge", "-p", ready_status("10.244.7.5", True))  # fmt: skip

            event = await next_event(
                stream, ns, lambda e: e.type == pb.EVENT_TYPE_UPSERT and bool(backends(e.service))
            )
            svc = event.service
            assert (svc.name, svc.type, svc.session_affinity) == ("web", "ClusterIP", "None")
            [ip] = svc.cluster_ips
            assert ip.startswith("10.96.")  # allocated by the API server
            # the named targetPort resolved by kube-controller-manager from the container port
            assert backends(svc) == [("10.244.7.5", 8080, True, True, False, node, f"{ns}/web-1")]

            # the pod no longer ready: the slice says so, and so does the stream
            kube.kubectl("patch", "pod", "web-1", "-n", ns, "--subresource=status",
                         "--type=merge", "-p", ready_status("10.244.7.5", False))  # fmt: skip
            event = await next_event(
                stream, ns, lambda e: [b[2] for b in backends(e.service)] == [False]
            )
            assert event.service.name == "web"

            # the get path reads the API server's Services and EndpointSlices
            resources = pb_grpc.ResourceServiceStub(channel)
            names = {
                json.loads(i.json)["metadata"]["name"]
                for i in (await resources.List(pb.ListRequest(kind="svc"))).items
            }
            assert {"kubernetes", "web"} <= names
            slices = [
                json.loads(i.json)
                for i in (await resources.List(pb.ListRequest(kind="endpointslices"))).items
            ]
            assert any(s["metadata"]["namespace"] == ns for s in slices)

            kube.kubectl("delete", "service", "web", "-n", ns)
            event = await next_event(stream, ns, lambda e: e.type == pb.EVENT_TYPE_DELETE)
            assert (event.service.name, len(event.service.ports)) == ("web", 0)
            stream.cancel()
    finally:
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        kube.kubectl("delete", "pod", "--all", "-n", ns, "--grace-period=0", "--force",
                     check=False)  # fmt: skip
        kube.kubectl("delete", "node", node, check=False)
        kube.stop_controller_manager()
