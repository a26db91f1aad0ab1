"""cilia-relay with two agents: flows of both nodes merged in time order; one agent killed.

A second ``cilia-agent serve`` (the real binary) runs next to the stack's agent as another
node: its own node name, state dir, sockets, Hubble TCP port, CNI conf dir, bpffs pin dir
and host device. It registers with the stack's operator and so gets its own /24 of
the stack's pool; the stack's relay learns it through the first agent's Peer service (fed by
the operator's WatchNodes). One pod runs on each node and they ping each other.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import traffic
from support import assert_pod_ip, current_stack, dump_logs

from cilia_testkit import VENV_BIN, cni, host, netns
from cilia_testkit.stack import Agent, Stack, StackError

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

NS = "cilia-e2e-relay"
RELAY_NOTICE_SECONDS = 20.0
ERROR_AGGREGATION_SECONDS = 10.0  # cilia-relay serve --error-aggregation-window default
DOWN_STATES = {"NODE_UNAVAILABLE", "NODE_ERROR"}

# ServerStatus and GetNodes of the relay, printed as JSON (run with the project's .venv python:
# the e2e test process itself needs only the standard library and pytest).
RELAY_STATUS = """
import json, sys, grpc
from google.protobuf.json_format import MessageToDict
from cilia.hubble.observer import observer_pb2 as pb, observer_pb2_grpc as rpc
with grpc.insecure_channel(sys.argv[1]) as ch:
    stub = rpc.ObserverStub(ch)
    status = stub.ServerStatus(pb.ServerStatusRequest(), timeout=15)
    nodes = stub.GetNodes(pb.GetNodesRequest(), timeout=15)
print(json.dumps({
    "status": MessageToDict(status, preserving_proto_field_name=True),
    "nodes": MessageToDict(nodes, preserving_proto_field_name=True).get("nodes", []),
}))
"""


def relay_status() -> dict[str, Any]:
    """``{"status": ServerStatusResponse, "nodes": [Node]}`` of the stack's relay."""
    out = subprocess.run(
        [str(VENV_BIN / "python"), "-c", RELAY_STATUS, current_stack().relay_address],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert isinstance(data, dict)
    return data


def node_states() -> dict[str, str]:
    """Node name → state (``NODE_CONNECTED``…) from the relay's GetNodes."""
    return {n["name"]: n.get("state", "") for n in relay_status()["nodes"]}


class Nodes:
    """The two nodes and their pods: ``a`` on the stack's agent, ``b`` on the second one."""

    def __init__(self, agent2: Agent, a: cni.Pod, b: cni.Pod) -> None:
        self.agent2 = agent2
        self.a = a
        self.b = b
        self.node1 = socket.gethostname()
        self.node2 = agent2.node_name

    def ping_both_ways(self, count: int = 3) -> None:
        assert netns.ping(self.a.name, self.b.ip, count=count), "a -> b " + dump_logs()
        assert netns.ping(self.b.name, self.a.ip, count=count), "b -> a " + dump_logs()


@pytest.fixture(scope="module")
def nodes(stack: Stack) -> Iterator[Nodes]:
    agent2 = stack.add_agent()
    a = cni.Pod(name=f"cilia-e2e-{os.getpid()}-relay-a", namespace=NS, labels={"app": "a"})
    b = cni.Pod(name=f"cilia-e2e-{os.getpid()}-relay-b", namespace=NS, labels={"app": "b"})
    try:
        agent2.start()
        for pod, conf in ((a, current_stack().agent.conflist()), (b, agent2.conflist())):
            pod.create_netns()
            outcome = pod.add(conf)
            assert outcome.returncode == 0, f"ADD {pod.name}: {outcome.stdout}\n" + (
                agent2.process.tail(20) if pod is b else dump_logs()
            )
        yield Nodes(agent2, a, b)
    finally:
        with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
            a.delete(current_stack().agent.conflist(), timeout=30)
        a.destroy_netns()
        if b.result is not None:
            if not agent2.process.running():
                # The test killed it: restart it so b's DEL releases its IP and endpoint.
                with contextlib.suppress(StackError, OSError):
                    agent2.start()
            with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
                b.delete(agent2.conflist(), timeout=30)
        b.destroy_netns()
        agent2.stop()
        stack.operator_cli("delete", "cn", agent2.node_name)
        agent2.remove_leftovers()


def _default_cidrs(node: str) -> list[str]:
    """CIDRs of pool ``default`` the operator allocated to CiliumNode ``node``."""
    out = current_stack().operator_cli("get", "ciliumnodes", node, "-o", "json")
    assert out.returncode == 0, out.stderr
    allocated = json.loads(out.stdout)["spec"]["ipam"]["pools"]["allocated"]
    return [c for entry in allocated if entry["pool"] == "default" for c in entry["cidrs"]]


def test_second_agent_gets_its_own_cidr_and_pods_reach_across_nodes(nodes: Nodes) -> None:
    ip_a, ip_b = assert_pod_ip(nodes.a), assert_pod_ip(nodes.b)
    cidr1, cidr2 = _default_cidrs(nodes.node1), _default_cidrs(nodes.node2)
    assert cidr1 and cidr2 and not set(cidr1) & set(cidr2), (cidr1, cidr2)
    assert any(ip_a in ipaddress.ip_network(c) for c in cidr1), (ip_a, cidr1)
    assert any(ip_b in ipaddress.ip_network(c) for c in cidr2), (ip_b, cidr2)
    nodes.ping_both_ways(count=1)
    assert host.wait_for(
        lambda: node_states().get(nodes.node2) == "NODE_CONNECTED", RELAY_NOTICE_SECONDS
    ), relay_status()
    assert node_states()[nodes.node1] == "NODE_CONNECTED"


def test_relay_merges_flows_of_both_nodes_in_time_order(nodes: Nodes) -> None:
    t0 = time.time_ns()
    for _ in range(2):
        nodes.ping_both_ways(count=2)
    time.sleep(1.2)  # the relay's sort buffer drains after 1 s

    seen = traffic.observe("--pod", f"{NS}/{nodes.a.name}", "--last", "200")
    assert seen.returncode == 0, seen.stderr
    times = [traffic.time_ns(r["time"]) for r in seen.responses]
    assert times == sorted(times), "flows not in time order:\n" + traffic.summary(seen.flows)
    fresh = [f for f in seen.flows if traffic.time_ns(f["time"]) >= t0]
    text = traffic.summary(fresh)
    order = [f["node_name"] for f in fresh]
    assert set(order) == {nodes.node1, nodes.node2}, text
    switches = sum(1 for x, y in itertools.pairwise(order) if x != y)
    assert switches >= 4, f"flows of the two nodes not interleaved (merged by time):\n{text}"
    for f in fresh:
        assert f["verdict"] == "FORWARDED", text
        # Each node only reports flows at its own endpoints.
        own = nodes.a.name if f["node_name"] == nodes.node1 else nodes.b.name
        point = f["trace_observation_point"]
        # leaving for the other node: to-stack at the source (medium aggregation reports
        # nothing as from-endpoint, as upstream); arriving: to-endpoint at the destination
        side = {"TO_STACK": "source", "TO_ENDPOINT": "destination"}[point]
        assert traffic.pod_of(f, side) == own, text
        assert {traffic.pod_of(f, "source"), traffic.pod_of(f, "destination")} == {
            nodes.a.name,
            nodes.b.name,
        }, text
    node2_in = [f for f in fresh if f["node_name"] == nodes.node2 and not f.get("is_reply")]
    assert any(f["traffic_direction"] == "INGRESS" for f in node2_in), text
    assert any(f["traffic_direction"] == "EGRESS" for f in node2_in), text
    assert relay_status()["status"]["num_connected_nodes"] == 2


def _names_down(event: dict[str, Any], node: str) -> bool:
    return event.get("state_change") in DOWN_STATES and node in event.get("node_names", [])


def _node1_flow_after(responses: list[dict[str, Any]], node1: str, t_ns: int) -> bool:
    return any(r["node_name"] == node1 and traffic.time_ns(r["time"]) > t_ns for r in responses)


def test_relay_keeps_serving_and_reports_the_agent_killed_with_sigkill(nodes: Nodes) -> None:
    def ping_a_b() -> None:
        netns.ping(nodes.a.name, nodes.b.ip, count=1, wait_seconds=1)

    with traffic.following("--pod", f"{NS}/{nodes.a.name}") as follow:
        assert follow.wait_for(
            lambda f: {r["node_name"] for r in f.responses} >= {nodes.node1, nodes.node2},
            RELAY_NOTICE_SECONDS,
            poke=ping_a_b,
        ), f"follow stream lacks a node: {traffic.summary(r['flow'] for r in follow.responses)}"

        nodes.agent2.kill()
        killed = time.time_ns()
        # The second node's datapath stays attached without its agent: pods still talk.
        nodes.ping_both_ways(count=1)
        assert follow.wait_for(
            lambda f: _node1_flow_after(f.responses, nodes.node1, killed),
            RELAY_NOTICE_SECONDS,
            poke=ping_a_b,
        ), "follow stream stopped delivering the first node's flows after the kill"
        assert follow.proc.poll() is None, "observe --follow ended when an agent died"
        # As upstream relay does, the running stream tells which node failed (on stderr),
        # once the error aggregation window (--error-aggregation-window, 10 s) closed.
        assert follow.wait_for(
            lambda f: any(_names_down(e, nodes.node2) for e in f.node_events),
            ERROR_AGGREGATION_SECONDS + 5,
        ), f"no NODE_ERROR/NODE_UNAVAILABLE for {nodes.node2} in the stream: {follow.node_events}"
        assert not [
            r
            for r in follow.responses
            if r["node_name"] == nodes.node2 and traffic.time_ns(r["time"]) > killed
        ]

    def reported_down() -> traffic.Observed | None:
        seen = traffic.observe("--pod", f"{NS}/{nodes.a.name}", "--last", "50")
        down = any(_names_down(e, nodes.node2) for e in seen.node_events)
        return seen if down and seen.returncode == 0 else None

    last: list[traffic.Observed | None] = [None]

    def check() -> bool:
        last[0] = reported_down()
        return last[0] is not None

    assert host.wait_for(check, RELAY_NOTICE_SECONDS, interval=1.0), (
        "relay never reported the killed agent as unavailable/error on stderr"
    )
    seen = last[0]
    assert seen is not None
    assert _node1_flow_after(seen.responses, nodes.node1, killed), traffic.summary(seen.flows)
    assert "NODE_" in seen.stderr, seen.stderr

    status = relay_status()
    assert status["status"].get("num_unavailable_nodes") == 1, status
    assert nodes.node2 in status["status"].get("unavailable_nodes", []), status
    assert status["status"].get("num_connected_nodes") == 1, status
    states = {n["name"]: n.get("state") for n in status["nodes"]}
    assert states[nodes.node1] == "NODE_CONNECTED", states
    assert states[nodes.node2] in DOWN_STATES, states
