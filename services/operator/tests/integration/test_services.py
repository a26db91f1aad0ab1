"""Services in standalone mode against a real redis-server: ClusterIP/NodePort allocation from
the ServiceCIDRs (unique under concurrent applies, moving on to the next range, explicit
addresses honoured, bad input refused with nothing written), a deleted ServiceCIDR kept
terminating while a Service uses it, pool/ServiceCIDR overlaps refused naming both,
EndpointSlices following the endpoint records, and the WatchServices stream."""

from __future__ import annotations

import asyncio
import datetime
import io
import ipaddress
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from cluster import running_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator import cli
from cilia_operator.app import StartupError
from cilia_operator.store import NotFound

RANGE = "10.96.0.0/28"  # 14 usable addresses


def service(
    name: str,
    *,
    ns: str = "default",
    ports: list[dict[str, Any]] | None = None,
    selector: dict[str, str] | None = None,
    selectorless: bool = False,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {"ports": ports or [{"port": 80, "targetPort": 8080}], **spec}
    if not selectorless:
        body["selector"] = selector or {"app": name}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": body,
    }


def service_cidr(name: str, cidr: str) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": name},
        "spec": {"cidrs": [cidr]},
    }


def pool(name: str, cidr: str) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2alpha1",
        "kind": "CiliumPodIPPool",
        "metadata": {"name": name},
        "spec": {"ipv4": {"cidrs": [cidr], "maskSize": 28}},
    }


def manifest(*docs: dict[str, Any]) -> str:
    return "\n---\n".join(json.dumps(d) for d in docs)


async def apply(channel: Any, *docs: dict[str, Any]) -> pb.ApplyResponse:
    stub = pb_grpc.ResourceServiceStub(channel)
    response: pb.ApplyResponse = await stub.Apply(pb.ApplyRequest(manifest=manifest(*docs)))
    return response


async def apply_retrying(channel: Any, *docs: dict[str, Any]) -> pb.ApplyResponse:
    """``apply``, again after ABORTED (the store kept changing under every attempt of the
    transaction: nothing was written), as a client does."""
    for _ in range(50):
        try:
            return await apply(channel, *docs)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise
    raise AssertionError("still ABORTED after 50 attempts")


async def refused(channel: Any, *docs: dict[str, Any]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await apply(channel, *docs)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    return caught.value.details() or ""


async def listed(channel: Any, kind: str) -> dict[str, dict[str, Any]]:
    stub = pb_grpc.ResourceServiceStub(channel)
    items = (await stub.List(pb.ListRequest(kind=kind))).items
    out = {}
    for item in items:
        obj = json.loads(item.json)
        meta = obj["metadata"]
        out[f"{meta.get('namespace', '')}/{meta['name']}".lstrip("/")] = obj
    return out


def cluster_ip(obj: dict[str, Any]) -> ipaddress.IPv4Address:
    return ipaddress.IPv4Address(obj["spec"]["clusterIP"])


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def endpoint(name: str, ip: str, labels: list[str], node: str = "n1") -> pb.UpsertEndpointRequest:
    return pb.UpsertEndpointRequest(
        endpoint=pb.EndpointRecord(
            namespace="default", name=name, node_name=node, ipv4=ip, identity=300,
            labels=labels, endpoint_id=1, container_id="c-" + name,
        )
    )  # fmt: skip


async def test_concurrent_applies_get_unique_cluster_ips_and_defaults(redis_url: str) -> None:
    """12 Services applied at once into a /28 (14 addresses): all distinct, all inside the
    default ServiceCIDR ``kubernetes`` the operator created from the flag, Kubernetes'
    defaults set; re-applying one changes nothing."""
    async with running_operator(redis_url, service_cluster_ip_range=[RANGE]) as (_, channel):
        cidrs = await listed(channel, "servicecidrs")
        assert cidrs["kubernetes"]["spec"]["cidrs"] == [RANGE]
        await asyncio.gather(*(apply_retrying(channel, service(f"s{i}")) for i in range(12)))
        stored = await listed(channel, "services")
        ips = [cluster_ip(o) for o in stored.values()]
        assert len(ips) == 12 and len(set(ips)) == 12
        net = ipaddress.IPv4Network(RANGE)
        assert all(ip in net and ip not in (net[0], net[-1]) for ip in ips)
        spec = stored["default/s0"]["spec"]
        assert spec["type"] == "ClusterIP" and spec["sessionAffinity"] == "None"
        assert spec["ports"] == [{"port": 80, "targetPort": 8080, "protocol": "TCP"}]
        assert spec["clusterIPs"] == [spec["clusterIP"]]
        again = await apply(channel, service("s0"))
        assert [r.action for r in again.resources] == ["unchanged"]


async def test_allocation_moves_on_to_the_next_service_cidr_when_one_is_full(
    redis_url: str,
) -> None:
    async with running_operator(redis_url, service_cluster_ip_range=["10.96.0.0/29"]) as (
        _,
        channel,
    ):
        await apply(channel, service_cidr("extra", "10.97.0.0/29"))
        for i in range(8):  # 6 usable in each range
            await apply(channel, service(f"s{i}"))
        ips = sorted(cluster_ip(o) for o in (await listed(channel, "services")).values())
        first = [ip for ip in ips if ip in ipaddress.IPv4Network("10.96.0.0/29")]
        second = [ip for ip in ips if ip in ipaddress.IPv4Network("10.97.0.0/29")]
        assert len(first) == 6 and len(second) == 2
        for i in range(8, 12):
            await apply(channel, service(f"s{i}"))
        details = await refused(channel, service("full"))
        assert "no address left in any ServiceCIDR" in details, details


async def test_explicit_cluster_ip_is_honoured_and_bad_input_changes_nothing(
    redis_url: str,
) -> None:
    """The issue's bad input: an address outside every ServiceCIDR, a duplicate ClusterIP,
    ports 0 and 70000, SCTP, a duplicate port, a selector-less Service without
    EndpointSlices: INVALID_ARGUMENT naming document, field and reason; the store is the
    same afterwards (every record, every resourceVersion)."""
    async with running_operator(redis_url, service_cluster_ip_range=[RANGE]) as (op, channel):
        await apply(channel, service("web", clusterIP="10.96.0.9"))
        assert str(cluster_ip((await listed(channel, "services"))["default/web"])) == "10.96.0.9"
        before = {k: await op.store.list(k) for k in ("Service", "EndpointSlice", "ServiceCIDR")}
        cases = [
            (service("a", clusterIP="10.200.0.1"), "spec.clusterIP: 10.200.0.1 is outside every "
             "ServiceCIDR"),
            (service("b", clusterIP="10.96.0.9"), "spec.clusterIP: 10.96.0.9 is already "
             "allocated to Service default/web"),
            (service("c", ports=[{"port": 0}]), "spec.ports[0].port: 0 is out of range"),
            (service("d", ports=[{"port": 70000}]), "spec.ports[0].port: 70000 is out of range"),
            (service("e", ports=[{"port": 80, "protocol": "SCTP"}]), "SCTP is not supported"),
            (service("f", ports=[{"name": "a", "port": 80}, {"name": "b", "port": 80}]),
             "duplicate port 80/TCP"),
            (service("g", selectorless=True), "a Service without a selector has no endpoints"),
            (service("h", clusterIP="10.96.0.0"), "network or broadcast address"),
            (service("i", type="NodePort", ports=[{"port": 80, "nodePort": 80}]),
             "outside --service-node-port-range 30000-32767"),
        ]  # fmt: skip
        for doc, reason in cases:
            details = await refused(channel, service("ok-before"), doc)
            name = doc["metadata"]["name"]
            assert f"document 1 (Service default/{name})" in details, details
            assert reason in details, details
        after = {k: await op.store.list(k) for k in ("Service", "EndpointSlice", "ServiceCIDR")}
        assert {k: v.items for k, v in after.items()} == {k: v.items for k, v in before.items()}


async def test_selectorless_service_is_accepted_with_its_endpoint_slice(redis_url: str) -> None:
    async with running_operator(redis_url, service_cluster_ip_range=[RANGE]) as (_, channel):
        eps = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "ext-1", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "ext"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["192.0.2.50"]}],
            "ports": [{"name": "", "port": 9000, "protocol": "TCP"}],
        }  # fmt: skip
        await apply(channel, service("ext", selectorless=True), eps)
        assert "default/ext" in await listed(channel, "svc")
        assert "default/ext-1" in await listed(channel, "endpointslices")


async def test_node_ports_are_allocated_in_range_and_kept_on_update(redis_url: str) -> None:
    async with running_operator(
        redis_url, service_cluster_ip_range=[RANGE], service_node_port_range="30000-30001"
    ) as (_, channel):
        np = service("np", type="NodePort", ports=[{"port": 80}])
        await apply(channel, np)
        first = (await listed(channel, "services"))["default/np"]["spec"]["ports"][0]["nodePort"]
        assert first in (30000, 30001)
        await apply(channel, np)  # no nodePort given: kept
        again = (await listed(channel, "services"))["default/np"]["spec"]["ports"][0]["nodePort"]
        assert again == first
        await apply(channel, service("np2", type="NodePort", ports=[{"port": 80}]))
        details = await refused(channel, service("np3", type="NodePort", ports=[{"port": 80}]))
        assert "no TCP NodePort left" in details


async def test_service_cidr_deleted_while_used_stays_terminating_until_released(
    redis_url: str,
) -> None:
    async with running_operator(redis_url, service_cluster_ip_range=[RANGE]) as (op, channel):
        resources = pb_grpc.ResourceServiceStub(channel)
        await apply(channel, service_cidr("extra", "10.97.0.0/24"))
        await apply(channel, service("held", clusterIP="10.97.0.10"))
        out = io.StringIO()
        await asyncio.to_thread(cli.delete, "servicecidr", "extra", op.address, 10.0, out)
        assert out.getvalue() == (
            "servicecidr.networking.k8s.io/extra terminating: Services hold addresses in it; "
            "it is deleted when the last of them goes\n"
        )
        kept = (await listed(channel, "servicecidrs"))["extra"]
        assert kept["metadata"]["deletionTimestamp"]
        assert kept["status"]["conditions"][0]["reason"] == "Terminating"
        details = await refused(channel, service("new", clusterIP="10.97.0.11"))
        assert "ServiceCIDR 'extra', which is being deleted" in details
        details = await refused(channel, service_cidr("extra", "10.97.0.0/24"))
        assert "is being deleted" in details
        # the Service holding an address there can still be updated (it keeps the address)
        changed = service("held", ports=[{"port": 81}])
        assert [r.action for r in (await apply(channel, changed)).resources] == ["configured"]
        stored = (await listed(channel, "services"))["default/held"]["spec"]
        assert (stored["clusterIP"], stored["ports"][0]["port"]) == ("10.97.0.10", 81)
        await resources.Delete(pb.DeleteRequest(kind="service", name="held", namespace="default"))

        async def released() -> bool:
            try:
                await op.store.get("ServiceCIDR", "extra")
            except NotFound:
                return True
            return False

        await eventually(released)
        # an unused ServiceCIDR goes at once
        await apply(channel, service_cidr("spare", "10.98.0.0/24"))
        out = io.StringIO()
        await asyncio.to_thread(cli.delete, "servicecidr", "spare", op.address, 10.0, out)
        assert out.getvalue() == "servicecidr.networking.k8s.io/spare deleted\n"
        assert "spare" not in await listed(channel, "servicecidrs")


async def test_pool_and_service_cidr_overlaps_are_refused_naming_both(redis_url: str) -> None:
    async with running_operator(redis_url, service_cluster_ip_range=[RANGE]) as (_, channel):
        await apply(channel, service_cidr("extra", "10.97.0.0/24"))
        details = await refused(channel, pool("blue", "10.97.0.0/26"))
        assert "CiliumPodIPPool blue" in details and "overlaps ServiceCIDR 'extra'" in details
        details = await refused(channel, service_cidr("clash", "10.251.0.0/24"))
        assert "ServiceCIDR 'clash' 10.251.0.0/24 overlaps pod pool 'default'" in details
        details = await refused(channel, pool("green", "10.240.0.0/24"),
                                service_cidr("both", "10.240.0.0/25"))  # fmt: skip
        assert "ServiceCIDR 'both' 10.240.0.0/25 overlaps pod pool 'green'" in details
        assert "green" not in await listed(channel, "cpip")


async def test_endpoint_slices_follow_the_endpoints_and_the_stream_joins_them(
    redis_url: str,
) -> None:
    up, down = pb.EVENT_TYPE_UPSERT, pb.EVENT_TYPE_DELETE
    async with running_operator(redis_url, service_cluster_ip_range=[RANGE]) as (_, channel):
        endpoints = pb_grpc.EndpointServiceStub(channel)
        await endpoints.UpsertEndpoint(endpoint("web-a", "10.251.0.5", ["k8s:app=web"]))
        await endpoints.UpsertEndpoint(endpoint("other", "10.251.0.6", ["k8s:app=other"]))
        await apply(channel, service("web", clusterIP="10.96.0.3", sessionAffinity="ClientIP",
                                     ports=[{"name": "http", "port": 80, "targetPort": 8080}]))  # fmt: skip

        async def slice_ips() -> list[str]:
            stored = await listed(channel, "endpointslices")
            web = [o for o in stored.values()
                   if o["metadata"]["labels"]["kubernetes.io/service-name"] == "web"]  # fmt: skip
            return sorted(a for s in web for e in s["endpoints"] for a in e["addresses"])

        async def has(ips: list[str]) -> bool:
            return await slice_ips() == ips

        await eventually(lambda: has(["10.251.0.5"]))
        stored = (await listed(channel, "endpointslices"))["default/web-0"]
        assert stored["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"]
        assert stored["ports"] == [{"name": "http", "port": 8080, "protocol": "TCP"}]
        assert stored["endpoints"][0]["conditions"] == {
            "ready": True, "serving": True, "terminating": False,
        }  # fmt: skip

        stream = pb_grpc.ServiceServiceStub(channel).WatchServices(
            pb.WatchServicesRequest(node_name="n1")
        )
        first = await asyncio.wait_for(stream.read(), 10)
        assert first.synced
        [event] = first.events
        assert event.type == up
        svc = event.service
        assert (svc.namespace, svc.name, svc.type, list(svc.cluster_ips)) == (
            "default", "web", "ClusterIP", ["10.96.0.3"],
        )  # fmt: skip
        assert (svc.session_affinity, svc.session_affinity_timeout_seconds) == ("ClientIP", 10800)
        [port] = svc.ports
        assert (port.name, port.protocol, port.port, port.node_port) == ("http", "TCP", 80, 0)
        assert [(b.ip, b.port, b.ready, b.node_name, b.target) for b in port.backends] == [
            ("10.251.0.5", 8080, True, "n1", "default/web-a")
        ]

        # a second endpoint of the Service: the slice and the stream follow
        await endpoints.UpsertEndpoint(endpoint("web-b", "10.251.0.7", ["k8s:app=web"], "n2"))
        message = await asyncio.wait_for(stream.read(), 10)
        [event] = message.events
        assert not message.synced and event.type == up
        assert [b.ip for b in event.service.ports[0].backends] == ["10.251.0.5", "10.251.0.7"]

        # an endpoint record that goes away: its address leaves the slice and the stream
        await endpoints.DeleteEndpoint(
            pb.DeleteEndpointRequest(namespace="default", name="web-a", node_name="n1")
        )
        message = await asyncio.wait_for(stream.read(), 10)
        assert [b.ip for b in message.events[0].service.ports[0].backends] == ["10.251.0.7"]
        await eventually(lambda: has(["10.251.0.7"]))

        # the Service deleted: DELETE with namespace and name, its slices go
        await pb_grpc.ResourceServiceStub(channel).Delete(
            pb.DeleteRequest(kind="svc", name="web", namespace="default")
        )
        message = await asyncio.wait_for(stream.read(), 10)
        assert [(e.type, e.service.namespace, e.service.name, len(e.service.ports))
                for e in message.events] == [(down, "default", "web", 0)]  # fmt: skip
        await eventually(lambda: has([]))
        stream.cancel()


async def test_slices_hold_at_most_the_limit_of_endpoints(redis_url: str) -> None:
    async with running_operator(
        redis_url, service_cluster_ip_range=[RANGE], max_endpoints_per_slice=2
    ) as (_, channel):
        endpoints = pb_grpc.EndpointServiceStub(channel)
        for i in range(5):
            await endpoints.UpsertEndpoint(endpoint(f"p{i}", f"10.251.0.{10 + i}", ["k8s:app=web"]))
        await apply(channel, service("web"))

        async def three_slices() -> bool:
            stored = await listed(channel, "endpointslices")
            sizes = sorted(len(s["endpoints"]) for s in stored.values())
            return sizes == [1, 2, 2]

        await eventually(three_slices)


async def test_operator_start_refuses_pools_over_a_stored_service_cidr(redis_url: str) -> None:
    """The pools of --auto-create-cilium-pod-ip-pools and --cluster-pool-ipv4-cidr are checked
    against the stored ServiceCIDRs too: start-up fails naming both."""
    async with running_operator(redis_url, service_cluster_ip_range=[RANGE]) as (_, channel):
        await apply(channel, service_cidr("extra", "10.252.0.0/16"))
    auto = ["clash=ipv4-cidrs:10.252.4.0/24;ipv4-mask-size:26"]
    with pytest.raises(StartupError, match=re.escape("overlaps ServiceCIDR 'extra' 10.252.0.0/16")):
        async with running_operator(redis_url, auto_create_cilium_pod_ip_pools=auto):
            pass
    cluster = {"ipam": "cluster-pool", "cluster_pool_ipv4_cidr": ["10.252.128.0/20"],
               "auto_create_cilium_pod_ip_pools": []}  # fmt: skip
    with pytest.raises(
        StartupError, match=re.escape("10.252.128.0/20 overlaps ServiceCIDR 'extra'")
    ):
        async with running_operator(redis_url, **cluster):
            pass


async def test_servicecidr_migrate_dry_run_prints_the_plan_and_changes_nothing(
    redis_url: str,
) -> None:
    """The plan keeps each Service's offset in the range (the DNS address stays x.x.x.10),
    names the special cases, and writes nothing; a target overlapping a ServiceCIDR, a pod
    pool or too small is refused; without --dry-run it moves every Service, keeps the old
    addresses as aliases and releases them (and the old range) after the grace period."""
    async with running_operator(
        redis_url, service_cluster_ip_range=[RANGE], service_alias_check_interval=0.2
    ) as (op, channel):
        await apply(channel, service("kube-dns", ns="kube-system", clusterIP="10.96.0.10",
                                     ports=[{"port": 53, "protocol": "UDP"}]))  # fmt: skip
        await apply(channel, service("web", clusterIP="10.96.0.3"))
        await apply(channel, service("api", clusterIP="10.96.0.4"))
        before = {k: (await op.store.list(k)).items for k in ("Service", "ServiceCIDR")}
        out = io.StringIO()
        await asyncio.to_thread(
            cli.servicecidr_migrate, "10.100.0.0/29", True, "10m", op.address, 10.0, out
        )
        text = out.getvalue()
        assert "from: ServiceCIDR kubernetes 10.96.0.0/28 (3 Service(s))" in text, text
        assert "to:   10.100.0.0/29 as new ServiceCIDR migrated-10-100-0-0-29" in text
        assert "kube-system/kube-dns  10.96.0.10 -> 10.100.0.1  (offset taken or out" in text
        assert "default/web           10.96.0.3 -> 10.100.0.3\n" in text
        assert "default/api           10.96.0.4 -> 10.100.0.4\n" in text
        assert "cluster DNS kube-system/kube-dns: pods keep 10.96.0.10" in text
        assert "no use of it for 10m (--alias-grace-period)" in text
        after = {k: (await op.store.list(k)).items for k in ("Service", "ServiceCIDR")}
        assert after == before
        for target, reason in [("10.96.0.0/24", "overlaps ServiceCIDR kubernetes"),
                               ("10.100.0.0/31", "has 0 usable addresses but 3 Services")]:  # fmt: skip
            with pytest.raises(cli.CommandError, match=re.escape(reason)):
                await asyncio.to_thread(cli.servicecidr_migrate, target, True, "1h", op.address,
                                        10.0, io.StringIO())  # fmt: skip
        await apply(channel, pool("pods", "10.200.0.0/16"))
        for run_it in (True, False):  # a pod pool overlap is refused in plan and execution
            with pytest.raises(cli.CommandError, match=re.escape(
                    "target 10.200.0.0/24 overlaps pod pool 'pods' CIDR 10.200.0.0/16")):  # fmt: skip
                await asyncio.to_thread(cli.servicecidr_migrate, "10.200.0.0/24", run_it, "1h",
                                        op.address, 10.0, io.StringIO())  # fmt: skip
        # executed: every Service moves, its old ClusterIP stays an alias; nothing uses the
        # aliases (no agent), so after the grace period they go and the old range with them
        out = io.StringIO()
        await asyncio.to_thread(cli.servicecidr_migrate, "10.100.0.0/24", False, "1s",
                                op.address, 10.0, out, poll_interval=0.05)  # fmt: skip
        text = out.getvalue()
        assert "moved kube-system/kube-dns: 10.96.0.10 -> 10.100.0.10 (10.96.0.10 stays" in text
        assert "every Service moved (3)" in text, text
        web = await op.store.get("Service", "web", "default")
        assert web["spec"]["clusterIP"] == "10.100.0.3"
        assert "10.96.0.3" in web["metadata"]["annotations"]["service.cilia.io/alias-ips"]

        async def released() -> bool:
            names = {c["metadata"]["name"] for c in (await op.store.list("ServiceCIDR")).items}
            return names == {"migrated-10-100-0-0-24"}

        deadline = time.monotonic() + 20
        while not await released():
            assert time.monotonic() < deadline, "the old ServiceCIDR was not released"
            await asyncio.sleep(0.1)
        web = await op.store.get("Service", "web", "default")
        assert "service.cilia.io/alias-ips" not in (web["metadata"].get("annotations") or {})
        status = io.StringIO()
        await asyncio.to_thread(cli.servicecidr_status, op.address, 10.0, status)
        assert "default/web" in status.getvalue() and "yes (" in status.getvalue()
        assert "migrated-10-100-0-0-24       10.100.0.0/24      active" in status.getvalue()


async def test_register_records_alias_use_as_a_time_on_the_operators_clock(
    redis_url: str,
) -> None:
    """An agent's alias-use report (Register, reports_alias_use) lands in its node's
    CiliaServiceAliasUse record: used ones as receipt time minus the idle duration."""
    async with running_operator(redis_url, service_cluster_ip_range=[RANGE]) as (op, channel):
        before = time.time()
        await pb_grpc.NodeServiceStub(channel).Register(pb.RegisterRequest(  # type: ignore[no-untyped-call]
            node_name="node-a", addresses=["192.0.2.10"], reports_alias_use=True,
            alias_uses=[pb.AliasUse(ip="10.96.0.10", used=True, idle_ms=30_000),
                        pb.AliasUse(ip="10.96.0.3", used=False)],
        ), timeout=10)  # fmt: skip
        record = await op.store.get("CiliaServiceAliasUse", "node-a")
        last = record["status"]["lastUsed"]
        assert list(last) == ["10.96.0.10"]  # never-used aliases have no time
        used = datetime.datetime.fromisoformat(last["10.96.0.10"].replace("Z", "+00:00"))
        assert before - 31 <= used.timestamp() <= time.time() - 29


async def test_report_alias_use_records_the_uses_and_queues_no_ipam_reconcile(
    redis_url: str,
) -> None:
    """``ReportAliasUse`` (every report interval per node while aliases exist) writes the
    node's CiliaServiceAliasUse record and nothing else: no IPAM reconcile of the node is
    queued and its CiliumNode is untouched, unlike ``Register``."""
    async with running_operator(redis_url, service_cluster_ip_range=[RANGE]) as (op, channel):
        nodes = pb_grpc.NodeServiceStub(channel)  # type: ignore[no-untyped-call]
        await nodes.Register(pb.RegisterRequest(node_name="node-a", addresses=["192.0.2.10"]),
                             timeout=10)  # fmt: skip
        queued: list[str] = []
        real_enqueue = op.controller.enqueue

        def enqueue(name: str) -> None:
            queued.append(name)
            real_enqueue(name)

        op.controller.enqueue = enqueue  # type: ignore[method-assign]
        # Register's own writes reach the controller through its node watch, later than the
        # reply: wait until they are in (no enqueue for 0.3 s), then count from zero
        async with asyncio.timeout(10):
            seen = -1
            while seen != len(queued):
                seen = len(queued)
                await asyncio.sleep(0.3)
        queued.clear()
        node_before = await op.store.get("CiliumNode", "node-a")
        for idle_ms in (30_000, 20_000):
            await nodes.ReportAliasUse(pb.ReportAliasUseRequest(
                node_name="node-a",
                alias_uses=[pb.AliasUse(ip="10.96.0.10", used=True, idle_ms=idle_ms),
                            pb.AliasUse(ip="10.96.0.3", used=False)],
            ), timeout=10)  # fmt: skip
        record = await op.store.get("CiliaServiceAliasUse", "node-a")
        assert list(record["status"]["lastUsed"]) == ["10.96.0.10"]
        assert queued == []
        node_after = await op.store.get("CiliumNode", "node-a")
        assert (
            node_after["metadata"]["resourceVersion"] == node_before["metadata"]["resourceVersion"]
        )
        # the old way (an older agent's Register with fields 6 and 7) still reconciles
        await nodes.Register(pb.RegisterRequest(node_name="node-a", addresses=["192.0.2.10"],
                                                reports_alias_use=True), timeout=10)  # fmt: skip
        assert queued == ["node-a"]
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await nodes.ReportAliasUse(pb.ReportAliasUseRequest(node_name="Bad_Name"), timeout=10)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
