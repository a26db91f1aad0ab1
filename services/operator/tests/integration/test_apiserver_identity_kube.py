"""The API server's addresses in the ipcache stream with ``--store kubernetes`` on a real
kube-apiserver: the ready addresses of the EndpointSlices of ``default/kubernetes`` come out
of ``WatchIPCache`` with the reserved identity 7 (``kube-apiserver``), a not-ready one does
not; a second slice (another API server, off the cluster) adds its address with identity 7
once written, and deleting it deletes the entry.

The test kit's kube-apiserver runs with ``--endpoint-reconciler-type=none`` (it advertises
127.0.0.1, which an EndpointSlice cannot hold), so the test plays the reconciler and writes
the ``kubernetes`` slice as kube-apiserver does (same name, same label).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc
from cluster import POOL
from stores import kube_cilia

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.app import Operator
from cilia_operator.config import Config
from cilia_testkit.kubeapi import KubeAPI, unique_name

__all__ = ["kube_cilia"]

KUBE_APISERVER = 7
OFF_CLUSTER = "203.0.113.9"
READY, NOT_READY = "198.51.100.10", "198.51.100.11"


def apiserver_slice(name: str, *endpoints: tuple[str, bool]) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}}
                      for ip, ready in endpoints],
        "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}],
    }  # fmt: skip


@asynccontextmanager
async def kube_operator(kube: KubeAPI) -> AsyncIterator[Any]:
    op = Operator(
        Config(
            store="kubernetes", kubeconfig=str(kube.kubeconfig), listen="127.0.0.1:0",
            prometheus_serve_addr="", auto_create_cilium_pod_ip_pools=[POOL],
            shutdown_grace_period=0.1, identity_gc_interval=0, store_watch_timeout=5,
        )
    )  # fmt: skip
    await op.start()
    channel = grpc.aio.insecure_channel(op.address)
    try:
        yield channel
    finally:
        await channel.close()
        await op.stop()


async def wait_for(stream: Any, cidr: str, want: int | None, timeout: float = 30.0) -> None:
    """Read until ``cidr`` is upserted with identity ``want`` (None: deleted)."""
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"{cidr} never became {want}"
        message = await asyncio.wait_for(stream.read(), remaining)
        for event in message.events:
            if event.entry.cidr != cidr:
                continue
            if want is None and event.type == pb.EVENT_TYPE_DELETE:
                return
            if want is not None and event.type == pb.EVENT_TYPE_UPSERT:
                assert event.entry.identity == want
                return


async def test_watch_ipcache_gives_the_api_servers_addresses_the_kube_apiserver_identity(
    kube_cilia: KubeAPI,
) -> None:
    kube = kube_cilia
    extra = unique_name("kubernetes-offcluster")
    own = apiserver_slice("kubernetes", (READY, True), (NOT_READY, False))
    kube.kubectl("apply", "-f", "-", input=json.dumps(own))
    try:
        async with kube_operator(kube) as channel:
            stream = pb_grpc.EndpointServiceStub(channel).WatchIPCache(  # type: ignore[no-untyped-call]
                pb.WatchIPCacheRequest()
            )
            listed: dict[str, pb.IPCacheEntry] = {}
            while True:
                message = await asyncio.wait_for(stream.read(), 30)
                for event in message.events:
                    listed[event.entry.cidr] = event.entry
                if message.synced:
                    break
            entry = listed[f"{READY}/32"]
            assert (entry.identity, entry.owner, entry.host_ip) == (KUBE_APISERVER, "", "")
            assert f"{NOT_READY}/32" not in listed
            assert f"{OFF_CLUSTER}/32" not in listed

            off = apiserver_slice(extra, (OFF_CLUSTER, True))
            kube.kubectl("apply", "-f", "-", input=json.dumps(off))
            await wait_for(stream, f"{OFF_CLUSTER}/32", KUBE_APISERVER)
            kube.kubectl("delete", "endpointslice", extra, "-n", "default")
            await wait_for(stream, f"{OFF_CLUSTER}/32", None)
            stream.cancel()
    finally:
        kube.kubectl("delete", "endpointslice", extra, "kubernetes", "-n", "default",
                     "--ignore-not-found")  # fmt: skip
