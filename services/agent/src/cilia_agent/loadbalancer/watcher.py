"""Follows ``ServiceService.WatchServices`` into the load-balancer maps.

A stream starts with every Service (UPSERT events) and a message with ``synced``; then
every change. A Service is always sent whole (its frontends are rewritten, the ones it
lost deleted); a DELETE carries namespace and name only. Each new stream is a resync: the
frontends that its listing does not claim — Services deleted while the agent was not
listening, or before a restart — are deleted when ``synced`` arrives (as the ipcache
watcher does). A Service whose maps cannot be written (a map full) is logged and counted
and the stream goes on; the next event of that Service tries again.

Metrics (one registry per agent): ``cilium_services_events_total{action}`` (upstream's
name; add, update, delete) and ``cilia_lb_frontends`` (frontends programmed),
``cilia_lb_service_errors_total`` (Services that could not be programmed),
``cilia_lb_apply_seconds`` (time to write one stream message into the maps).

Each Service's alias VIPs (``alias_ips``, a ServiceCIDR migration's former ClusterIPs)
are also handed to :class:`~cilia_agent.loadbalancer.usage.AliasUsage` when one is given,
which keeps their last-use entries for the operator's release decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.errors import DatapathError
from cilia_agent.loadbalancer.maps import ServiceMapWriter
from cilia_agent.loadbalancer.model import service_name
from cilia_agent.loadbalancer.usage import AliasUsage

log = logging.getLogger(__name__)


class ServiceMetrics:
    """The watcher's metrics in ``registry`` (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.events = Counter(
            "cilium_services_events",
            "Service events applied to the load balancer, by action",
            ["action"],
            registry=registry,
        )
        self.frontends = Gauge(
            "cilia_lb_frontends",
            "Service frontends (VIP, port, protocol) programmed",
            registry=registry,
        )
        self.errors = Counter(
            "cilia_lb_service_errors",
            "Services that could not be written into the load-balancer maps",
            registry=registry,
        )
        self.apply_seconds = Histogram(
            "cilia_lb_apply_seconds",
            "Seconds to write one WatchServices message into the load-balancer maps",
            registry=registry,
        )


class ServiceWatcher:
    """Applies WatchServices streams to a :class:`ServiceMapWriter`.

    Args:
        writer: the map writer (restored from the pinned maps already).
        metrics: see :class:`ServiceMetrics`.
        usage: the alias last-use entries (None: not tracked).
    """

    def __init__(
        self, writer: ServiceMapWriter, metrics: ServiceMetrics, usage: AliasUsage | None = None
    ) -> None:
        self.usage = usage
        self.writer = writer
        self.metrics = metrics
        self.synced = False
        self._synced = asyncio.Event()
        self._known: set[str] = set()

    async def wait_synced(self, timeout: float) -> None:
        """Return once the first stream has delivered every Service (``synced``; it stays
        so through reconnects: the maps keep the last listing meanwhile).

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        if not self.synced:
            await asyncio.wait_for(self._synced.wait(), timeout)

    async def consume(self, stream: AsyncIterable[cp.WatchServicesResponse]) -> bool:
        """Apply every message of ``stream``; returns True when it delivered anything."""
        delivered = False
        resyncing = False
        async for response in stream:
            if not delivered:
                delivered, resyncing = True, True
                self.writer.begin_resync()
                if self.usage is not None:
                    self.usage.begin_resync()
            started = time.perf_counter()
            for event in response.events:
                self.apply(event)
            if response.synced and resyncing:
                resyncing = False
                removed = self.writer.end_resync()
                if self.usage is not None:
                    self.usage.end_resync()
                self.synced = True
                self._synced.set()
                log.info(
                    "services synced",
                    extra={"frontends": len(self.writer.frontends), "removed_stale": removed},
                )
            self.metrics.frontends.set(len(self.writer.frontends))
            self.metrics.apply_seconds.observe(time.perf_counter() - started)
        return delivered

    def apply(self, event: cp.ServiceEvent) -> None:
        """Apply one event (never raises: a failure is logged and counted)."""
        svc = event.service
        name = service_name(svc.namespace, svc.name)
        try:
            if event.type == cp.EVENT_TYPE_DELETE:
                self.writer.delete_service(svc.namespace, svc.name)
                if self.usage is not None:
                    self.usage.set_service(name, ())
                self._known.discard(name)
                self.metrics.events.labels("delete").inc()
                return
            problems = self.writer.upsert_service(svc)
            if self.usage is not None:
                self.usage.set_service(name, svc.alias_ips)
        except DatapathError as exc:
            self.metrics.errors.inc()
            log.error("cannot program Service", extra={"service": name, "reason": str(exc)})
            return
        for problem in problems:
            log.warning("Service entry skipped: %s", problem, extra={"service": name})
        self.metrics.events.labels("update" if name in self._known else "add").inc()
        self._known.add(name)
