"""Generic-veth chaining: another plugin created the veth and the address; the agent adopts
the container interface, attaches the datapath to the host peer, and on Del/GC leaves the
other plugin's veth and address alone. Real netns, veths, and (second test) real BPF.

Netns names start with ``cilia-b1-``, host veths with ``b1c``; addresses in 10.252.0.0/16.
"""

from __future__ import annotations

import json
import secrets
import subprocess

import grpc
import pytest

from cilia.agent.v1 import agent_pb2
from cilia_testkit import skips

from .conftest import AgentThread, Env, sh
from .test_cni_lifecycle import held_ips, link_exists, netns, state_files


class Veth:
    """A veth pair made the way a "main" plugin (e.g. ptp/bridge-less veth) makes it."""

    def __init__(self, env: Env, ifname: str = "eth0") -> None:
        self.ns = netns(env)
        self.ns_name = self.ns.rsplit("/", 1)[1]
        self.host = f"b1c{secrets.token_hex(4)}"
        third = secrets.randbelow(250) + 1
        self.ip = f"10.252.{third}.5"
        self.gw = f"10.252.{third}.1"
        self.ifname = ifname
        sh(
            "ip",
            "link",
            "add",
            self.host,
            "type",
            "veth",
            "peer",
            "name",
            ifname,
            "netns",
            self.ns_name,
        )
        sh("ip", "link", "set", self.host, "up")
        sh("ip", "-n", self.ns_name, "link", "set", ifname, "up")
        sh("ip", "-n", self.ns_name, "addr", "add", f"{self.ip}/24", "dev", ifname)
        sh("ip", "-n", self.ns_name, "route", "add", "default", "via", self.gw, "dev", ifname)
        env_cleanup.append(self.host)
        self.host_mac = json.loads(sh("ip", "-j", "link", "show", self.host))[0]["address"]
        self.mac = json.loads(sh("ip", "-n", self.ns_name, "-j", "link", "show", ifname))[0][
            "address"
        ]

    def prev_result(self) -> str:
        return json.dumps(
            {
                "cniVersion": "1.0.0",
                "interfaces": [
                    {"name": self.host, "mac": self.host_mac},
                    {"name": self.ifname, "mac": self.mac, "sandbox": self.ns},
                ],
                "ips": [{"address": f"{self.ip}/24", "gateway": self.gw, "interface": 1}],
                "routes": [{"dst": "0.0.0.0/0", "gw": self.gw}],
            }
        )


env_cleanup: list[str] = []


@pytest.fixture(autouse=True)
def _delete_host_veths() -> object:
    yield None
    while env_cleanup:
        subprocess.run(["ip", "link", "del", env_cleanup.pop()], capture_output=True, check=False)


def chained_add(a: AgentThread, v: Veth, cid: str) -> agent_pb2.AddResponse:
    return a.attach.Add(  # type: ignore[no-any-return]
        agent_pb2.AddRequest(
            container_id=cid,
            ifname=v.ifname,
            netns=v.ns,
            prev_result=v.prev_result(),
            labels={"app": "chained"},
            pod_namespace="team",
            pod_name=cid,
        ),
        timeout=30,
    )


def test_chained_add_adopts_the_interface_and_del_leaves_the_other_plugins_veth(env: Env) -> None:
    a = env.start_agent()
    v = Veth(env)
    used = a.debug.Status(agent_pb2.StatusRequest()).pools[0].used
    r = chained_add(a, v, "chain-1")
    # the previous result passes through
    assert [(i.name, i.mac, i.sandbox) for i in r.interfaces] == [
        (v.host, v.host_mac, ""),
        ("eth0", v.mac, v.ns),
    ]
    assert [(i.address, i.gateway, i.interface) for i in r.ips] == [(f"{v.ip}/24", v.gw, 1)]
    assert [(x.dst, x.gw) for x in r.routes] == [("0.0.0.0/0", v.gw)]
    eps = a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
    assert [(e.chained, e.host_ifname, e.ipv4, e.pool) for e in eps] == [(True, v.host, v.ip, "")]
    assert a.debug.Status(agent_pb2.StatusRequest()).pools[0].used == used  # no IP of ours
    assert v.ip not in held_ips(a)
    assert a.attach.Check(agent_pb2.CheckRequest(container_id="chain-1", ifname="eth0")).endpoint_id
    # idempotent
    assert chained_add(a, v, "chain-1") == r

    # restart: the chained endpoint is restored, not cleaned up
    a.stop()
    b = env.start_agent()
    assert b.agent.restore_report.restored == ["chain-1/eth0"]

    assert b.attach.Del(
        agent_pb2.DelRequest(container_id="chain-1", ifname="eth0", netns=v.ns)
    ).deleted
    assert link_exists(v.host)
    addrs = json.loads(sh("ip", "-n", v.ns_name, "-j", "-4", "addr", "show", "dev", "eth0"))
    assert [x["local"] for x in addrs[0]["addr_info"]] == [v.ip]
    assert state_files(env) == []
    assert b.debug.Status(agent_pb2.StatusRequest()).endpoint_count == 0


def test_chained_add_refuses_what_it_cannot_adopt(env: Env) -> None:
    a = env.start_agent()
    v = Veth(env)
    doc = json.loads(v.prev_result())
    cases = [
        ("not json", "prev_result"),
        (json.dumps({**doc, "ips": []}), "no IPv4 address"),
        (
            json.dumps({**doc, "ips": [{"address": "10.252.255.9/24", "interface": 1}]}),
            "is not configured on eth0",
        ),
    ]
    for prev, word in cases:
        with pytest.raises(grpc.RpcError) as err:
            a.attach.Add(
                agent_pb2.AddRequest(
                    container_id="bad", ifname="eth0", netns=v.ns, prev_result=prev
                ),
                timeout=10,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert word in (err.value.details() or "")
    # a veth whose peer stays inside the netns (no host side to attach to)
    sh("ip", "-n", v.ns_name, "link", "add", "in0", "type", "veth", "peer", "name", "in1")
    sh("ip", "-n", v.ns_name, "addr", "add", "10.252.254.2/24", "dev", "in0")
    inner = json.dumps(
        {
            "interfaces": [{"name": "in0", "sandbox": v.ns}],
            "ips": [{"address": "10.252.254.2/24", "interface": 0}],
        }
    )
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Add(
            agent_pb2.AddRequest(container_id="d", ifname="in0", netns=v.ns, prev_result=inner),
            timeout=10,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a veth" in (err.value.details() or "")
    assert a.debug.Status(agent_pb2.StatusRequest()).endpoint_count == 0
    assert state_files(env) == []


def test_chained_endpoint_gets_bpf_programs_and_gc_detaches_them(env: Env) -> None:
    skips.require_bpf("netns, tc, BPF")
    a = env.start_agent(enable_bpf=True)
    v = Veth(env)
    r = chained_add(a, v, "chain-bpf")
    filters = sh("tc", "filter", "show", "dev", v.host, "ingress") + sh(
        "tc", "filter", "show", "dev", v.host, "egress"
    )
    assert "cil_from_container" in filters and "cil_to_container" in filters
    ep = a.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints[0]
    assert ep.identity > 0 and ep.chained and ep.id == r.endpoint_id
    a.attach.Check(agent_pb2.CheckRequest(container_id="chain-bpf", ifname="eth0"))
    # a program removed behind the agent's back is reported by CHECK
    sh("tc", "filter", "del", "dev", v.host, "egress")
    with pytest.raises(grpc.RpcError) as err:
        a.attach.Check(agent_pb2.CheckRequest(container_id="chain-bpf", ifname="eth0"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "cil_to_container not attached" in (err.value.details() or "")

    released = a.attach.GC(agent_pb2.GCRequest()).released
    assert [(x.container_id, x.ifname) for x in released] == [("chain-bpf", "eth0")]
    assert link_exists(v.host)
    assert "bpf" not in sh("tc", "filter", "show", "dev", v.host, "ingress")
    assert a.agent.bpf.endpoints() == {}
    assert a.debug.Status(agent_pb2.StatusRequest()).endpoint_count == 0
