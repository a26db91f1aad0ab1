"""Policy audit mode (``--policy-audit-mode``) on the real eBPF datapath, with real TCP.

One agent in audit mode (BPF on, fake operator), three pods (frontend, backend with TCP
servers on 8080 and 9090, other) and a default-deny-ingress CNP on backend that allows only
frontend → 8080. In audit mode nothing is dropped: the flows the policy would drop connect,
and the agent's Observer shows them with verdict AUDIT (and the Hubble flow metric counts
them), while the allowed flow shows no AUDIT. The agent is then restarted with the flag off
(the pods and pinned maps stay, as on a node): exactly the audited flows drop, with
POLICY_DENIED, and the allowed one still connects.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest

from cilia.agent.v1 import agent_pb2
from cilia.hubble.flow import flow_pb2
from cilia_testkit import skips

from .conftest import Env
from .fake_operator import FakeOperator
from .test_policy_datapath import (
    BIN,
    SERVER,
    Cluster,
    add_pod,
    allow_ingress,
    metric,
    wait,
)

#: (source pod, port) of each connection to backend; True = the policy allows it.
CASES = {("frontend", 8080): True, ("frontend", 9090): False, ("other", 8080): False}


def _agent_kwargs(op: FakeOperator, hubble_port: int, audit: bool) -> dict[str, Any]:
    return {
        "static": {},
        "enable_bpf": True,
        "hubble_listen_address": f"127.0.0.1:{hubble_port}",
        "hubble_metrics": "flow",
        "hubble_metrics_server": "",
        "operator": op.address,
        "operator_reconnect_min_backoff": 0.1,
        "operator_reconnect_max_backoff": 0.5,
        "policy_audit_mode": audit,
    }


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, int]]:
    skips.require_bpf("netns, tc, BPF")
    env = Env(tmp_path_factory.mktemp("audit"))
    op = FakeOperator(env.cidr)
    server: subprocess.Popen[bytes] | None = None
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            hubble_port = probe.getsockname()[1]
        agent = env.start_agent(**_agent_kwargs(op, hubble_port, audit=True))
        wait(lambda: agent.debug.Status(agent_pb2.StatusRequest()).ready, 20)
        pods = {n: add_pod(env, agent, n, {"app": n}) for n in ("frontend", "backend", "other")}
        server = subprocess.Popen(
            ["ip", "netns", "exec", pods["backend"].netns, sys.executable, "-c", SERVER]
        )
        c = Cluster(env, op, agent, pods, server)
        wait(lambda: c.connect("frontend", "backend", 8080), 10)
        yield c, hubble_port
    finally:
        if server is not None:
            server.kill()
            server.wait()
        env.cleanup()
        op.stop()


def _audit_flows(c: Cluster) -> set[tuple[str, int]]:
    return {
        (f.source.pod_name, f.l4.TCP.destination_port)
        for f in c.flows()
        if f.verdict == flow_pb2.AUDIT and f.destination.pod_name == "backend"
    }


def _audit_count(c: Cluster) -> float:
    hubble = c.agent.agent.hubble
    assert hubble is not None and hubble.metrics is not None
    text = generate_latest(hubble.metrics.flow_registry).decode()
    return metric(text, "hubble_flows_processed_total", type="PolicyVerdict", verdict="AUDIT")


def test_audit_mode_drops_nothing_and_reports_audit_then_enforce_drops_exactly_those(
    audited: tuple[Cluster, int],
) -> None:
    c, hubble_port = audited
    c.apply(allow_ingress("backend-8080", ["frontend"]))
    # endpoint list shows the mode
    out = subprocess.run(
        [str(BIN), "endpoint", "list", "--socket",
         str(c.agent.config.socket), "--bpf-pin-dir", str(c.env.pin_dir)],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    assert "ingress (audit)" in out, out
    listed = json.loads(
        subprocess.run(
            [str(BIN), "endpoint", "list", "--socket", str(c.agent.config.socket), "-o", "json",
             "--bpf-pin-dir", str(c.env.pin_dir)],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout
    )  # fmt: skip
    assert {e["pod_name"]: e["policy_audit_mode"] for e in listed} == dict.fromkeys(c.pods, True)
    counted_before = _audit_count(c)
    for src, port in CASES:
        assert c.connect(src, "backend", port), f"audit mode dropped {src}->{port}"
    would_drop = {k for k, allowed in CASES.items() if not allowed}
    wait(lambda: _audit_flows(c) >= would_drop)
    assert _audit_flows(c) == would_drop, "AUDIT for exactly the flows the policy would drop"
    audit = next(
        f for f in c.flows() if f.verdict == flow_pb2.AUDIT and f.source.pod_name == "other"
    )
    assert audit.event_type.type == 5 and audit.traffic_direction == flow_pb2.INGRESS
    assert not audit.drop_reason_desc
    assert not any(
        f.verdict == flow_pb2.DROPPED and f.destination.pod_name == "backend" for f in c.flows()
    )
    wait(lambda: _audit_count(c) >= counted_before + len(would_drop))

    # enforce: restart the agent with the flag off; the pods and pinned maps stay
    old = c.agent
    old.stop()
    c.agent = c.env.start_agent(**_agent_kwargs(c.op, hubble_port, audit=False))
    wait(lambda: c.agent.agent.enforcement is not None and c.agent.agent.enforcement.streams.ready)
    wait(lambda: c.agent.debug.Status(agent_pb2.StatusRequest()).ready, 20)
    for (src, port), allowed in CASES.items():
        assert c.connect(src, "backend", port) is allowed, f"{src}->{port} enforce"

    def dropped() -> set[tuple[str, int]]:
        return {
            (f.source.pod_name, f.l4.TCP.destination_port)
            for f in c.flows()
            if f.verdict == flow_pb2.DROPPED
            and f.destination.pod_name == "backend"
            and f.drop_reason_desc == flow_pb2.POLICY_DENIED
        }

    wait(lambda: dropped() >= would_drop)
    assert dropped() == would_drop
    assert not _audit_flows(c), "no AUDIT once enforcing"
