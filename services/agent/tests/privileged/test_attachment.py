"""Add/Del through the real gRPC server with real netns, veths and routes."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cilia.agent.v1 import agent_pb2
from cilia_agent.datapath import host_ifname
from cilia_agent.datapath.iptables import CHAIN

from .conftest import Env, sh


def add_req(
    netns: str, cid: str = "c1", ifname: str = "eth0", **kw: object
) -> agent_pb2.AddRequest:
    return agent_pb2.AddRequest(container_id=cid, ifname=ifname, netns=netns, **kw)  # type: ignore[arg-type]


def link_exists(name: str) -> bool:
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def test_add_configures_ip_default_route_and_host_route(env: Env) -> None:
    a = env.start_agent()
    ns = env.add_netns()
    resp = a.attach.Add(
        add_req(
            ns,
            "cont-a",
            "eth0",
            labels={"app": "web"},
            pod_namespace="team",
            pod_name="web-1",
        ),
        timeout=10,
    )
    router = str(ipaddress.IPv4Network(env.cidr).network_address + 1)
    host = host_ifname("cont-a", "eth0")
    assert [i.name for i in resp.interfaces] == [host, "eth0"]
    assert resp.interfaces[1].sandbox == ns and resp.interfaces[0].sandbox == ""
    assert resp.interfaces[0].mac and resp.interfaces[1].mac
    ip = resp.ips[0].address
    assert ip.endswith("/32") and ipaddress.IPv4Address(ip[:-3]) in ipaddress.IPv4Network(env.cidr)
    assert ip[:-3] != router
    assert resp.ips[0].gateway == router and resp.ips[0].interface == 1
    assert [(r.dst, r.gw) for r in resp.routes] == [("0.0.0.0/0", router)]

    name = ns.rsplit("/", 1)[1]
    addrs = json.loads(sh("ip", "-4", "-n", name, "-j", "addr", "show", "dev", "eth0"))
    assert {(x["local"], x["prefixlen"]) for x in addrs[0]["addr_info"]} == {(ip[:-3], 32)}
    link = json.loads(sh("ip", "-n", name, "-j", "link", "show", "dev", "eth0"))
    assert link[0]["address"] == resp.interfaces[1].mac
    routes = json.loads(sh("ip", "-n", name, "-j", "route", "show", "default"))
    assert routes[0]["gateway"] == router and "onlink" in routes[0]["flags"]
    host_routes = json.loads(sh("ip", "-j", "route", "show", f"{ip[:-3]}/32"))
    assert host_routes[0]["dev"] == host
    dev = json.loads(sh("ip", "-4", "-j", "addr", "show", "dev", env.host_device))
    assert {x["local"] for x in dev[0]["addr_info"]} == {router}

    eps = a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest(), timeout=5).endpoints
    assert len(eps) == 1
    ep = eps[0]
    assert (ep.container_id, ep.pod_namespace, ep.pod_name, ep.state) == (
        "cont-a",
        "team",
        "web-1",
        "ready",
    )
    assert dict(ep.labels) == {"app": "web"}
    state_files = list((env.state_dir / "endpoints").glob("*.json"))
    assert len(state_files) == 1
    assert json.loads(state_files[0].read_text())["state"] == "ready"


def test_two_pods_ping_each_other_and_the_router(env: Env) -> None:
    a = env.start_agent()
    ns1, ns2 = env.add_netns(), env.add_netns()
    ip1 = a.attach.Add(add_req(ns1, "p1"), timeout=10).ips[0].address[:-3]
    r2 = a.attach.Add(add_req(ns2, "p2"), timeout=10)
    ip2, router = r2.ips[0].address[:-3], r2.ips[0].gateway
    n1, n2 = ns1.rsplit("/", 1)[1], ns2.rsplit("/", 1)[1]
    sh("ip", "netns", "exec", n1, "ping", "-c1", "-W2", ip2)
    sh("ip", "netns", "exec", n2, "ping", "-c1", "-W2", ip1)
    sh("ip", "netns", "exec", n1, "ping", "-c1", "-W2", router)


def test_del_twice_succeeds_and_releases_ip_veth_and_state(env: Env) -> None:
    a = env.start_agent()
    ns = env.add_netns()
    resp = a.attach.Add(add_req(ns, "deltwice"), timeout=10)
    used_before = a.debug.Status(agent_pb2.StatusRequest()).pools[0].used
    d1 = a.attach.Del(agent_pb2.DelRequest(container_id="deltwice", ifname="eth0", netns=ns))
    d2 = a.attach.Del(agent_pb2.DelRequest(container_id="deltwice", ifname="eth0", netns=ns))
    assert d1.deleted is True and d2.deleted is False
    assert not link_exists(resp.interfaces[0].name)
    assert list((env.state_dir / "endpoints").glob("*.json")) == []
    assert a.debug.Status(agent_pb2.StatusRequest()).pools[0].used == used_before - 1
    name = ns.rsplit("/", 1)[1]
    assert "eth0" not in sh("ip", "-n", name, "link")


def test_del_with_missing_netns_cleans_host_side_and_ip(env: Env) -> None:
    a = env.start_agent()
    ns = env.add_netns()
    resp = a.attach.Add(add_req(ns, "gone"), timeout=10)
    env.del_netns(ns)
    d = a.attach.Del(agent_pb2.DelRequest(container_id="gone", ifname="eth0", netns=""))
    assert d.deleted is True
    assert not link_exists(resp.interfaces[0].name)
    assert a.debug.Status(agent_pb2.StatusRequest()).pools[0].used == 1  # router only


def test_del_of_unknown_attachment_succeeds_with_deleted_false(env: Env) -> None:
    a = env.start_agent()
    d = a.attach.Del(agent_pb2.DelRequest(container_id="never", ifname="eth0"))
    assert d.deleted is False


def test_add_with_existing_ifname_fails_and_leaves_nothing(env: Env) -> None:
    a = env.start_agent()
    ns = env.add_netns()
    name = ns.rsplit("/", 1)[1]
    sh("ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p")
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Add(add_req(ns, "dup"), timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "eth0" in (err.value.details() or "")
    assert not link_exists(host_ifname("dup", "eth0"))
    assert list((env.state_dir / "endpoints").glob("*.json")) == []
    status = a.debug.Status(agent_pb2.StatusRequest())
    assert status.pools[0].used == 1 and status.endpoint_count == 0
    assert "veth" in sh("ip", "-n", name, "-d", "link", "show", "eth0")  # untouched


def test_add_errors_name_the_field_the_netns_and_the_pool(env: Env) -> None:
    a = env.start_agent(static={"default": ["10.251.0.248/30"]})  # router + 1 pod
    ns = env.add_netns()
    cases = [
        (add_req(ns, ""), grpc.StatusCode.INVALID_ARGUMENT, "container_id"),
        (add_req(ns, "x", ""), grpc.StatusCode.INVALID_ARGUMENT, "ifname"),
        (add_req("", "x"), grpc.StatusCode.INVALID_ARGUMENT, "netns"),
        (add_req(ns, "x", mtu=10), grpc.StatusCode.INVALID_ARGUMENT, "mtu"),
        (add_req("/var/run/netns/cilia-t-missing", "x"), grpc.StatusCode.NOT_FOUND, "missing"),
    ]
    for req, code, word in cases:
        with pytest.raises(grpc.RpcError) as err:
            a.attach.Add(req, timeout=10)
        assert err.value.code() == code, req
        assert word in (err.value.details() or "")
    a.attach.Add(add_req(ns, "first"), timeout=10)
    ns2 = env.add_netns()
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Add(add_req(ns2, "second"), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'default'" in (err.value.details() or "")
    assert not link_exists(host_ifname("second", "eth0"))


def test_add_same_key_same_netns_returns_the_same_result(env: Env) -> None:
    a = env.start_agent()
    ns = env.add_netns()
    r1 = a.attach.Add(add_req(ns, "idem"), timeout=10)
    r2 = a.attach.Add(add_req(ns, "idem"), timeout=10)
    assert r1 == r2
    assert a.debug.Status(agent_pb2.StatusRequest()).endpoint_count == 1


def test_concurrent_adds_get_distinct_ips(env: Env) -> None:
    a = env.start_agent()
    namespaces = [env.add_netns() for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda i: a.attach.Add(add_req(namespaces[i], f"cc{i}"), timeout=20), range(8))
        )
    ips = [r.ips[0].address for r in results]
    assert len(set(ips)) == 8


def test_agent_without_allocation_is_unavailable_and_writes_no_conflist(env: Env) -> None:
    a = env.start_agent(static={})
    ns = env.add_netns()
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Add(add_req(ns, "early"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not (env.tmp / "net.d" / "05-cilia.conflist").exists()
    assert a.debug.Status(agent_pb2.StatusRequest()).ready is False


def test_ready_agent_writes_conflist_with_socket_and_keeps_it_on_stop(env: Env) -> None:
    a = env.start_agent(cni_log_file="/tmp/cni.log")
    path = env.tmp / "net.d" / "05-cilia.conflist"
    doc = json.loads(path.read_text())
    assert doc == {
        "cniVersion": "1.0.0",
        "name": "cilia",
        "plugins": [
            {
                "type": "cilia-cni",
                "agent-socket": str(env.tmp / "agent.sock"),
                "del-queue-dir": str(env.tmp / "del-queue"),
                "log-file": "/tmp/cni.log",
            }
        ],
    }
    assert (env.tmp / "agent.sock").stat().st_mode & 0o777 == 0o600
    a.stop()
    assert path.exists()


def _iptables_count(args: list[str], needle: str) -> int:
    out = sh("iptables", "-w", "-S", *args)
    return sum(1 for line in out.splitlines() if line.strip() == needle)


def test_iptables_chain_present_once_and_forward_jump_once(env: Env) -> None:
    env.start_agent().stop()
    env.start_agent()
    assert _iptables_count(["FORWARD"], f"-A FORWARD -j {CHAIN}") == 1
    assert _iptables_count([CHAIN], f"-A {CHAIN} -i lxc+ -j ACCEPT") == 1
    assert _iptables_count([CHAIN], f"-A {CHAIN} -o lxc+ -j ACCEPT") == 1
    # Our jump must come before anything in FORWARD that can drop (Docker's own chains, which
    # dockerd re-inserts at position 1 whenever it restarts, only RETURN for non-Docker devices).
    rules = sh("iptables", "-w", "-S", "FORWARD").splitlines()
    ours = rules.index(f"-A FORWARD -j {CHAIN}")
    droppers = [i for i, r in enumerate(rules) if r.endswith(("-j DROP", "-j REJECT"))]
    assert all(ours < i for i in droppers), rules


def test_per_add_latency_inside_the_agent_is_reported(env: Env) -> None:
    a = env.start_agent()
    namespaces = [env.add_netns() for _ in range(10)]
    started = time.perf_counter()
    for i, ns in enumerate(namespaces):
        a.attach.Add(add_req(ns, f"lat{i}"), timeout=10)
    wall_ms = (time.perf_counter() - started) * 1000 / len(namespaces)
    hist = a.agent.metrics.add_duration
    total = hist._sum.get()
    mean_ms = total * 1000 / len(namespaces)
    print(f"per-Add latency inside the agent: {mean_ms:.1f} ms (client wall {wall_ms:.1f} ms)")
    # The histogram observed every Add (a latency bound belongs to `make bench`, not here).
    counts = [s.value for m in hist.collect() for s in m.samples if s.name.endswith("_count")]
    assert counts and counts[0] >= len(namespaces)
