"""The operator in-process (gRPC on port 0) against a real redis-server."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import IO, Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_common import grpcerrors
from cilia_operator.app import Operator
from cilia_operator.config import Config
from cilia_testkit import procs

POOL = "default=ipv4-cidrs:10.251.0.0/22;ipv4-mask-size:24"


@asynccontextmanager
async def operator(redis_url: str, pools: str = POOL) -> AsyncIterator[tuple[Operator, Any]]:
    op = Operator(
        Config(
            store=redis_url,
            listen="127.0.0.1:0",
            prometheus_serve_addr="127.0.0.1:0",
            auto_create_cilium_pod_ip_pools=[pools] if pools else [],
            store_watch_block_timeout=0.5,
            shutdown_grace_period=0.1,
        )
    )
    await op.start()
    channel = grpc.aio.insecure_channel(op.address)
    try:
        yield op, channel
    finally:
        await channel.close()
        await op.stop()


async def register(channel: Any, name: str) -> pb.RegisterResponse:
    return await pb_grpc.NodeServiceStub(channel).Register(
        pb.RegisterRequest(
            node_name=name,
            addresses=["192.0.2.10"],
            local_networks=[pb.LocalNetwork(interface="eth0", cidr="192.0.2.0/24")],
        )
    )


async def demand(channel: Any, name: str, needed: int, released: list[str] | None = None) -> None:
    await pb_grpc.IPAMServiceStub(channel).UpdateDemand(
        pb.UpdateDemandRequest(
            node_name=name,
            demands=[pb.PoolDemand(pool="default", needed_ipv4=needed)],
            released=[pb.PoolCIDRs(pool="default", cidrs=released)] if released else [],
        )
    )


async def allocation_until(channel: Any, name: str, done: Any) -> pb.NodeAllocation:
    """Follow WatchAllocations until ``done(allocation)``; returns that allocation."""
    stream = pb_grpc.IPAMServiceStub(channel).WatchAllocations(
        pb.WatchAllocationsRequest(node_name=name)
    )
    try:
        async with asyncio.timeout(10):
            async for message in stream:
                if done(message.allocation):
                    return message.allocation
    finally:
        stream.cancel()
    raise AssertionError("stream ended")


def cidrs(allocation: pb.NodeAllocation) -> list[str]:
    return [c for p in allocation.pools for c in p.cidrs]


async def test_register_then_demand_streams_an_allocation_inside_the_pool(redis_url: str) -> None:
    async with operator(redis_url) as (op, channel):
        health = health_pb2_grpc.HealthStub(channel)
        status = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert (await register(channel, "node-a")).default_pool == "default"
        stream = pb_grpc.IPAMServiceStub(channel).WatchAllocations(
            pb.WatchAllocationsRequest(node_name="node-a")
        )
        first = (await stream.read()).allocation
        assert first.node_name == "node-a" and not first.pools
        await demand(channel, "node-a", 16)
        async with asyncio.timeout(10):
            while True:
                message = (await stream.read()).allocation
                if message.pools:
                    break
        stream.cancel()
        [block] = cidrs(message)
        assert ipaddress.ip_network(block).subnet_of(ipaddress.ip_network("10.251.0.0/22"))
        assert ipaddress.ip_network(block).prefixlen == 24
        assert message.error == "" and int(message.resource_version) > int(first.resource_version)
        stored = await op.store.get("CiliumNode", "node-a")
        assert stored["spec"]["ipam"]["pools"]["requested"] == [
            {"pool": "default", "needed": {"ipv4-addrs": 16}}
        ]
        assert stored["status"]["localNetworks"] == [{"interface": "eth0", "cidr": "192.0.2.0/24"}]
        assert op.metrics_port is not None
        body = urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics").read().decode()
        assert 'cilium_operator_ipam_allocated_cidrs{pool="default"} 1.0' in body


async def test_operator_restart_keeps_every_nodes_cidr_and_never_rehands_it(redis_url: str) -> None:
    before: dict[str, list[str]] = {}
    async with operator(redis_url) as (_, channel):
        for name in ("n1", "n2"):
            await register(channel, name)
            await demand(channel, name, 10)
            before[name] = cidrs(await allocation_until(channel, name, lambda a: a.pools))
    async with operator(redis_url) as (op, channel):
        for name in ("n1", "n2"):
            got = await allocation_until(channel, name, lambda a: a.pools)
            assert cidrs(got) == before[name]
        await register(channel, "n3")
        await demand(channel, "n3", 10)
        fresh = cidrs(await allocation_until(channel, "n3", lambda a: a.pools))
        assert not set(fresh) & {c for cs in before.values() for c in cs}
        assert op.controller.allocator.stats()["default"].allocated == 3


async def test_exhausted_pool_error_is_streamed_to_the_agent(redis_url: str) -> None:
    async with operator(redis_url) as (_, channel):
        await register(channel, "big")
        await demand(channel, "big", 5000)
        got = await allocation_until(channel, "big", lambda a: a.error)
        assert "pool 'default' exhausted" in got.error
        assert len(cidrs(got)) == 4  # everything the /22 had


async def test_released_cidr_is_freed_and_handed_to_another_node(redis_url: str) -> None:
    async with operator(redis_url, "default=ipv4-cidrs:10.251.0.0/24;ipv4-mask-size:25") as (
        _,
        channel,
    ):
        await register(channel, "a")
        await demand(channel, "a", 200)
        held = cidrs(await allocation_until(channel, "a", lambda a: len(cidrs(a)) == 2))
        await demand(channel, "a", 10, released=[held[1]])
        assert cidrs(await allocation_until(channel, "a", lambda a: len(cidrs(a)) == 1)) == held[:1]
        await register(channel, "b")
        await demand(channel, "b", 10)
        assert cidrs(await allocation_until(channel, "b", lambda a: a.pools)) == [held[1]]


MANIFEST = """
apiVersion: cilium.io/v2alpha1
kind: CiliumPodIPPool
metadata: {name: blue}
spec: {ipv4: {cidrs: [10.251.8.0/22], maskSize: 26}}
---
apiVersion: cilium.io/v2alpha1
kind: CiliumPodIPPool
metadata: {name: red}
spec: {ipv4: {cidrs: [10.251.0.0/23], maskSize: 24}}
"""


async def test_apply_with_one_invalid_document_changes_nothing(redis_url: str) -> None:
    async with operator(redis_url) as (op, channel):
        stub = pb_grpc.ResourceServiceStub(channel)
        before = await op.store.list("CiliumPodIPPool")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Apply(pb.ApplyRequest(manifest=MANIFEST))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert "document 1" in details and "spec.ipv4.cidrs[0]" in details
        assert "overlaps pool 'default' CIDR 10.251.0.0/22" in details
        after = await op.store.list("CiliumPodIPPool")
        assert after.resource_version == before.resource_version
        assert [p["metadata"]["name"] for p in after.items] == ["default"]


async def test_apply_creates_then_reports_unchanged_and_configured(redis_url: str) -> None:
    async with operator(redis_url) as (op, channel):
        stub = pb_grpc.ResourceServiceStub(channel)
        first_doc = MANIFEST.split("---")[0]
        dry = await stub.Apply(pb.ApplyRequest(manifest=first_doc, dry_run=True))
        assert [r.action for r in dry.resources] == ["created"]
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Get(pb.GetRequest(kind="cpip", name="blue"))
        created = await stub.Apply(pb.ApplyRequest(manifest=first_doc))
        assert [(r.kind, r.name, r.action) for r in created.resources] == [
            ("CiliumPodIPPool", "blue", "created")
        ]
        again = await stub.Apply(pb.ApplyRequest(manifest=first_doc))
        assert [r.action for r in again.resources] == ["unchanged"]
        relabelled = first_doc.replace("{name: blue}", "{name: blue, labels: {team: x}}")
        changed = await stub.Apply(pb.ApplyRequest(manifest=relabelled))
        assert [r.action for r in changed.resources] == ["configured"]
        got = await stub.Get(pb.GetRequest(kind="ciliumpodippools", name="blue"))
        assert json.loads(got.resource.json)["metadata"]["labels"] == {"team": "x"}
        listed = await stub.List(pb.ListRequest(kind="cpip"))
        assert [json.loads(r.json)["metadata"]["name"] for r in listed.items] == ["blue", "default"]
        assert "blue" in op.controller.allocator.pools or await _eventually_pool(op, "blue")


async def _eventually_pool(op: Operator, name: str) -> bool:
    async with asyncio.timeout(5):
        while name not in op.controller.allocator.pools:
            await asyncio.sleep(0.05)
    return True


async def test_deleting_a_pool_in_use_is_refused_naming_the_nodes(redis_url: str) -> None:
    async with operator(redis_url) as (_, channel):
        await register(channel, "holder")
        await demand(channel, "holder", 1)
        await allocation_until(channel, "holder", lambda a: a.pools)
        stub = pb_grpc.ResourceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Delete(pb.DeleteRequest(kind="cpip", name="default"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "holder" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Delete(pb.DeleteRequest(kind="cpip", name="nope"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


async def test_domain_errors_carry_an_error_info_reason(redis_url: str) -> None:
    """The error decorator sends google.rpc.ErrorInfo (domain operator.cilia.io) with the
    status: a client reads NOT_FOUND / UNKNOWN_KIND without parsing the message."""
    async with operator(redis_url) as (_, channel):
        stub = pb_grpc.ResourceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.Delete(pb.DeleteRequest(kind="cpip", name="nope"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        info = grpcerrors.error_info(missing.value)
        assert info is not None and (info.domain, info.reason) == ("operator.cilia.io", "NOT_FOUND")
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Delete(pb.DeleteRequest(kind="gadgets", name="x"))
        assert unknown.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert grpcerrors.error_reason(unknown.value) == "UNKNOWN_KIND"


async def test_each_listener_is_announced_once_with_its_bound_address(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="cilia_operator.app"):
        async with operator(redis_url) as (op, _):
            pass
    listening = {
        r.listener: r.address  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "listening"
    }
    assert listening == {"grpc": op.address, "metrics": f"127.0.0.1:{op.metrics_port}"}
    assert not op.address.endswith(":0") and op.metrics_port


async def test_existing_pool_is_not_updated_by_auto_create(redis_url: str) -> None:
    async with operator(redis_url):
        pass
    async with operator(redis_url, "default=ipv4-cidrs:10.251.4.0/22;ipv4-mask-size:26") as (op, _):
        pool = await op.store.get("CiliumPodIPPool", "default")
        assert pool["spec"]["ipv4"] == {"cidrs": ["10.251.0.0/22"], "maskSize": 24}


async def test_demand_for_unregistered_node_is_not_found(redis_url: str) -> None:
    async with operator(redis_url) as (_, channel):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await demand(channel, "ghost", 1)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_watch_nodes_lists_registered_nodes_then_streams_new_ones(redis_url: str) -> None:
    async with operator(redis_url) as (_, channel):
        await register(channel, "first")
        stream = pb_grpc.NodeServiceStub(channel).WatchNodes(pb.WatchNodesRequest())
        initial = await stream.read()
        assert initial.synced and [e.node.name for e in initial.events] == ["first"]
        await register(channel, "second")
        nxt = await asyncio.wait_for(stream.read(), 10)
        assert [(e.type, e.node.name, list(e.node.addresses)) for e in nxt.events] == [
            (pb.EVENT_TYPE_UPSERT, "second", ["192.0.2.10"])
        ]
        stream.cancel()


async def test_watch_nodes_carries_each_nodes_pod_cidrs_once_allocated(redis_url: str) -> None:
    async with operator(redis_url) as (_, channel):
        await register(channel, "routed")
        stream = pb_grpc.NodeServiceStub(channel).WatchNodes(pb.WatchNodesRequest())
        initial = await stream.read()
        assert [list(e.node.pod_cidrs) for e in initial.events] == [[]]
        await demand(channel, "routed", 10)
        allocated = cidrs(await allocation_until(channel, "routed", lambda a: a.pools))
        async with asyncio.timeout(10):
            while True:
                events = (await stream.read()).events
                if events and events[-1].node.pod_cidrs:
                    break
        assert list(events[-1].node.pod_cidrs) == sorted(allocated)
        assert all(c.startswith("10.251.") for c in allocated)
        stream.cancel()


async def test_cli_apply_prints_one_line_per_resource_and_fails_with_exit_2(
    redis_url: str, tmp_path: Any
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(MANIFEST.split("---")[0])
    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFEST)
    async with operator(redis_url) as (op, _):
        cli = [sys.executable, "-m", "cilia_operator"]

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=30)

        ok = await asyncio.to_thread(run, "apply", "-f", str(good), "--server", op.address)
        assert (ok.returncode, ok.stdout) == (0, "ciliumpodippool.cilium.io/blue created\n")
        fail = await asyncio.to_thread(run, "apply", "-f", str(bad), "--server", op.address)
        assert fail.returncode == 2 and fail.stdout == ""
        assert fail.stderr.count("\n") == 1 and "Traceback" not in fail.stderr
        assert "document 1" in fail.stderr
        got = await asyncio.to_thread(
            run, "get", "cpip", "blue", "-o", "yaml", "--server", op.address
        )
        assert got.returncode == 0 and "name: blue" in got.stdout


def _bound_grpc_address(stderr: IO[str]) -> str:
    """The gRPC address the operator bound (port 0), read from its JSON log: the
    ``"listening"`` line of listener ``grpc``, or ``"operator serving"``'s ``listen``."""
    for line in stderr:
        found = procs.listening(line)
        if found is not None and found[0] == "grpc":
            return found[1]
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("msg") == "operator serving":
            return str(record["listen"])
    raise AssertionError("operator exited before it served")


def test_serve_stops_cleanly_on_sigterm_and_exits_0(redis_url: str) -> None:
    import signal
    import time

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cilia_operator",
            "serve",
            "--store",
            redis_url,
            "--listen",
            "127.0.0.1:0",
            "--prometheus-serve-addr",
            "",
            "--auto-create-cilium-pod-ip-pools",
            POOL,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    address = _bound_grpc_address(proc.stderr)
    channel = grpc.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 20
    while True:
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                break
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline and proc.poll() is None, "operator never served"
        time.sleep(0.1)
    channel.close()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert '"msg": "operator stopped"' in err and "Traceback" not in err
