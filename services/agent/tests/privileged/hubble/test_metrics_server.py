"""Hubble metrics of a real agent on upstream's port 9965, scraped over HTTP after real traffic.

A one-node :class:`cilia_testkit.cluster.Cluster` (its agent in its own netns, so the
default ports 9962 and 9965 are free) runs with every handler enabled. Pods frontend,
backend (TCP server on :data:`PORT`) and other are plumbed by the real ``cilia-cni``; a
CiliumNetworkPolicy admits only frontend to backend:PORT. Traffic: frontend → backend
(allowed), other → backend (dropped by policy), frontend → other ICMP echo, frontend → an
address outside the cluster (world: an unowned LAN address, so nothing leaves the host).

The endpoint is scraped with ``urllib`` and parsed by ``prometheus_client``'s text parser.
Checked: names and label values as upstream for what the traffic must produce, and exact
agreement with the agent's own flows: the scraped counters equal what the same handlers
compute over the flows in the agent's ring (GetFlows; the ring still holds every flow the
agent saw), and ``hubble_flows_processed_total`` sums to the observer's ``seen_flows``.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia_agent.hubble.metrics import HubbleMetrics, parse_metrics
from cilia_testkit import VENV_BIN, probe, skips
from cilia_testkit.cluster import Cluster
from cilia_testkit.host import wait_for
from cilia_testkit.plugin import cluster_unsupported
from cilia_testkit.stack import read_listeners

PORT = 8080
WORLD_PORT = 443
SPEC = (
    "flow drop:sourceContext=pod;destinationContext=pod tcp port-distribution icmp "
    "flows-to-world:port;destinationContext=reserved-identity"
)
#: Seconds a connect that must fail waits (a dropped SYN is retransmitted after 1 s).
BLOCKED_TIMEOUT_SECONDS = 1.5
POLICY_WAIT_SECONDS = 20.0
#: Seconds for the scraped counters and the ring to settle on the same flows.
SETTLE_SECONDS = 15.0
HTTP_TIMEOUT_SECONDS = 5.0

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def parse(text: str) -> Samples:
    """Metric sample name → {sorted label items: value}, as a Prometheus parser reads it."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=HTTP_TIMEOUT_SECONDS) as r:
        return str(r.read().decode())


def select(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        v
        for k, v in samples.get(name, {}).items()
        if all(dict(k).get(lk) == lv for lk, lv in labels.items())
    )


def policy() -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": "backend-from-frontend", "namespace": "default"},
        "spec": {
            "endpointSelector": {"matchLabels": {"app": "backend"}},
            "ingress": [
                {
                    "fromEndpoints": [{"matchLabels": {"app": "frontend"}}],
                    "toPorts": [{"ports": [{"port": str(PORT), "protocol": "TCP"}]}],
                }
            ],
        },
    }


def test_metrics_on_9965_count_real_allowed_dropped_icmp_and_world_traffic_exactly(
    cluster: Callable[..., Cluster],
) -> None:
    skips.require_bpf("a cluster node's eBPF datapath")
    skips.require(cluster_unsupported() or None)
    c = cluster(nodes=1, relay=False, name="hubble-metrics", agent_args=["--hubble-metrics", SPEC])
    node = c.node("node-a")
    listeners = read_listeners(node.agent.process.log, node.agent.process.offset)
    assert listeners.get("hubble-metrics") == "0.0.0.0:9965", listeners  # upstream's port
    hubble_metrics, agent_metrics = f"{node.address}:9965", f"{node.address}:9962"

    front = c.add_pod("node-a", "hm-frontend", {"app": "frontend"})
    back = c.add_pod("node-a", "hm-backend", {"app": "backend"})
    other = c.add_pod("node-a", "hm-other", {"app": "other"})
    server = probe.start_server(back.name, back.name, (PORT,))
    try:
        applied = subprocess.run(
            [str(VENV_BIN / "cilia-operator"), "apply", "-f", "-", "--server",
             c.operator_address],
            input=json.dumps(policy()), capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert applied.returncode == 0, applied.stderr

        def tcp_ok(src: str, dst: str) -> bool:
            result = probe.check_from(src, f"tcp:{dst}:{PORT}", timeout=BLOCKED_TIMEOUT_SECONDS)
            return result[0].ok

        def enforced() -> bool:
            return tcp_ok(front.name, back.ip) and not tcp_ok(other.name, back.ip)

        assert wait_for(enforced, POLICY_WAIT_SECONDS), c.logs()
        world = str(c.lan.network_address + 250)  # on the LAN, owned by nobody: ARP fails
        results = probe.check_many(
            [
                (front.name, [f"tcp:{back.ip}:{PORT}"] * 3 + [f"icmp:{other.ip}"]),
                (other.name, [f"tcp:{back.ip}:{PORT}"] * 2),
            ],
            timeout=BLOCKED_TIMEOUT_SECONDS,
        )
        assert [r.ok for r in results] == [True, True, True, True, False, False], results
        assert not probe.check_from(front.name, f"tcp:{world}:{WORLD_PORT}", timeout=1.0)[0].ok
    finally:
        probe.stop(server)

    # the scrape, the ring and seen_flows agree once no flow is in flight
    with grpc.insecure_channel(f"{node.address}:4244") as ch:
        observer = observer_pb2_grpc.ObserverStub(ch)  # type: ignore[no-untyped-call]

        def settled() -> tuple[Samples, list[flow_pb2.Flow], int] | None:
            seen = observer.ServerStatus(observer_pb2.ServerStatusRequest(), timeout=5)
            scraped = parse(scrape(hubble_metrics))
            flows = [
                r.flow
                for r in observer.GetFlows(observer_pb2.GetFlowsRequest(number=65535), timeout=10)
                if r.HasField("flow")
            ]
            again = observer.ServerStatus(observer_pb2.ServerStatusRequest(), timeout=5)
            total = sum(scraped.get("hubble_flows_processed_total", {}).values())
            if seen.seen_flows == again.seen_flows == total == len(flows):
                assert seen.seen_flows <= seen.max_flows, "the ring must still hold every flow"
                return scraped, flows, int(total)
            return None

        deadline = time.monotonic() + SETTLE_SECONDS
        while (state := settled()) is None:
            assert time.monotonic() < deadline, "scrape, ring and seen_flows never agreed"
            time.sleep(0.2)
    scraped, flows, total = state

    # 1. what the traffic must show, with upstream's names and label values
    src, dst = f"default/{other.name}", f"default/{back.name}"
    assert select(scraped, "hubble_drop_total", reason="POLICY_DENIED", protocol="TCP",
                  source=src, destination=dst) >= 2, scraped  # fmt: skip
    assert select(scraped, "hubble_flows_processed_total", type="Drop", verdict="DROPPED") >= 2
    # pod to pod on one node: reported where the packets arrive (medium aggregation, as
    # upstream), never as they leave; to the world: as handed to the stack
    assert select(scraped, "hubble_flows_processed_total", protocol="TCP", type="Trace",
                  subtype="to-endpoint", verdict="FORWARDED") >= 4  # fmt: skip
    assert select(scraped, "hubble_flows_processed_total", subtype="from-endpoint") == 0
    assert select(scraped, "hubble_flows_processed_total", protocol="TCP", type="Trace",
                  subtype="to-stack", verdict="FORWARDED") >= 1  # fmt: skip
    assert select(scraped, "hubble_port_distribution_total", protocol="TCP", port=str(PORT)) >= 4
    assert select(scraped, "hubble_tcp_flags_total", flag="SYN", family="IPv4") >= 4
    assert select(scraped, "hubble_tcp_flags_total", flag="SYN-ACK", family="IPv4") >= 4
    assert select(scraped, "hubble_icmp_total", family="IPv4", type="EchoRequest") >= 1
    assert select(scraped, "hubble_icmp_total", family="IPv4", type="EchoReply") >= 1
    assert select(scraped, "hubble_flows_to_world_total", protocol="TCP", verdict="FORWARDED",
                  port=str(WORLD_PORT), destination="reserved:world") >= 1  # fmt: skip
    assert not any(k.endswith("_created") for k in scraped), "no *_created series, as upstream"

    # 2. exactly what the same handlers make of the agent's own flows: each counted once
    replay = HubbleMetrics(CollectorRegistry(), handlers=parse_metrics(SPEC))
    for f in flows:
        replay.flow_processed(f)
    assert parse(generate_latest(replay.flow_registry).decode()) == scraped
    assert total == len(flows) > 0

    # 3. the agent's own endpoint keeps the datapath counters and no hubble_* flow metric
    agent_text = scrape(agent_metrics)
    assert "cilium_drop_count_total{" in agent_text
    assert "hubble_" not in agent_text
