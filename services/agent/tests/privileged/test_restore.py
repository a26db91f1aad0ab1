"""Restart behaviour: a new agent object on the same state dir."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from cilia.agent.v1 import agent_pb2
from cilia_agent.datapath import host_ifname
from cilia_agent.endpoint import EndpointRecord, StateStore

from .conftest import Env, sh
from .test_attachment import add_req, link_exists


def test_restart_reoccupies_ips_and_new_add_never_gets_a_live_pods_ip(env: Env) -> None:
    cidr = "10.251.0.240/29"  # 6 usable: router + 5 pods
    a = env.start_agent(static={"default": [cidr]})
    live = {}
    for i in range(2):
        ns = env.add_netns()
        live[ns] = a.attach.Add(add_req(ns, f"live{i}"), timeout=10).ips[0].address
    a.stop()

    b = env.start_agent(static={"default": [cidr]})
    eps = b.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
    assert sorted(f"{e.ipv4}/32" for e in eps) == sorted(live.values())
    assert {e.state for e in eps} == {"ready"}
    status = b.debug.Status(agent_pb2.StatusRequest())
    assert status.ready and status.pools[0].used == 3
    new_ips = []
    for i in range(3):
        ns = env.add_netns()
        new_ips.append(b.attach.Add(add_req(ns, f"new{i}"), timeout=10).ips[0].address)
    assert not set(new_ips) & set(live.values())
    assert len(set(new_ips)) == 3
    with pytest.raises(grpc.RpcError) as err:
        b.attach.Add(add_req(env.add_netns(), "overflow"), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # restored pods still work
    ns0 = next(iter(live))
    sh("ip", "netns", "exec", ns0.rsplit("/", 1)[1], "ping", "-c1", "-W2", status.router_ip)


def test_restore_removes_endpoints_whose_netns_was_deleted_while_down(env: Env) -> None:
    a = env.start_agent()
    keep, gone = env.add_netns(), env.add_netns()
    a.attach.Add(add_req(keep, "keep"), timeout=10)
    a.attach.Add(add_req(gone, "gone"), timeout=10)
    a.stop()
    env.del_netns(gone)

    b = env.start_agent()
    eps = b.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
    assert [e.container_id for e in eps] == ["keep"]
    assert not link_exists(host_ifname("gone", "eth0"))
    assert len(list((env.state_dir / "endpoints").glob("*.json"))) == 1
    assert b.debug.Status(agent_pb2.StatusRequest()).pools[0].used == 2


def test_restore_removes_endpoint_whose_host_veth_was_deleted(env: Env) -> None:
    a = env.start_agent()
    ns = env.add_netns()
    a.attach.Add(add_req(ns, "veth-gone"), timeout=10)
    a.stop()
    subprocess.run(["ip", "link", "del", host_ifname("veth-gone", "eth0")], check=True)
    b = env.start_agent()
    assert b.debug.Status(agent_pb2.StatusRequest()).endpoint_count == 0


def test_restore_rolls_back_half_created_endpoint(env: Env) -> None:
    a = env.start_agent()
    ns = env.add_netns()
    a.stop()
    store = StateStore(env.state_dir)
    store.write_endpoint(
        EndpointRecord(
            id=7,
            container_id="half",
            ifname="eth0",
            netns=ns,
            ipv4="10.251.0.77",
            pool="default",
            host_ifname=host_ifname("half", "eth0"),
            state="creating",
        )
    )
    subprocess.run(
        [
            "ip",
            "link",
            "add",
            host_ifname("half", "eth0"),
            "type",
            "veth",
            "peer",
            "name",
            "tmphalf",
            "netns",
            ns.rsplit("/", 1)[1],
        ],
        check=True,
    )
    b = env.start_agent()
    assert b.agent.restore_report.rolled_back == ["half/eth0"]
    assert not link_exists(host_ifname("half", "eth0"))
    assert list((env.state_dir / "endpoints").glob("*.json")) == []
    assert b.debug.Status(agent_pb2.StatusRequest()).endpoint_count == 0


def test_persisted_allocation_makes_restarted_agent_ready_before_any_operator(env: Env) -> None:
    a = env.start_agent()
    ns = env.add_netns()
    first = a.attach.Add(add_req(ns, "before"), timeout=10)
    router = a.debug.Status(agent_pb2.StatusRequest()).router_ip
    a.stop()
    # Second run: no CIDR given and no operator; node.json alone carries the allocation.
    b = env.start_agent(static={})
    status = b.debug.Status(agent_pb2.StatusRequest())
    assert status.ready and status.router_ip == router
    assert [list(p.cidrs) for p in status.pools] == [[env.cidr]]
    second = b.attach.Add(add_req(env.add_netns(), "after"), timeout=10)
    assert second.ips[0].address != first.ips[0].address
