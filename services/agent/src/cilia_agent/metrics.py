"""Prometheus metrics of the agent, named as upstream where a name exists.

Upstream names (reference: cilium-upstream.md §9): ``cilium_endpoint``,
``cilium_endpoint_state{state}``, ``cilium_endpoint_regenerations_total{outcome}``,
``cilium_ip_addresses{family}``, ``cilium_ipam_capacity{family}``,
``cilium_ipam_events_total{action,family}``, ``cilium_policy`` (policies loaded).
``cilia_endpoint_add_duration_seconds`` has no upstream twin (CNI ADD latency inside
the agent), nor has ``cilia_policy_unenforceable`` (policies enforced fail closed: a rule
Cilia cannot enforce made their endpoints default-deny in its direction). The datapath counters (``cilium_drop_count_total{reason,direction}``,
``cilium_forward_count_total{direction}``) are registered in the same registry by
``hubble.metrics``; :class:`ScrapeHook` refreshes them from the pinned per-CPU map at every
scrape. The ``hubble_*`` flow metrics are not here: as upstream they have their own registry
and endpoint (``--hubble-metrics``, ``--hubble-metrics-server``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class ScrapeHook(Collector):
    """A collector exporting nothing that runs ``refresh`` first at every scrape.

    Register it before the collectors whose values ``refresh`` updates (a registry
    collects in registration order). Errors are swallowed: a scrape never fails.
    """

    def __init__(self) -> None:
        self.refresh: Callable[[], None] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.refresh is not None:
            with contextlib.suppress(Exception):  # a failed refresh keeps the last values
                self.refresh()
        return iter(())

    def describe(self) -> Iterator[Metric]:
        return iter(())


class Metrics:
    """One registry per agent object (several agents may live in one test process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.scrape_hook = ScrapeHook()
        self.registry.register(self.scrape_hook)
        self.policy = Gauge(
            "cilium_policy", "Number of policies currently loaded", registry=self.registry
        )
        self.policy_unenforceable = Gauge(
            "cilia_policy_unenforceable",
            "Policies with a rule Cilia cannot enforce, enforced fail closed (the endpoints "
            "they select are default-deny in that rule's direction)",
            registry=self.registry,
        )
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
        gc_labels = ["family", "protocol", "status"]
        self.ct_gc_runs = Counter(
            "cilium_datapath_conntrack_gc_runs",
            "Conntrack garbage-collection passes, by outcome",
            gc_labels,
            registry=self.registry,
        )
        self.ct_gc_entries = Gauge(
            "cilium_datapath_conntrack_gc_entries",
            "Conntrack entries the last garbage-collection pass kept (alive) and deleted",
            gc_labels,
            registry=self.registry,
        )
        self.ct_gc_duration = Histogram(
            "cilium_datapath_conntrack_gc_duration_seconds",
            "Seconds one conntrack garbage-collection pass took",
            gc_labels,
            registry=self.registry,
        )
        self.add_duration = Histogram(
            "cilia_endpoint_add_duration_seconds",
            "Time the agent spends on one Add (IPAM + state + plumbing)",
            buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
