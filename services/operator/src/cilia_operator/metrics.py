"""Prometheus metrics of the operator (served on ``--prometheus-serve-addr``).

Names follow upstream's ``cilium_operator_ipam_*`` family (reference:
cilium-upstream.md §9); upstream multi-pool exports none, so these are Cilia's:

- ``cilium_operator_ipam_allocated_cidrs{pool}`` (gauge): per-node blocks held.
- ``cilium_operator_ipam_available_cidrs{pool}`` (gauge): blocks still free.
- ``cilium_operator_ipam_cidr_allocations_total{pool}`` (counter): blocks handed out.
- ``cilium_operator_ipam_node_reconciles_total{outcome}`` (counter): ``success``/``error``.
- ``cilium_operator_identity_gc_entries{status}`` (gauge, upstream name): identities found
  ``alive`` / ``deleted`` by the last identity GC run.
- ``cilium_operator_identity_gc_runs{outcome}`` (gauge counted up, upstream name and type):
  identity GC runs by ``success``/``failure``.
- ``cilium_operator_endpoint_gc_objects{outcome}`` (gauge counted up, upstream name):
  CiliumEndpoints the endpoint GC deleted (``success``) or could not (``failure``).
- ``cilium_operator_identities_allocated_total`` (counter): identities created by Allocate.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

from .ipam.allocator import PoolStats


class Metrics:
    """One registry per operator instance (so several can run in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.allocated = Gauge(
            "cilium_operator_ipam_allocated_cidrs",
            "Per-node CIDR blocks allocated from the pool",
            ["pool"],
            registry=self.registry,
        )
        self.available = Gauge(
            "cilium_operator_ipam_available_cidrs",
            "Per-node CIDR blocks still free in the pool",
            ["pool"],
            registry=self.registry,
        )
        self.allocations = Counter(
            "cilium_operator_ipam_cidr_allocations_total",
            "Per-node CIDR blocks handed out",
            ["pool"],
            registry=self.registry,
        )
        self.reconciles = Counter(
            "cilium_operator_ipam_node_reconciles_total",
            "CiliumNode IPAM reconciliations by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.identity_gc_entries = Gauge(
            "cilium_operator_identity_gc_entries",
            "Identities found alive/deleted by the last identity GC run",
            ["status"],
            registry=self.registry,
        )
        self.identity_gc_runs = Gauge(
            "cilium_operator_identity_gc_runs",
            "Identity GC runs by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.endpoint_gc_objects = Gauge(
            "cilium_operator_endpoint_gc_objects",
            "CiliumEndpoints garbage-collected, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.identities_allocated = Counter(
            "cilium_operator_identities_allocated_total",
            "Identities created by IdentityService.Allocate",
            registry=self.registry,
        )
        self.ces_sync = Counter(
            "cilium_operator_ces_sync",
            "CiliumEndpointSlice writes (create, update, delete) by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self._pools: set[str] = set()

    def set_pool_stats(self, stats: Mapping[str, PoolStats]) -> None:
        """Publish per-pool gauges; pools that disappeared are removed."""
        for gone in self._pools - set(stats):
            self.allocated.remove(gone)
            self.available.remove(gone)
        for pool, s in stats.items():
            self.allocated.labels(pool).set(s.allocated)
            self.available.labels(pool).set(s.available)
        self._pools = set(stats)
