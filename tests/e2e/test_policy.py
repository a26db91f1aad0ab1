"""CiliumNetworkPolicy end to end: real TCP between pods, enforced by the eBPF datapath.

Three pods in one namespace (``app=frontend``, ``app=backend``, ``app=other``), each running a
greeter on TCP 8080 and 9090, made once for the module and never recreated: every policy
change below reaches the running pods. Policies go through ``cilia-operator apply -f``;
flows are read back through the stack's relay with ``cilia-relay observe -o json``.
The tests run in file order and build on each other's policies.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import traffic
from support import current_stack, dump_logs, endpoints

from cilia_testkit import cni, host
from cilia_testkit.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

NS = "cilia-e2e-policy"
ALLOWED, OTHER_PORT = 8080, 9090
POLICY_WAIT_SECONDS = 15.0
ROLES = ("frontend", "backend", "other")
FLOWS_WANTED = 1000
# Names of every policy this module may create (deleted at teardown).
POLICIES = ("backend-allow-frontend", "frontend-lockdown", "backend-deny-other", "not-applied")


class Pods:
    """The module's three running pods, by role."""

    def __init__(self, pods: dict[str, cni.Pod]) -> None:
        self.by_role = pods

    def __getitem__(self, role: str) -> cni.Pod:
        return self.by_role[role]

    def connect(self, src: str, dst: str, port: int) -> str | None:
        """Greeting ``src`` gets from ``dst:port`` over a fresh TCP connection, or None."""
        return traffic.connect(self[src], self[dst].ip, port)

    def reaches(self, src: str, dst: str, port: int) -> bool:
        """``src`` connects to ``dst:port`` and reads ``dst``'s greeting (the replies pass)."""
        return self.connect(src, dst, port) == traffic.greeting(self[dst].name, port)


@pytest.fixture(scope="module")
def pods(stack: Stack) -> Iterator[Pods]:
    conflist = stack.agent.conflist()
    made: dict[str, cni.Pod] = {}
    servers: list[subprocess.Popen[str]] = []
    try:
        for role in ROLES:
            pod = cni.Pod(
                name=f"cilia-e2e-{os.getpid()}-pol-{role}", namespace=NS, labels={"app": role}
            )
            pod.create_netns()
            made[role] = pod
            outcome = pod.add(conflist)
            assert outcome.returncode == 0, outcome.stdout + dump_logs()
        for pod in made.values():
            servers.append(traffic.start_servers(pod, (ALLOWED, OTHER_PORT)))
        yield Pods(made)
    finally:
        for name in POLICIES:
            current_stack().operator_cli("delete", "cnp", name, "-n", NS)
        for server in servers:
            traffic.stop(server)
        for pod in made.values():
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                pod.delete(current_stack().agent.conflist(), timeout=30)
            pod.destroy_netns()


def _from(role: str) -> dict[str, Any]:
    return {"matchLabels": {"app": role}}


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"ports": [{"port": str(port), "protocol": "TCP"}]}]


def backend_allow(*roles: str) -> dict[str, Any]:
    """backend-allow-frontend: ingress to backend from ``roles`` on TCP 8080 only."""
    return traffic.cnp(
        "backend-allow-frontend",
        NS,
        {
            "endpointSelector": _from("backend"),
            "ingress": [{"fromEndpoints": [_from(r) for r in roles], "toPorts": _tcp(ALLOWED)}],
        },
    )


# Selecting frontend for ingress with a rule that matches nobody makes its ingress default-deny:
# the backend's SYN-ACK and greeting then reach frontend only as conntrack replies.
FRONTEND_LOCKDOWN = traffic.cnp(
    "frontend-lockdown",
    NS,
    {"endpointSelector": _from("frontend"), "ingress": [{"fromEndpoints": [_from("nobody")]}]},
)


def _apply(*docs: dict[str, Any]) -> None:
    out = traffic.apply(*docs)
    assert out.returncode == 0, f"apply exited {out.returncode}: {out.stderr}"


def _delete(name: str) -> None:
    out = current_stack().operator_cli("delete", "cnp", name, "-n", NS)
    assert out.returncode == 0, f"delete cnp {name} exited {out.returncode}: {out.stderr}"


def _eventually(predicate: Callable[[], bool], what: str) -> None:
    assert host.wait_for(predicate, POLICY_WAIT_SECONDS, interval=0.3), (
        f"{what} not within {POLICY_WAIT_SECONDS:g}s\n{dump_logs()}"
    )


def _flows_since(t0_ns: int, pods: Pods) -> list[dict[str, Any]]:
    """Flows to/from the backend observed through the relay since ``t0_ns`` (wall clock)."""
    time.sleep(1.2)  # the relay's sort buffer drains after 1 s (upstream default)
    seen = traffic.observe("--pod", f"{NS}/{pods['backend'].name}", "--last", str(FLOWS_WANTED))
    assert seen.returncode == 0, seen.stderr
    return [f for f in seen.flows if traffic.time_ns(f["time"]) >= t0_ns]


def _match(
    flows: list[dict[str, Any]], src: str, dst: str, port: int | None, **fields: Any
) -> list[dict[str, Any]]:
    return [
        f
        for f in flows
        if traffic.pod_of(f, "source") == src
        and traffic.pod_of(f, "destination") == dst
        and (port is None or traffic.dport(f) == port)
        and all(f.get(k, False if k == "is_reply" else None) == v for k, v in fields.items())
    ]


def test_every_pod_reaches_backend_on_any_port_before_a_policy(pods: Pods) -> None:
    for src in ("frontend", "other"):
        for port in (ALLOWED, OTHER_PORT):
            assert pods.reaches(src, "backend", port), f"{src} -> backend:{port} before policy"
    assert pods.reaches("backend", "frontend", ALLOWED)


def test_policy_lets_only_frontend_reach_backend_on_8080_and_selected_pods_default_deny(
    pods: Pods,
) -> None:
    _apply(backend_allow("frontend"), FRONTEND_LOCKDOWN)

    _eventually(lambda: not pods.reaches("other", "backend", ALLOWED), "other blocked")
    # The greeting crosses frontend's enforced ingress: replies pass through conntrack.
    assert pods.connect("frontend", "backend", ALLOWED) == traffic.greeting(
        pods["backend"].name, ALLOWED
    )
    assert pods.connect("frontend", "backend", OTHER_PORT) is None, "port not in toPorts"
    assert pods.connect("backend", "frontend", ALLOWED) is None, "frontend ingress not enforced"
    enforced = {r: ep.get("policy_enforcement") for r, ep in _endpoints_of(pods).items()}
    assert enforced == {
        "frontend": {"ingress": True, "egress": False},
        "backend": {"ingress": True, "egress": False},
        "other": {"ingress": False, "egress": False},
    }, enforced
    # A pod no policy selects stays default-allow.
    assert pods.reaches("backend", "other", ALLOWED)
    assert pods.reaches("frontend", "other", OTHER_PORT)


def test_relay_shows_frontend_forwarded_and_other_dropped_policy_denied_with_pod_names(
    pods: Pods,
) -> None:
    t0 = time.time_ns()
    assert pods.reaches("frontend", "backend", ALLOWED)
    assert pods.connect("other", "backend", ALLOWED) is None
    assert pods.connect("frontend", "backend", OTHER_PORT) is None

    flows = _flows_since(t0, pods)
    front, back, other = (pods[r].name for r in ROLES)
    text = traffic.summary(flows)
    forwarded = _match(flows, front, back, ALLOWED, verdict="FORWARDED", is_reply=False)
    assert forwarded, f"no FORWARDED frontend -> backend:{ALLOWED}:\n{text}"
    # Two pods of one node: each packet is reported once, where it arrives (backend's
    # to-endpoint), as upstream at its default aggregation; not also as it left frontend.
    points = {(f["traffic_direction"], f["trace_observation_point"]) for f in forwarded}
    assert points == {("INGRESS", "TO_ENDPOINT")}, text
    ingress = forwarded[0]
    assert ingress["IP"] == {"source": pods["frontend"].ip, "destination": pods["backend"].ip} | {
        "ipVersion": "IPv4"
    }
    assert ingress["source"]["namespace"] == NS == ingress["destination"]["namespace"]
    assert "k8s:app=frontend" in ingress["source"]["labels"]
    assert ingress["node_name"] == socket.gethostname()

    dropped = _match(flows, other, back, ALLOWED, verdict="DROPPED")
    assert dropped, f"no DROPPED other -> backend:{ALLOWED}:\n{text}"
    for f in dropped:
        assert f["drop_reason_desc"] == "POLICY_DENIED", f
        assert f["traffic_direction"] == "INGRESS" and f["event_type"]["type"] == 1, f
        assert "k8s:app=other" in f["source"]["labels"], f
    wrong_port = _match(flows, front, back, OTHER_PORT, verdict="DROPPED")
    assert [f["drop_reason_desc"] for f in wrong_port][:1] == ["POLICY_DENIED"], text
    # The backend's answers reached frontend's default-deny ingress as replies (of
    # frontend's connection: EGRESS), reported at frontend's to-endpoint.
    replies = _match(flows, back, front, None, verdict="FORWARDED", is_reply=True)
    assert replies, text
    points = {(f["traffic_direction"], f["trace_observation_point"]) for f in replies}
    assert points == {("EGRESS", "TO_ENDPOINT")}, text
    assert not _match(flows, back, front, None, verdict="DROPPED"), text


def _cnp_spec(name: str) -> dict[str, Any]:
    out = current_stack().operator_cli("get", "cnp", name, "-n", NS, "-o", "json")
    assert out.returncode == 0, out.stderr
    spec = json.loads(out.stdout)["spec"]
    assert isinstance(spec, dict)
    return spec


def test_invalid_policy_is_rejected_with_the_field_path_and_nothing_changes(pods: Pods) -> None:
    before = _cnp_spec("backend-allow-frontend")
    bad_protocol = traffic.cnp(
        "not-applied",
        NS,
        {
            "endpointSelector": _from("other"),
            "ingress": [
                {
                    "fromEndpoints": [{}],
                    "toPorts": [{"ports": [{"port": "80", "protocol": "XTP"}]}],
                }
            ],
        },
    )
    # A valid update (other allowed too) and an invalid document: the whole apply is refused.
    out = traffic.apply(backend_allow("frontend", "other"), bad_protocol)
    assert out.returncode != 0, out.stdout
    assert "spec.ingress[0].toPorts[0].ports[0].protocol" in out.stderr, out.stderr
    assert "XTP" in out.stderr, out.stderr
    misspelt = backend_allow("frontend", "other")
    misspelt["spec"]["ingres"] = misspelt["spec"].pop("ingress")
    out = traffic.apply(misspelt)
    assert out.returncode != 0, out.stdout
    assert "spec.ingres" in out.stderr, out.stderr

    assert _cnp_spec("backend-allow-frontend") == before
    missing = current_stack().operator_cli("get", "cnp", "not-applied", "-n", NS)
    assert missing.returncode != 0, missing.stdout
    time.sleep(1.0)  # a wrongly applied change would reach the datapath within this time
    assert pods.connect("other", "backend", ALLOWED) is None
    assert pods.reaches("frontend", "backend", ALLOWED)


def _endpoints_of(pods: Pods) -> dict[str, dict[str, Any]]:
    """``cilia-agent endpoint list -o json`` entries of the module's pods, by role."""
    by_container = {str(ep.get("container_id")): ep for ep in endpoints()}
    out = {}
    for role in ROLES:
        ep = by_container.get(pods[role].container_id)
        assert ep is not None, f"{pods[role].name} not in endpoint list: {list(by_container)}"
        out[role] = ep
    return out


def _incarnation(pods: Pods) -> dict[str, tuple[Any, ...]]:
    """What recreating a pod would change: endpoint id, IP, host veth and its ifindex."""
    out = {}
    for role, ep in _endpoints_of(pods).items():
        host_if = str(ep["host_ifname"])
        ifindex = (pathlib.Path("/sys/class/net") / host_if / "ifindex").read_text()
        out[role] = (ep["id"], ep["ipv4"], host_if, ifindex.strip(), ep.get("identity"))
    return out


def test_policy_update_takes_effect_on_running_pods_without_recreating_them(pods: Pods) -> None:
    before = _incarnation(pods)
    assert pods.connect("other", "backend", ALLOWED) is None

    _apply(backend_allow("frontend", "other"))

    _eventually(lambda: pods.reaches("other", "backend", ALLOWED), "other allowed after update")
    assert pods.reaches("frontend", "backend", ALLOWED)
    assert pods.connect("other", "backend", OTHER_PORT) is None, "still only TCP 8080"
    assert _incarnation(pods) == before, "pods were recreated"


def test_deny_beats_an_allow_all_ingress(pods: Pods) -> None:
    _delete("backend-allow-frontend")
    _apply(
        traffic.cnp(
            "backend-deny-other",
            NS,
            {
                "endpointSelector": _from("backend"),
                "ingress": [{"fromEndpoints": [{}]}],
                "ingressDeny": [{"fromEndpoints": [_from("other")], "toPorts": _tcp(ALLOWED)}],
            },
        )
    )
    t0 = time.time_ns()
    _eventually(lambda: pods.connect("other", "backend", ALLOWED) is None, "deny applied")
    assert pods.reaches("other", "backend", OTHER_PORT), "the allow-all still covers 9090"
    assert pods.reaches("frontend", "backend", ALLOWED)
    assert pods.reaches("frontend", "backend", OTHER_PORT)

    flows = _flows_since(t0, pods)
    dropped = _match(flows, pods["other"].name, pods["backend"].name, ALLOWED, verdict="DROPPED")
    assert dropped, traffic.summary(flows)
    assert {f["drop_reason_desc"] for f in dropped} == {"POLICY_DENY"}, traffic.summary(dropped)


def test_broad_deny_beats_a_more_specific_allow(pods: Pods) -> None:
    # L3 deny of other (every port) next to an allow of exactly other on TCP 8080: the allow
    # is the most specific policy-map entry, yet the deny must win.
    _apply(
        traffic.cnp(
            "backend-deny-other",
            NS,
            {
                "endpointSelector": _from("backend"),
                "ingress": [{"fromEndpoints": [_from("other")], "toPorts": _tcp(ALLOWED)}],
                "ingressDeny": [{"fromEndpoints": [_from("other")]}],
            },
        )
    )
    _eventually(lambda: pods.connect("other", "backend", OTHER_PORT) is None, "L3 deny applied")
    assert pods.connect("other", "backend", ALLOWED) is None
    assert pods.connect("frontend", "backend", ALLOWED) is None, "backend is default-deny"


def test_deleting_the_policies_restores_default_allow(pods: Pods) -> None:
    _delete("backend-deny-other")
    _delete("frontend-lockdown")

    _eventually(lambda: pods.reaches("other", "backend", ALLOWED), "other allowed again")
    assert pods.reaches("backend", "frontend", ALLOWED)
    assert pods.reaches("frontend", "backend", OTHER_PORT)
