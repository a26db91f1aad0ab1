"""Prometheus metrics of the agent, named as upstream where a name exists.

Upstream names (reference: cilium-upstream.md §9): ``cilium_endpoint``,
``cilium_endpoint_state{state}``, ``cilium_endpoint_regenerations_total{outcome}``,
``cilium_ip_addresses{family}``, ``cilium_ipam_capacity{family}``,
``cilium_ipam_events_total{action,family}``. ``cilia_endpoint_add_duration_seconds``
has no upstream twin (CNI ADD latency inside the agent).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    """One registry per agent object (several agents may live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.endpoint = Gauge(
            "cilium_endpoint", "Number of endpoints managed by this agent", registry=self.registry
        )
        self.endpoint_state = Gauge(
            "cilium_endpoint_state",
            "Count of endpoints in each state",
            ["state"],
            registry=self.registry,
        )
        self.regenerations = Counter(
            "cilium_endpoint_regenerations",
            "Endpoint creations (regenerations) by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.ip_addresses = Gauge(
            "cilium_ip_addresses",
            "Number of allocated IP addresses",
            ["family"],
            registry=self.registry,
        )
        self.ipam_capacity = Gauge(
            "cilium_ipam_capacity",
            "Total number of usable IPs in the node's CIDRs",
            ["family"],
            registry=self.registry,
        )
        self.ipam_events = Counter(
            "cilium_ipam_events",
            "IPAM events by action",
            ["action", "family"],
            registry=self.registry,
        )
        self.add_duration = Histogram(
            "cilia_endpoint_add_duration_seconds",
            "Time the agent spends on one Add (IPAM + state + plumbing)",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
