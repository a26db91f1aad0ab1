"""Operator IPAM against a real redis-server: cluster-pool, ResolvePool, draining,
overlap refusals (LAN, services), dry-run effects, migration, GetStatus and the CLI."""

from __future__ import annotations

import asyncio
import io
import ipaddress
import json
import os
import subprocess
import sys
from typing import Any

import grpc
import pytest
from cluster import running_operator

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator import cli
from cilia_operator.app import Operator
from cilia_operator.ipam.changes import plan_numbers
from cilia_testkit import procs

CLUSTER = {
    "ipam": "cluster-pool",
    "cluster_pool_ipv4_cidr": ["10.252.0.0/22"],
    "cluster_pool_ipv4_mask_size": 24,
    "auto_create_cilium_pod_ip_pools": [],
}


async def register(
    channel: Any, name: str, networks: list[tuple[str, str]] | None = None
) -> pb.RegisterResponse:
    return await pb_grpc.NodeServiceStub(channel).Register(
        pb.RegisterRequest(
            node_name=name,
            addresses=["192.0.2.10"],
            local_networks=[pb.LocalNetwork(interface=i, cidr=c) for i, c in networks or []],
        )
    )


async def demand(
    channel: Any, name: str, needed: int, pool: str = "default", released: list[str] | None = None
) -> None:
    await pb_grpc.IPAMServiceStub(channel).UpdateDemand(
        pb.UpdateDemandRequest(
            node_name=name,
            demands=[pb.PoolDemand(pool=pool, needed_ipv4=needed)],
            released=[pb.PoolCIDRs(pool=pool, cidrs=released)] if released else [],
        )
    )


async def allocation_until(channel: Any, name: str, done: Any) -> pb.NodeAllocation:
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


async def status(channel: Any) -> pb.IPAMServiceGetStatusResponse:
    return await pb_grpc.IPAMServiceStub(channel).GetStatus(pb.IPAMServiceGetStatusRequest())


async def apply(channel: Any, manifest: str, dry_run: bool = False) -> pb.ApplyResponse:
    return await pb_grpc.ResourceServiceStub(channel).Apply(
        pb.ApplyRequest(manifest=manifest, dry_run=dry_run)
    )


def pool_yaml(name: str, cidrs: list[str], mask: int = 24, extra: str = "") -> str:
    return (
        f"apiVersion: cilium.io/v2alpha1\nkind: CiliumPodIPPool\nmetadata: {{name: {name}}}\n"
        f"spec: {{ipv4: {{cidrs: [{', '.join(cidrs)}], maskSize: {mask}}}{extra}}}\n"
    )


def blocks(allocation: pb.NodeAllocation) -> list[str]:
    return [c for p in allocation.pools for c in p.cidrs]


async def test_cluster_pool_gives_each_node_exactly_one_pod_cidr(redis_url: str) -> None:
    async with running_operator(redis_url, **CLUSTER) as (op, channel):
        assert (await register(channel, "c1")).ipam_mode == "cluster-pool"
        await register(channel, "c2")
        a1 = await allocation_until(channel, "c1", lambda a: a.pod_cidrs)
        a2 = await allocation_until(channel, "c2", lambda a: a.pod_cidrs)
        assert len(a1.pod_cidrs) == 1 and len(a2.pod_cidrs) == 1
        assert a1.pod_cidrs[0] != a2.pod_cidrs[0]
        for cidr in (*a1.pod_cidrs, *a2.pod_cidrs):
            net = ipaddress.ip_network(cidr)
            assert net.prefixlen == 24 and net.subnet_of(ipaddress.ip_network("10.252.0.0/22"))
        await demand(channel, "c1", 5000)  # demand never adds a second block
        await op.controller.drain()
        stored = await op.store.get("CiliumNode", "c1")
        assert stored["spec"]["ipam"]["podCIDRs"] == list(a1.pod_cidrs)
        assert (
            "allocated" not in stored["spec"]["ipam"]["pools"]
            or not stored["spec"]["ipam"]["pools"]["allocated"]
        )
        resolved = await pb_grpc.IPAMServiceStub(channel).ResolvePool(
            pb.ResolvePoolRequest(pod_namespace="x", pod_name="p")
        )
        assert resolved.pool == "default" and "cluster-pool" in resolved.reason


async def test_cluster_pool_exhaustion_is_written_to_the_node_status(redis_url: str) -> None:
    settings = {**CLUSTER, "cluster_pool_ipv4_cidr": ["10.252.4.0/24"]}
    async with running_operator(redis_url, **settings) as (_, channel):
        await register(channel, "only")
        assert (await allocation_until(channel, "only", lambda a: a.pod_cidrs)).pod_cidrs == [
            "10.252.4.0/24"
        ]
        await register(channel, "late")
        late = await allocation_until(channel, "late", lambda a: a.error)
        assert not late.pod_cidrs and "10.252.4.0/24" in late.error
        assert late.error.startswith("cluster-pool exhausted"), late.error


NAMESPACED = """
apiVersion: v1
kind: Namespace
metadata: {name: team-a, labels: {tier: gold}, annotations: {ipam.cilium.io/ip-pool: blue}}
---
apiVersion: v1
kind: Namespace
metadata: {name: strict, annotations: {ipam.cilium.io/require-pool-match: "true"}}
"""


async def test_resolve_pool_follows_upstream_precedence(redis_url: str) -> None:
    async with running_operator(redis_url) as (_, channel):
        await apply(channel, pool_yaml("blue", ["10.251.16.0/22"]))
        await apply(channel, pool_yaml("red", ["10.251.20.0/22"]))
        await apply(
            channel,
            pool_yaml("gold", ["10.251.24.0/22"], extra=", namespaceSelector: {matchLabels: "
                      "{tier: gold}}, podSelector: {matchLabels: {app: db}}"),
        )  # fmt: skip
        await apply(channel, NAMESPACED)
        stub = pb_grpc.IPAMServiceStub(channel)

        async def resolve(ns: str, labels: dict[str, str], notes: dict[str, str]) -> Any:
            return await stub.ResolvePool(
                pb.ResolvePoolRequest(
                    pod_namespace=ns, pod_name="p", pod_labels=labels, pod_annotations=notes
                )
            )

        both = {"ipam.cilium.io/ipv4-pool": "red", "ipam.cilium.io/ip-pool": "blue"}
        got = await resolve("team-a", {"app": "db"}, both)
        assert (got.pool, got.reason) == ("red", "pod annotation ipam.cilium.io/ipv4-pool")
        got = await resolve("team-a", {"app": "db"}, {})
        assert (got.pool, got.reason) == ("blue", "namespace annotation ipam.cilium.io/ip-pool")
        got = await resolve("other", {"app": "db"}, {})
        assert got.pool == "default"  # namespaceSelector does not match
        await apply(channel, NAMESPACED.replace("ipam.cilium.io/ip-pool: blue", "x: y"))
        assert (await resolve("team-a", {"app": "db"}, {})).pool == "gold"
        got = await resolve("team-a", {}, {"ipam.cilium.io/ip-pool": "ghost"})
        assert got.pool == "default" and "unknown pool 'ghost'" in got.reason
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await resolve("strict", {}, {"ipam.cilium.io/ip-pool": "ghost"})
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "ghost" in (err.value.details() or "")
        await apply(
            channel,
            pool_yaml("any-db", ["10.251.28.0/22"],
                      extra=", podSelector: {matchLabels: {app: db}}"),
        )  # fmt: skip
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await resolve("team-a", {"app": "db"}, {})
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "any-db, gold" in (err.value.details() or "")
        by_name = await resolve("x", {}, {})
        assert by_name.pool == "default"


async def test_lan_overlap_is_refused_naming_node_interface_and_subnet(redis_url: str) -> None:
    async with running_operator(redis_url) as (op, channel):
        await register(channel, "office-node", [("eth1", "192.168.10.0/24")])
        before = await op.store.list("CiliumPodIPPool")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await apply(channel, pool_yaml("lan", ["192.168.8.0/22"]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert "node 'office-node'" in details and "interface eth1" in details
        assert "subnet 192.168.10.0/24" in details and "spec.ipv4.cidrs[0]" in details
        after = await op.store.list("CiliumPodIPPool")
        assert after.items == before.items  # nothing changed
        assert [p["metadata"]["name"] for p in after.items] == ["default"]
        with pytest.raises(grpc.aio.AioRpcError) as svc:
            await apply(channel, pool_yaml("svc", ["10.96.0.0/16"]))
        assert "service CIDR 10.96.0.0/12" in (svc.value.details() or "")


async def test_removing_an_in_use_cidr_drains_it_until_handed_back(redis_url: str) -> None:
    pools = ["default=ipv4-cidrs:10.251.0.0/24,10.251.1.0/24;ipv4-mask-size:24"]
    async with running_operator(redis_url, auto_create_cilium_pod_ip_pools=pools) as (
        op,
        channel,
    ):
        await register(channel, "d1")
        await demand(channel, "d1", 300)
        held = blocks(await allocation_until(channel, "d1", lambda a: len(blocks(a)) == 2))
        assert held == ["10.251.0.0/24", "10.251.1.0/24"]
        shrunk = pool_yaml("default", ["10.251.0.0/24"])
        dry = await apply(channel, shrunk, dry_run=True)
        assert any(
            "node d1: pool default CIDR 10.251.1.0/24 would start draining" in e
            for e in dry.effects
        )
        assert (await op.store.get("CiliumPodIPPool", "default"))["spec"]["ipv4"]["cidrs"] == [
            "10.251.0.0/24",
            "10.251.1.0/24",
        ]
        await apply(channel, shrunk)
        got = await allocation_until(channel, "d1", lambda a: a.draining)
        assert [list(p.cidrs) for p in got.draining] == [["10.251.1.0/24"]]
        assert blocks(got) == held  # running pods untouched
        st = await status(channel)
        [default] = [p for p in st.pools if p.name == "default"]
        assert list(default.draining_cidrs) == ["10.251.1.0/24"]
        assert list(default.cidrs) == ["10.251.0.0/24"]
        # No new block from the draining CIDR, even for a new node.
        await register(channel, "d2")
        await demand(channel, "d2", 10)
        d2 = await allocation_until(channel, "d2", lambda a: a.error)
        assert "exhausted" in d2.error and not blocks(d2)
        await demand(channel, "d1", 10, released=["10.251.1.0/24"])
        await allocation_until(channel, "d1", lambda a: not a.draining and len(blocks(a)) == 1)
        async with asyncio.timeout(10):
            while (
                (await op.store.get("CiliumPodIPPool", "default"))
                .get("status", {})
                .get("drainingCIDRs")
            ):
                await asyncio.sleep(0.05)
        assert not await op.store.list("CiliaIPAMBlock") or all(
            c["spec"]["cidr"] != "10.251.1.0/24"
            for c in (await op.store.list("CiliaIPAMBlock")).items
        )


async def test_a_draining_block_does_not_count_as_capacity_for_new_demand(
    redis_url: str,
) -> None:
    pools = ["blue=ipv4-cidrs:10.232.0.0/24,10.232.1.0/24;ipv4-mask-size:26"]
    async with running_operator(redis_url, auto_create_cilium_pod_ip_pools=pools) as (_, channel):
        await register(channel, "dr1")
        await demand(channel, "dr1", 1, pool="blue")
        first = await allocation_until(channel, "dr1", lambda a: a.pools)
        assert blocks(first) == ["10.232.0.0/26"]
        await apply(channel, pool_yaml("blue", ["10.232.1.0/24"], mask=26))
        await allocation_until(channel, "dr1", lambda a: a.draining)
        await demand(channel, "dr1", 2, pool="blue")
        got = await allocation_until(
            channel, "dr1", lambda a: any(c.startswith("10.232.1.") for c in blocks(a))
        )
        assert sorted(blocks(got)) == ["10.232.0.0/26", "10.232.1.0/26"]
        assert got.error == ""


async def test_mask_change_and_in_use_delete_are_refused_with_the_reason(redis_url: str) -> None:
    async with running_operator(redis_url) as (op, channel):
        await register(channel, "m1")
        await demand(channel, "m1", 1)
        await allocation_until(channel, "m1", lambda a: a.pools)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await apply(channel, pool_yaml("default", ["10.251.0.0/22"], mask=26))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot change IPv4 mask size in existing pool (24 -> 26)" in (
            err.value.details() or ""
        )
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await pb_grpc.ResourceServiceStub(channel).Delete(
                pb.DeleteRequest(kind="cpip", name="default")
            )
        assert gone.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        held = [str(b) for p in (await status(channel)).nodes[0].allocated for b in p.cidrs]
        # why (which node holds what and still requests addresses) and how long at most
        assert (
            f"is in use by node(s) m1: node m1 holds {held[0]} and requests 1 address(es) "
            "from it (pods of the pool on that node, or a pod add still waiting)"
        ) in (gone.value.details() or "")
        assert "at the latest its --ipam-pending-allocation-ttl (default 300 s) after the " \
            "failure" in (gone.value.details() or "")  # fmt: skip
        assert (await op.store.get("CiliumPodIPPool", "default"))["spec"]["ipv4"]["maskSize"] == 24


async def test_demand_returns_its_write_version_and_allocations_carry_allow_flags(
    redis_url: str,
) -> None:
    pools = ["default=ipv4-cidrs:10.251.0.0/24;ipv4-mask-size:26;allow-first-ip:true"]
    async with running_operator(redis_url, auto_create_cilium_pod_ip_pools=pools) as (
        op,
        channel,
    ):
        await register(channel, "f1")
        response = await pb_grpc.IPAMServiceStub(channel).UpdateDemand(
            pb.UpdateDemandRequest(
                node_name="f1", demands=[pb.PoolDemand(pool="default", needed_ipv4=10)]
            )
        )
        stored = await op.store.get("CiliumNode", "f1")
        assert int(response.resource_version) <= int(stored["metadata"]["resourceVersion"])
        assert stored["spec"]["ipam"]["pools"]["requested"][0]["needed"]["ipv4-addrs"] == 10
        got = await allocation_until(channel, "f1", lambda a: a.pools)
        [entry] = got.pools
        assert (entry.allow_first_ip, entry.allow_last_ip) == (True, False)
        assert int(got.resource_version) > int(response.resource_version)


async def test_adding_a_cidr_serves_waiting_demand_at_once(redis_url: str) -> None:
    pools = ["default=ipv4-cidrs:10.251.0.0/24;ipv4-mask-size:24"]
    async with running_operator(redis_url, auto_create_cilium_pod_ip_pools=pools) as (_, channel):
        await register(channel, "g1")
        await demand(channel, "g1", 300)
        assert "exhausted" in (await allocation_until(channel, "g1", lambda a: a.error)).error
        dry = await apply(channel, pool_yaml("default", ["10.251.0.0/24", "10.251.1.0/24"]), True)
        assert "pool default: CIDR 10.251.1.0/24 added: 1 new /24 blocks available at once" in (
            dry.effects
        )
        await apply(channel, pool_yaml("default", ["10.251.0.0/24", "10.251.1.0/24"]))
        got = await allocation_until(channel, "g1", lambda a: len(blocks(a)) == 2)
        assert got.error == ""


async def seed_cluster_pool_nodes(op: Operator, names: list[str]) -> dict[str, str]:
    """Node records as a cluster-pool operator left them (podCIDRs only)."""
    out = {}
    for i, name in enumerate(names):
        cidr = f"10.253.{i}.0/24"
        await op.store.create(
            {
                "apiVersion": "cilium.io/v2",
                "kind": "CiliumNode",
                "metadata": {"name": name},
                "spec": {"addresses": [], "ipam": {"podCIDRs": [cidr]}},
            }
        )
        out[name] = cidr
    return out


async def test_migration_adopts_every_pod_cidr_into_the_default_pool(redis_url: str) -> None:
    settings = {**CLUSTER, "cluster_pool_ipv4_cidr": ["10.253.0.0/16"]}
    async with running_operator(redis_url, **settings) as (op, channel):
        seeded = await seed_cluster_pool_nodes(op, ["m-a", "m-b", "m-c"])
        await op.controller.drain()
    migrate = {
        "ipam": "multi-pool",
        "enable_cluster_pool_to_multi_pool_migration": True,
        "cluster_pool_ipv4_cidr": ["10.253.0.0/16"],
        "auto_create_cilium_pod_ip_pools": [],
    }
    async with running_operator(redis_url, **migrate) as (op, channel):
        st = await status(channel)
        assert (st.migration, st.nodes_migrated, st.nodes_total) == ("done", 3, 3)
        pool = await op.store.get("CiliumPodIPPool", "default")
        assert pool["spec"]["ipv4"] == {"cidrs": ["10.253.0.0/16"], "maskSize": 24}
        for name, cidr in seeded.items():
            got = await allocation_until(channel, name, lambda a: a.pools)
            assert blocks(got) == [cidr] and not got.pod_cidrs and not got.draining
        await register(channel, "m-new")
        await demand(channel, "m-new", 10)
        fresh = blocks(await allocation_until(channel, "m-new", lambda a: a.pools))
        assert fresh and not set(fresh) & set(seeded.values())


async def test_migration_refuses_a_default_pool_with_another_mask(redis_url: str) -> None:
    async with running_operator(redis_url, auto_create_cilium_pod_ip_pools=[]) as (op, _):
        await seed_cluster_pool_nodes(op, ["x-a"])
    migrate = {
        "enable_cluster_pool_to_multi_pool_migration": True,
        "auto_create_cilium_pod_ip_pools": ["default=ipv4-cidrs:10.253.0.0/16;ipv4-mask-size:26"],
    }
    async with running_operator(redis_url, **migrate) as (op, channel):
        st = await status(channel)
        assert st.migration.startswith("failed: ") and "maskSize 26" in st.migration
        assert not st.leader
        record = await op.store.get("CiliumNode", "x-a")
        assert record["spec"]["ipam"]["podCIDRs"] == ["10.253.0.0/24"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cilia_operator", *args], capture_output=True, text=True, timeout=30
    )


def test_cli_ipam_plan_offline_prints_blocks_and_pod_ips() -> None:
    offline = run_cli("ipam", "plan", "--cidr", "172.24.0.0/20", "--mask-size", "24", "--offline")
    assert offline.returncode == 0
    assert "node blocks:        16" in offline.stdout
    assert "IPs per block:      254" in offline.stdout
    # the agent's router IP is the first usable address of a node's first block
    assert "pod IPs per node:   253" in offline.stdout
    assert "pod IPs in total:   4048" in offline.stdout
    both = run_cli(
        "ipam", "plan", "--cidr", "172.24.0.0/20", "--mask-size", "24",
        "--allow-first-ip", "--allow-last-ip", "--offline",
    )  # fmt: skip
    assert "pod IPs per node:   255" in both.stdout


def test_cli_plan_with_unreachable_operator_falls_back_to_offline_checks() -> None:
    with procs.refused_address() as server:
        overlap = run_cli(
            "ipam", "plan", "--cidr", "10.96.0.0/16", "--mask-size", "24", "--server", server,
            "--service-cluster-ip-range", "10.96.0.0/12", "--timeout", "2",
        )  # fmt: skip
        assert overlap.returncode == 1, overlap.stdout + overlap.stderr
        assert f"live check skipped: cannot reach operator at {server}" in overlap.stdout
        assert "falling back to the offline checks" in overlap.stdout
        assert "service CIDRs:      10.96.0.0/12 (offline: operator unreachable)" in overlap.stdout
        assert "10.96.0.0/16 overlaps the service CIDR 10.96.0.0/12" in overlap.stdout
        default = run_cli(
            "ipam", "plan", "--cidr", "10.100.0.0/24", "--mask-size", "26", "--server", server,
            "--timeout", "2",
        )  # fmt: skip
        assert default.returncode == 1 and "service CIDR 10.96.0.0/12" in default.stdout
        fits = run_cli(
            "ipam", "plan", "--cidr", "172.24.0.0/20", "--mask-size", "24", "--server", server,
            "--timeout", "2",
        )  # fmt: skip
        assert fits.returncode == 0, fits.stdout
        assert "offline: operator unreachable" in fits.stdout and "fits:" in fits.stdout


def test_cli_plan_takes_a_comma_list_of_service_cidrs_like_the_operator() -> None:
    got = run_cli(
        "ipam", "plan", "--cidr", "10.200.8.0/22", "--mask-size", "24", "--offline",
        "--service-cluster-ip-range", "10.96.0.0/12,10.200.0.0/16",
    )  # fmt: skip
    assert got.returncode == 1, got.stderr
    assert "service CIDRs:      10.96.0.0/12, 10.200.0.0/16 (offline)" in got.stdout
    assert "10.200.8.0/22 overlaps the service CIDR 10.200.0.0/16" in got.stdout
    bad = run_cli(
        "ipam", "plan", "--cidr", "10.1.0.0/16", "--mask-size", "24", "--offline",
        "--service-cluster-ip-range", "10.96.0.0/12,nonsense",
    )  # fmt: skip
    assert bad.returncode == 2
    assert "--service-cluster-ip-range: 'nonsense' is not an IPv4 CIDR" in bad.stderr


def test_cli_plan_takes_apply_s_rule_for_mask_32_a_non_default_pool_may_use_it() -> None:
    got = run_cli("ipam", "plan", "--cidr", "10.1.0.0/28", "--mask-size", "32", "--offline",
                  "--pool", "single")  # fmt: skip
    assert got.returncode == 0, got.stdout + got.stderr
    assert "node blocks:        16" in got.stdout
    assert "pod IPs per node:   1 per block, one block per pod" in got.stdout
    other = run_cli("ipam", "plan", "--cidr", "10.1.0.0/28", "--mask-size", "32", "--offline",
                    "--pool", "default", "--ipam-default-ip-pool", "main")  # fmt: skip
    assert other.returncode == 0, other.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--server", "garbage::"], "--server: 'garbage::' is not an operator address"),
        (["--server", "127.0.0.1"], "no port"),
        (["--server", "127.0.0.1:99999"], "not in 1..65535"),
        (["--mask-size", "32", "--offline", "--pool", "default"],
         "--mask-size: a /32 block of the default pool 'default' leaves no pod address"),
        (["--cidr", "127.0.0.0/16", "--offline"], "overlaps the loopback range 127.0.0.0/8"),
        (["--cidr", "224.0.0.0/16", "--offline"], "overlaps the multicast range 224.0.0.0/4"),
        (["--cidr", "169.254.0.0/16", "--offline"], "link-local range 169.254.0.0/16"),
    ],
    ids=["server-garbage", "server-no-port", "server-port", "mask-32", "loopback", "multicast",
         "link-local"],
)  # fmt: skip
def test_cli_plan_usage_errors(args: list[str], message: str) -> None:
    """Exit 2 with one line naming the flag, like apply refusing the same pool."""
    cidr = [] if "--cidr" in args else ["--cidr", "10.1.0.0/16"]
    mask = [] if "--mask-size" in args else ["--mask-size", "24"]
    got = run_cli("ipam", "plan", *cidr, *mask, *args)
    assert got.returncode == 2, got.stdout + got.stderr
    assert message in got.stderr and "Traceback" not in got.stderr, got.stderr
    assert got.stdout == ""


@pytest.mark.parametrize(
    "server",
    ["127.0.0.1:4250", "localhost:4250", "op.kube-system.svc.cluster.local:4250", "[::1]:4250",
     "dns:///operator:4250", "unix:/run/cilia/operator.sock", "unix:///run/op.sock"],
)  # fmt: skip
def test_cli_server_forms_accepted(server: str) -> None:
    assert cli.check_server(server) == server


def client(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, str]:
    """Run a real client command of ``cilia_operator.cli`` (sync gRPC) and its output."""
    out = io.StringIO()
    return fn(*args, out=out, **kwargs), out.getvalue()


async def test_cli_ipam_plan_status_and_dry_run_effects(redis_url: str, tmp_path: Any) -> None:
    async with running_operator(redis_url) as (op, channel):
        await register(channel, "p1", [("eth1", "172.24.3.0/24")])
        await register(channel, "p2")
        server = {"server": op.address, "timeout": 10.0}
        problems, live = await asyncio.to_thread(
            client, cli.ipam_plan, ["172.24.0.0/20"], 24, False, False, **server
        )
        assert problems == 1
        assert "node 'p1' interface eth1 subnet 172.24.3.0/24" in live
        _, small = await asyncio.to_thread(
            client, cli.ipam_plan, ["10.251.0.0/24"], 24, False, False, **server
        )
        assert "overlaps pool 'default'" in small
        assert "1 of 2 nodes would not get a block" in small
        await demand(channel, "p1", 1)
        await allocation_until(channel, "p1", lambda a: a.pools)
        edit = tmp_path / "grow.yaml"
        edit.write_text(pool_yaml("default", ["10.251.0.0/22", "10.251.4.0/24"]))
        _, dry = await asyncio.to_thread(client, cli.apply, str(edit), op.address, True, 10.0)
        assert dry == (
            "ciliumpodippool.cilium.io/default configured (dry run)\n"
            "  pool default: CIDR 10.251.4.0/24 added: 1 new /24 blocks available at once\n"
        )
        await register(channel, "p3", [("eth9", "10.251.3.0/24")])  # after the pool
        shown = await asyncio.to_thread(run_cli, "ipam", "status", "--server", op.address)
        assert shown.returncode == 0
        assert "mode: multi-pool" in shown.stdout and "default:10.251.0.0/24" in shown.stdout
        assert "service CIDRs: 10.96.0.0/12" in shown.stdout
        assert (
            "conflict: pool default: 10.251.0.0/22 overlaps node 'p3' interface eth9 subnet "
            "10.251.3.0/24"
        ) in shown.stdout
        _, raw = await asyncio.to_thread(client, cli.ipam_status, output="json", **server)
        data = json.loads(raw)
        assert data["pools"][0]["name"] == "default"
        # numbers as JSON numbers, zero/empty fields present (scripts index them)
        assert data["pools"][0]["blocksTotal"] == 4 and data["pools"][0]["blocksAllocated"] == 1
        assert data["pools"][0]["drainingCidrs"] == []
        assert data["migration"] == "" and data["nodesMigrated"] == 0
        assert data["serviceCidrs"] == ["10.96.0.0/12"]
        errors = {n["nodeName"]: n["error"] for n in data["nodes"]}
        assert (errors["p1"], errors["p2"]) == ("", "")
        # a network reported after the pool is a conflict on the node (issue 16)
        assert errors["p3"].startswith(
            "interface eth9 subnet 10.251.3.0/24 overlaps pool 'default' CIDR 10.251.0.0/22"
        )


async def test_cli_ipam_plan_refuses_what_apply_refuses(redis_url: str) -> None:
    async with running_operator(redis_url) as (op, _):
        server = {"server": op.address, "timeout": 10.0}
        problems, svc = await asyncio.to_thread(
            client, cli.ipam_plan, ["10.100.0.0/24"], 26, False, False, **server
        )
        assert problems == 1
        assert "overlaps the service CIDR 10.96.0.0/12" in svc and "fits" not in svc
        problems, mask = await asyncio.to_thread(
            client, cli.ipam_plan, ["10.251.0.0/24"], 26, False, False, pool="default", **server
        )
        assert problems == 1
        assert "cannot change IPv4 mask size in existing pool 'default' (24 -> 26)" in mask
        with pytest.raises(
            cli.CommandError, match=r"10\.240\.0\.0/25 overlaps --cidr 10\.240\.0\.0/24"
        ):
            await asyncio.to_thread(
                client, cli.ipam_plan, ["10.240.0.0/24", "10.240.0.0/25"], 26, False, False,
                **server,
            )  # fmt: skip


async def test_cli_ipam_plan_checks_the_operators_own_service_cidrs(redis_url: str) -> None:
    async with running_operator(redis_url, service_cluster_ip_range=["10.200.0.0/16"]) as (
        op,
        channel,
    ):
        assert list((await status(channel)).service_cidrs) == ["10.200.0.0/16"]
        refused = await asyncio.to_thread(
            run_cli, "ipam", "plan", "--cidr", "10.200.8.0/22", "--mask-size", "24",
            "--server", op.address,
        )  # fmt: skip
        assert refused.returncode == 1, refused.stderr
        assert "10.200.8.0/22 overlaps the service CIDR 10.200.0.0/16" in refused.stdout
        assert "service CIDRs:      10.200.0.0/16" in refused.stdout
        # the operator's range replaces the 10.96.0.0/12 default: this one fits
        fits = await asyncio.to_thread(
            run_cli, "ipam", "plan", "--cidr", "10.100.0.0/24", "--mask-size", "26",
            "--server", op.address,
        )  # fmt: skip
        assert fits.returncode == 0, fits.stdout + fits.stderr
        assert "fits:" in fits.stdout
        # an extra --service-cluster-ip-range is checked as well as the operator's
        extra = await asyncio.to_thread(
            run_cli, "ipam", "plan", "--cidr", "10.100.0.0/24", "--mask-size", "26",
            "--service-cluster-ip-range", "10.100.0.0/20", "--server", op.address,
        )  # fmt: skip
        assert extra.returncode == 1 and "service CIDR 10.100.0.0/20" in extra.stdout


def test_cli_offline_plan_checks_the_default_service_cidr() -> None:
    got = run_cli("ipam", "plan", "--cidr", "10.100.0.0/24", "--mask-size", "26", "--offline")
    assert got.returncode == 1
    assert "10.100.0.0/24 overlaps the service CIDR 10.96.0.0/12" in got.stdout


def test_cli_offline_plan_refuses_overlapping_cidrs_and_bad_timeouts() -> None:
    both = run_cli(
        "ipam", "plan", "--cidr", "10.240.0.0/24", "--cidr", "10.240.0.0/25",
        "--mask-size", "26", "--offline",
    )  # fmt: skip
    assert both.returncode == 2 and "overlaps --cidr 10.240.0.0/24" in both.stderr
    for bad, why in (("0", "> 0"), ("-1", "> 0"), ("nan", "not a duration"),
                     ("inf", "not a duration")):  # fmt: skip
        got = run_cli("ipam", "status", "--timeout", bad)
        assert got.returncode == 2 and "--timeout" in got.stderr and why in got.stderr, bad
        assert "Traceback" not in got.stderr


def test_cli_output_into_a_closed_pipe_exits_quietly() -> None:
    reader, writer = os.pipe()
    os.close(reader)
    try:
        got = subprocess.run(
            [sys.executable, "-m", "cilia_operator", "ipam", "plan", "--cidr", "172.24.0.0/20",
             "--mask-size", "24", "--offline"],
            stdout=writer, stderr=subprocess.PIPE, text=True, timeout=30,
        )  # fmt: skip
    finally:
        os.close(writer)
    assert "Traceback" not in got.stderr and "BrokenPipe" not in got.stderr
    assert got.returncode != 0


async def test_apply_refuses_a_mask_leaving_no_pod_address_and_dry_run_counts_like_plan(
    redis_url: str,
) -> None:
    """apply -f refuses maskSize 32 for the default pool (the agent's router IP takes the
    block's only address)
    naming the pool and field, writes nothing; the dry run's pod IPs per block are plan's."""
    async with running_operator(redis_url) as (op, channel):
        for extra in ("", ", allowFirstIP: true, allowLastIP: true"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await apply(channel, pool_yaml("default", ["10.233.0.0/24"], mask=32, extra=extra))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = err.value.details() or ""
            assert "CiliumPodIPPool default" in details and "spec.ipv4.maskSize" in details
            assert "no pod address left" in details and "router IP" in details
        assert [p["metadata"]["name"] for p in (await op.store.list("CiliumPodIPPool")).items] == [
            "default"
        ]
        # /31 keeps both addresses: router + 1 pod, accepted.
        await apply(channel, pool_yaml("pair", ["10.233.1.0/24"], mask=31))
        for mask, extra in ((26, ""), (30, ""), (30, ", allowFirstIP: true"), (31, "")):
            first = "allowFirstIP" in extra
            plan = plan_numbers([ipaddress.IPv4Network("10.233.2.0/24")], mask, first, False)
            dry = await apply(
                channel, pool_yaml("new", ["10.233.2.0/24"], mask=mask, extra=extra), True
            )
            assert (
                f"pool new: created with {plan.blocks} blocks of /{mask} "
                f"({plan.pods_per_node} pod IPs each: {plan.usable_per_block} usable, the "
                "agent's router IP takes one)"
            ) in dry.effects
        assert (mask, plan.pods_per_node) == (31, 1)
        names = {p["metadata"]["name"] for p in (await op.store.list("CiliumPodIPPool")).items}
        assert names == {"default", "pair"}


async def test_a_deleted_nodes_blocks_are_held_for_the_grace_period_then_released(
    redis_url: str,
) -> None:
    async with running_operator(redis_url, node_cidr_release_grace_period=1.5) as (op, channel):
        await register(channel, "leaving")
        await demand(channel, "leaving", 10)
        held = blocks(await allocation_until(channel, "leaving", lambda a: a.pools))
        assert held
        await op.store.delete("CiliumNode", "leaving")
        await asyncio.sleep(0.5)
        await op.controller.drain()
        assert op.controller.allocator.node_blocks("leaving"), "released before the grace ended"
        async with asyncio.timeout(10):
            while op.controller.allocator.node_blocks("leaving"):
                await asyncio.sleep(0.1)
        # the released blocks are free again: a new node gets the same range
        await register(channel, "arriving")
        await demand(channel, "arriving", 10)
        fresh = blocks(await allocation_until(channel, "arriving", lambda a: a.pools))
        assert fresh == held


async def test_a_node_registering_again_within_the_grace_period_keeps_its_blocks(
    redis_url: str,
) -> None:
    async with running_operator(redis_url, node_cidr_release_grace_period=30) as (op, channel):
        await register(channel, "flapping")
        await demand(channel, "flapping", 10)
        held = blocks(await allocation_until(channel, "flapping", lambda a: a.pools))
        await op.store.delete("CiliumNode", "flapping")
        await op.controller.drain()
        # held: another node asking now does not get them (released at once, it would:
        # the allocator hands out the first free block, see the test above)
        await register(channel, "other")
        await demand(channel, "other", 10)
        other = blocks(await allocation_until(channel, "other", lambda a: a.pools))
        assert not set(other) & set(held)
        await register(channel, "flapping")
        await demand(channel, "flapping", 10)
        again = blocks(await allocation_until(channel, "flapping", lambda a: a.pools))
        assert again == held
