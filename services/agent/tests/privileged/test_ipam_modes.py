"""IPAM modes against a stand-in operator speaking the real contract over TCP gRPC.

Multi-pool: each pod's pool from ResolvePool (not cached), an exhausted pool as CNI error
101 naming the pool (real ``cilia-cni`` binary), draining CIDRs, operator refusals and
outages. Cluster-pool: addresses from podCIDRs, no demand; the switch to multi-pool after
the operator adopted the podCIDRs into the default pool keeps every address.
Registration: local networks cover every interface subnet except the agents' devices.
"""

from __future__ import annotations

import ipaddress
import json
import queue
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from cilia.agent.v1 import agent_pb2
from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc
from cilia_testkit import cni

from .conftest import AgentThread, Env


class Operator(cp_grpc.NodeServiceServicer, cp_grpc.IPAMServiceServicer):  # type: ignore[misc]
    """Stand-in: Register (announces ``mode``), UpdateDemand (recorded), WatchAllocations
    (``allocation`` now, then what tests put on ``updates``), ResolvePool (``pool_of`` by pod
    name, else "default"; ``refuse`` answers FAILED_PRECONDITION)."""

    def __init__(self, mode: str, allocation: cp.NodeAllocation) -> None:
        self.mode = mode
        self.allocation = allocation
        self.registrations: list[cp.RegisterRequest] = []
        self.demands: list[cp.UpdateDemandRequest] = []
        self.resolves: list[cp.ResolvePoolRequest] = []
        self.pool_of: dict[str, str] = {}
        self.refuse = ""
        self.updates: queue.Queue[cp.NodeAllocation | None] = queue.Queue()
        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        cp_grpc.add_NodeServiceServicer_to_server(self, self.server)
        cp_grpc.add_IPAMServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Register(self, request: cp.RegisterRequest, context: Any) -> cp.RegisterResponse:  # noqa: N802
        self.registrations.append(request)
        return cp.RegisterResponse(default_pool="default", ipam_mode=self.mode)

    def UpdateDemand(  # noqa: N802
        self, request: cp.UpdateDemandRequest, context: Any
    ) -> cp.UpdateDemandResponse:
        self.demands.append(request)
        return cp.UpdateDemandResponse()

    def ResolvePool(  # noqa: N802
        self, request: cp.ResolvePoolRequest, context: Any
    ) -> cp.ResolvePoolResponse:
        self.resolves.append(request)
        if self.refuse:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse)
        pool = self.pool_of.get(request.pod_name, "default")
        return cp.ResolvePoolResponse(pool=pool, reason="test table")

    def WatchAllocations(  # noqa: N802
        self, request: cp.WatchAllocationsRequest, context: Any
    ) -> Iterator[cp.WatchAllocationsResponse]:
        yield cp.WatchAllocationsResponse(allocation=self.allocation)
        while context.is_active():
            try:
                item = self.updates.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            self.allocation = item
            yield cp.WatchAllocationsResponse(allocation=item)

    def stop(self) -> None:
        self.updates.put(None)
        self.server.stop(0)


def wait(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
def cidrs(env: Env) -> list[str]:
    """Four distinct /24s in the privileged tests' range, the first is env.cidr."""
    third = int(env.cidr.split(".")[2])
    return [f"10.251.{(third + i - 1) % 250 + 1}.0/24" for i in range(4)]


def start(env: Env, op: Operator, **overrides: Any) -> AgentThread:
    a = env.start_agent(
        static={},
        operator=op.address,
        operator_reconnect_min_backoff=0.1,
        operator_reconnect_max_backoff=0.5,
        **overrides,
    )
    wait(lambda: a.debug.Status(agent_pb2.StatusRequest()).ready)
    return a


def add(a: AgentThread, env: Env, name: str, pool: str = "") -> ipaddress.IPv4Address:
    resp = a.attach.Add(
        agent_pb2.AddRequest(
            container_id=name,
            ifname="eth0",
            netns=env.add_netns(),
            pod_namespace="ns1",
            pod_name=name,
            labels={"app": name},
            pool=pool,
        ),
        timeout=10,
    )
    return ipaddress.IPv4Interface(resp.ips[0].address).ip


def alloc(node: str, pools: dict[str, list[str]], **kw: Any) -> cp.NodeAllocation:
    return cp.NodeAllocation(
        node_name=node, pools=[cp.PoolCIDRs(pool=p, cidrs=c) for p, c in pools.items()], **kw
    )


def cni_add(env: Env, name: str) -> cni.CniOutcome:
    conf = json.loads((env.tmp / "net.d" / "05-cilia.conflist").read_text())
    netns = env.add_netns()
    container = secrets.token_hex(8)
    return cni.invoke(
        "ADD",
        stdin=json.dumps(cni.plugin_netconf(conf)),
        container_id=container,
        netns=netns,
        args=cni.cni_args("ns1", name, container),
    )


def test_each_pod_gets_the_pool_the_operator_resolves_and_an_exhausted_pool_is_cni_error_101(
    env: Env, cidrs: list[str]
) -> None:
    node = f"test-{env.tag}"
    blue = cidrs[1].replace(".0/24", ".0/30")  # 2 usable addresses
    op = Operator("multi-pool", alloc(node, {"default": [cidrs[0]]}))
    try:
        a = start(env, op, ipam_multi_pool_pre_allocation={"default": 8}, ipam_allocation_wait=2.0)
        op.pool_of["blue-1"] = "blue"

        # blue has no CIDR on this node yet: the ADD sends the demand at once and waits for
        # the operator's allocation, which the stand-in delivers a moment later.
        def deliver() -> None:
            wait(lambda: any(d.pool == "blue" for r in op.demands for d in r.demands))
            time.sleep(0.3)
            op.updates.put(alloc(node, {"default": [cidrs[0]], "blue": [blue]}))

        late = threading.Thread(target=deliver, daemon=True)
        late.start()
        got = cni_add(env, "blue-1")
        late.join()
        assert got.returncode == 0, got.stdout
        assert ipaddress.IPv4Interface(got.json["ips"][0]["address"]).ip in ipaddress.ip_network(
            blue
        )
        assert any(d.pool == "blue" and d.needed_ipv4 == 1 for r in op.demands for d in r.demands)
        req = op.resolves[-1]
        assert (req.node_name, req.pod_namespace, req.pod_name) == (node, "ns1", "blue-1")
        # Not cached: the next pod of the same name pattern follows the operator's new answer.
        assert add(a, env, "plain") in ipaddress.ip_network(cidrs[0])
        op.pool_of["plain-2"] = "blue"
        assert add(a, env, "plain-2") in ipaddress.ip_network(blue)
        assert op.resolves[-1].pod_labels == {"app": "plain-2"}
        # blue is full and the operator has not (yet) said it is exhausted: retry (code 11).
        op.pool_of["blue-3"] = "blue"
        third = cni_add(env, "blue-3")
        assert third.returncode != 0 and third.json["code"] == 11, third.stdout
        assert "pool 'blue': all addresses of" in third.json["msg"], third.stdout
        assert "waiting for the operator to allocate another CIDR" in third.json["msg"]
        # The operator could not add a block either: its reason reaches the CNI error.
        exhausted = "pool 'blue' exhausted: no free /30 block left in 10.251.9.0/30"
        op.updates.put(alloc(node, {"default": [cidrs[0]], "blue": [blue]}, error=exhausted))
        wait(lambda: a.agent.pools.operator_error == exhausted)
        fourth = cni_add(env, "blue-3")
        assert fourth.json["code"] == 101, fourth.stdout
        assert f"operator: {exhausted}" in fourth.json["msg"], fourth.stdout
        # An explicit pool in the request is used as is (no ResolvePool call).
        n = len(op.resolves)
        assert add(a, env, "explicit", pool="default") in ipaddress.ip_network(cidrs[0])
        assert len(op.resolves) == n
    finally:
        op.stop()


def test_a_pool_the_operator_never_allocates_is_unavailable_within_the_wait(
    env: Env, cidrs: list[str]
) -> None:
    node = f"test-{env.tag}"
    op = Operator("multi-pool", alloc(node, {"default": [cidrs[0]]}))
    try:
        a = start(env, op, ipam_allocation_wait=0.5)
        op.pool_of["green-1"] = "green"
        with pytest.raises(grpc.RpcError) as pending:
            add(a, env, "green-1")
        assert pending.value.code() == grpc.StatusCode.UNAVAILABLE
        assert pending.value.details() == (
            "pool 'green': waiting for the operator to allocate a CIDR to this node "
            "(waited 0.5 s); retry"
        )
        assert any(d.pool == "green" for r in op.demands for d in r.demands)  # demand sent
        assert not a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
        # The real plugin maps it to "try again later".
        cni = cni_add(env, "green-1")
        assert cni.returncode != 0 and cni.json["code"] == 11, cni.stdout
    finally:
        op.stop()


@pytest.mark.parametrize(("ended_by", "ttl"), [("del", 300.0), ("ttl", 1.0)])
def test_a_failed_adds_demand_ends_at_its_del_or_its_ttl_and_the_pool_is_handed_back(
    env: Env, cidrs: list[str], ended_by: str, ttl: float
) -> None:
    """A pod add that failed (no CIDR of its pool yet) keeps requesting an address of the
    pool; its DEL ends that request at once (well before the 300 s TTL), and a request
    nobody deletes ends with its --ipam-pending-allocation-ttl: either way the agent sends
    the smaller demand and hands the pool's CIDR back (so the operator lets the pool be
    deleted) without waiting for another pod change."""
    node = f"test-{env.tag}"
    op = Operator("multi-pool", alloc(node, {"default": [cidrs[0]]}))
    try:
        a = start(env, op, ipam_allocation_wait=0.2, ipam_pending_allocation_ttl=ttl)

        def green_wanted() -> int:
            return sum(d.needed_ipv4 for d in op.demands[-1].demands if d.pool == "green")

        def handed_back() -> bool:
            return cp.PoolCIDRs(pool="green", cidrs=[cidrs[2]]) in op.demands[-1].released

        op.pool_of["green-1"] = "green"
        with pytest.raises(grpc.RpcError) as failed:
            add(a, env, "green-1")
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        if ended_by == "del":
            wait(lambda: green_wanted() == 1)
        # the operator's block arrives after the add gave up: held for the pending request
        op.updates.put(alloc(node, {"default": [cidrs[0]], "green": [cidrs[2]]}))
        wait(lambda: a.agent.ipam.cidrs().get("green") == [cidrs[2]] or handed_back())
        if ended_by == "del":
            assert green_wanted() == 1 and not handed_back()
            a.attach.Del(agent_pb2.DelRequest(container_id="green-1", ifname="eth0"), timeout=10)
            assert "green" not in a.agent.ipam.demand(["default"])  # at once, not in 300 s
        wait(lambda: green_wanted() == 0 and handed_back())
        assert not a.agent.ipam.cidrs().get("green")
    finally:
        op.stop()


def test_pool_refused_by_the_operator_or_operator_down_changes_nothing(
    env: Env, cidrs: list[str]
) -> None:
    node = f"test-{env.tag}"
    op = Operator("multi-pool", alloc(node, {"default": [cidrs[0]]}))
    try:
        a = start(env, op)
        op.refuse = "pods ns1/x match the selectors of pools blue and green"
        with pytest.raises(grpc.RpcError) as refused:
            add(a, env, "x")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "pool: no IPAM pool for pod ns1/x" in refused.value.details()
        assert "blue and green" in refused.value.details()
        op.stop()
        with pytest.raises(grpc.RpcError) as down:
            add(a, env, "y")
        assert down.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"ResolvePool at operator {op.address} failed" in down.value.details()
        assert not a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
        assert a.debug.Status(agent_pb2.StatusRequest()).pools[0].used == 1  # the router
    finally:
        op.stop()


def test_draining_cidr_keeps_its_pods_gives_no_new_address_and_is_handed_back_once_empty(
    env: Env, cidrs: list[str]
) -> None:
    node = f"test-{env.tag}"
    op = Operator("multi-pool", alloc(node, {"default": [cidrs[0]], "blue": [cidrs[1]]}))
    try:
        a = start(env, op, ipam_multi_pool_pre_allocation={"default": 8, "blue": 8})
        old = add(a, env, "old", pool="blue")
        assert old in ipaddress.ip_network(cidrs[1])
        # The operator removed cidrs[1] from pool blue while in use and added cidrs[2].
        op.updates.put(
            alloc(
                node,
                {"default": [cidrs[0]], "blue": [cidrs[1], cidrs[2]]},
                draining=[cp.PoolCIDRs(pool="blue", cidrs=[cidrs[1]])],
            )
        )
        wait(lambda: "draining: blue " + cidrs[1] in a.agent.status.collect().message)
        status = {p.pool: p for p in a.debug.Status(agent_pb2.StatusRequest()).pools}
        assert list(status["blue"].draining_cidrs) == [cidrs[1]]
        assert list(status["default"].draining_cidrs) == []
        for i in range(3):
            assert add(a, env, f"new{i}", pool="blue") in ipaddress.ip_network(cidrs[2])
        assert not any(r.released for r in op.demands)
        assert any(e.ipv4 == str(old) for e in a.debug.ListEndpoints(
            agent_pb2.ListEndpointsRequest()).endpoints)  # fmt: skip
        a.attach.Del(agent_pb2.DelRequest(container_id="old", ifname="eth0"), timeout=10)
        wait(lambda: cp.PoolCIDRs(pool="blue", cidrs=[cidrs[1]]) in op.demands[-1].released)
        pools = {p.pool: list(p.cidrs) for p in a.debug.Status(agent_pb2.StatusRequest()).pools}
        assert pools["blue"] == [cidrs[2]]
    finally:
        op.stop()


def test_router_ip_leaves_a_draining_cidr_without_a_lost_packet_and_the_cidr_is_handed_back(
    env: Env, cidrs: list[str]
) -> None:
    node = f"test-{env.tag}"
    op = Operator("multi-pool", alloc(node, {"default": [cidrs[0]]}))
    try:
        a = start(env, op)
        old_router = ipaddress.ip_address(a.debug.Status(agent_pb2.StatusRequest()).router_ip)
        assert old_router in ipaddress.ip_network(cidrs[0])
        netns: dict[str, str] = {}
        for name in ("p1", "p2"):
            path = env.add_netns()
            a.attach.Add(
                agent_pb2.AddRequest(
                    container_id=name, ifname="eth0", netns=path, pod_namespace="ns1",
                    pod_name=name, labels={"app": name},
                ),
                timeout=10,
            )  # fmt: skip
            netns[name] = path.rsplit("/", 1)[1]
        p2 = next(
            e.ipv4
            for e in a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
            if e.container_id == "p2"
        )
        # 100 packets/s through the router for the whole move
        flood = subprocess.Popen(
            ["ip", "netns", "exec", netns["p1"], "ping", "-q", "-i", "0.01", "-c", "500", p2],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(1)
        # cidrs[0] leaves the default pool (e.g. it clashes with the LAN); cidrs[1] joins
        op.updates.put(
            alloc(
                node,
                {"default": [cidrs[0], cidrs[1]]},
                draining=[cp.PoolCIDRs(pool="default", cidrs=[cidrs[0]])],
            )
        )

        def router() -> ipaddress.IPv4Address | ipaddress.IPv6Address:
            return ipaddress.ip_address(a.debug.Status(agent_pb2.StatusRequest()).router_ip)

        wait(lambda: router() in ipaddress.ip_network(cidrs[1]))

        def default_route(name: str) -> str:
            return subprocess.run(
                ["ip", "-n", netns[name], "route", "show", "default"],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip

        # every pod's gateway is repointed in place, then the old address leaves the node
        wait(lambda: all(f"via {router()} " in default_route(n) for n in netns))

        def host_addresses() -> str:
            return subprocess.run(
                ["ip", "-4", "addr", "show", "dev", env.host_device],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip

        wait(lambda: f"{old_router}/32" not in host_addresses())
        assert f"{router()}/32" in host_addresses()
        out, _ = flood.communicate(timeout=30)
        assert "500 packets transmitted, 500 received" in out, out
        assert not any(r.released for r in op.demands), "pods still hold the old CIDR"
        for name in ("p1", "p2"):
            a.attach.Del(agent_pb2.DelRequest(container_id=name, ifname="eth0"), timeout=10)
        wait(lambda: cp.PoolCIDRs(pool="default", cidrs=[cidrs[0]]) in op.demands[-1].released)
        pools = {p.pool: list(p.cidrs) for p in a.debug.Status(agent_pb2.StatusRequest()).pools}
        assert pools["default"] == [cidrs[1]]
    finally:
        op.stop()


def test_pool_allowing_first_and_last_ip_hands_out_every_address_of_its_cidr(
    env: Env, cidrs: list[str]
) -> None:
    node = f"test-{env.tag}"
    blue = ipaddress.ip_network(cidrs[1].replace(".0/24", ".0/30"))
    allocation = cp.NodeAllocation(
        node_name=node,
        pools=[
            cp.PoolCIDRs(pool="default", cidrs=[cidrs[0]]),
            cp.PoolCIDRs(pool="blue", cidrs=[str(blue)], allow_first_ip=True, allow_last_ip=True),
        ],
    )
    op = Operator("multi-pool", allocation)
    try:
        a = start(
            env,
            op,
            ipam_multi_pool_pre_allocation={"default": 8, "blue": 4},
            ipam_allocation_wait=0.2,
        )
        status = {p.pool: p for p in a.debug.Status(agent_pb2.StatusRequest()).pools}
        assert (status["blue"].capacity, status["default"].capacity) == (4, 254)
        got = {add(a, env, f"b{i}", pool="blue") for i in range(4)}
        assert got == set(blue)  # network and broadcast address included
        with pytest.raises(grpc.RpcError) as full:
            add(a, env, "b4", pool="blue")
        assert full.value.code() == grpc.StatusCode.UNAVAILABLE  # not exhausted per the operator
        assert f"pool 'blue': all addresses of {blue} in use" in full.value.details()
        # Demand 4 is exactly covered: nothing handed back.
        assert not any(r.released for r in op.demands)
    finally:
        op.stop()


def test_a_pool_of_single_address_blocks_gives_each_pod_one_and_takes_them_back(
    env: Env, cidrs: list[str]
) -> None:
    node = f"test-{env.tag}"
    # maskSize 32 (a non-default pool): the operator hands the node one /32 block per
    # address it asks for; the pods' Adds wait for them (--ipam-allocation-wait)
    singles = [str(a) + "/32" for a in list(ipaddress.ip_network(cidrs[1]).hosts())[:4]]
    op = Operator("multi-pool", alloc(node, {"default": [cidrs[0]]}))
    try:
        a = start(
            env,
            op,
            ipam_multi_pool_pre_allocation={"default": 8, "single": 0},
            ipam_allocation_wait=20,
        )
        with futures.ThreadPoolExecutor(4) as pool:
            adds = [pool.submit(add, a, env, f"s{i}", "single") for i in range(4)]
            wait(lambda: any(
                d.needed_ipv4 >= 4 for r in op.demands for d in r.demands if d.pool == "single"
            ))  # fmt: skip
            op.updates.put(alloc(node, {"default": [cidrs[0]], "single": singles}))
            got = {f.result(timeout=30) for f in adds}
        assert got == {ipaddress.ip_interface(c).ip for c in singles}
        status = {p.pool: p for p in a.debug.Status(agent_pb2.StatusRequest()).pools}
        assert (status["single"].capacity, status["single"].used) == (4, 4)
        router = ipaddress.ip_address(a.debug.Status(agent_pb2.StatusRequest()).router_ip)
        assert router in ipaddress.ip_network(cidrs[0]), "the router comes from the default pool"
        for i in range(4):
            a.attach.Del(agent_pb2.DelRequest(container_id=f"s{i}", ifname="eth0"), timeout=10)
        # nothing needed in the pool any more: every /32 goes back to the operator
        wait(lambda: sorted(c for p in op.demands[-1].released if p.pool == "single"
                            for c in p.cidrs) == sorted(singles))  # fmt: skip
    finally:
        op.stop()


def test_cluster_pool_then_switch_to_multi_pool_after_migration_keeps_every_address(
    env: Env, cidrs: list[str]
) -> None:
    node = f"test-{env.tag}"
    op = Operator("cluster-pool", cp.NodeAllocation(node_name=node, pod_cidrs=[cidrs[0]]))
    try:
        a = start(env, op, ipam="cluster-pool")
        ips = {f"p{i}": add(a, env, f"p{i}") for i in range(3)}
        assert all(ip in ipaddress.ip_network(cidrs[0]) for ip in ips.values())
        with pytest.raises(grpc.RpcError) as other_pool:
            add(a, env, "blue", pool="blue")
        assert other_pool.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "--ipam cluster-pool" in other_pool.value.details()
        # The operator migrated (now multi-pool): the same CIDR arrives in pool default,
        # podCIDRs cleared. The not yet restarted agent keeps serving from it.
        op.mode = "multi-pool"
        op.updates.put(alloc(node, {"default": [cidrs[0]]}, resource_version="9"))
        assert add(a, env, "mixed") in ipaddress.ip_network(cidrs[0])
        assert not op.resolves and not op.demands, "cluster-pool agent sent demand/resolve"
        a.stop()

        b = start(env, op, ipam="multi-pool")
        restored = {e.pod_name: e.ipv4 for e in b.debug.ListEndpoints(
            agent_pb2.ListEndpointsRequest()).endpoints}  # fmt: skip
        assert restored == {**{k: str(v) for k, v in ips.items()}, "mixed": restored["mixed"]}
        assert b.debug.Status(agent_pb2.StatusRequest()).router_ip == str(a.agent.router_ip), (
            "router IP changed"
        )
        fresh = add(b, env, "after")
        assert fresh in ipaddress.ip_network(cidrs[0])
        assert str(fresh) not in restored.values()
        # router + 4 restored + 1 new = 6 in use → 16 needed; nothing handed back.
        wait(lambda: op.demands and op.demands[-1].demands[0].needed_ipv4 == 16)
        assert not any(d.released for d in op.demands)
    finally:
        op.stop()


def test_registration_reports_every_interface_subnet_except_agent_devices(env: Env) -> None:
    node = f"test-{env.tag}"
    op = Operator("multi-pool", alloc(node, {"default": [env.cidr]}))
    try:
        start(env, op)
        add_netns = env.add_netns()  # a pod veth (lxc…) must not be reported either
        del add_netns
        out = subprocess.run(
            ["ip", "-o", "-4", "addr", "show", "scope", "global"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        expected = set()
        for line in out.splitlines():
            fields = line.split()
            ifname, cidr = fields[1].split("@")[0], fields[3]
            if ifname.startswith(("lxc", "cilia_")):
                continue
            expected.add((ifname, str(ipaddress.ip_interface(cidr).network)))
        reported = {(n.interface, n.cidr) for n in op.registrations[0].local_networks}
        assert reported == expected
        assert (env.host_device, f"{env.cidr.rsplit('.', 1)[0]}.1/32") not in reported
    finally:
        op.stop()
