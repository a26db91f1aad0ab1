"""The node's IPAM against the operator: apply each allocation, compute the demand.

- :meth:`IPAMManager.apply_allocation` takes a ``NodeAllocation`` into IPAM
  (:meth:`~cilia_agent.ipam.node.NodePools.apply`): new CIDRs are added (cluster-pool:
  ``pod_cidrs``; both modes: the pools, the default pool also from ``pod_cidrs``); CIDRs the
  operator no longer lists are dropped only when no address in them is in use; draining
  CIDRs give out no new address. Then the node chooses its router IP if it has none, the
  node state is persisted, readiness re-checked and the demand recomputed.
- :meth:`IPAMManager.demand` is what ``UpdateDemand`` sends (None in cluster-pool mode);
  CIDRs handed back by it are persisted at once.
- A failed allocation grows the demand: it is sent at once, and again when the request's
  ``--ipam-pending-allocation-ttl`` has run out (it then no longer counts: a pool nothing
  else uses is handed back without waiting for another change).

The gauges ``cilium_ip_addresses`` and ``cilium_ipam_capacity`` follow every change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.controlplane import Demand as SentDemand
from cilia_agent.ipam.allocator import IPAM
from cilia_agent.ipam.node import Demand, NodePools
from cilia_agent.metrics import Metrics

log = logging.getLogger(__name__)


class NodeHooks(Protocol):
    """What IPAM changes on the local node (``cilia_agent.node.LocalNode``)."""

    @property
    def default_pool(self) -> str:
        """The default pool's name."""

    @property
    def lock(self) -> asyncio.Lock:
        """Held while an allocation is applied and the state written."""

    async def router_ip_changed(self) -> None:
        """Choose the router IP from the CIDRs if none yet."""

    async def persist(self) -> None:
        """Write the node state (IPAM's CIDRs included)."""

    async def check_ready(self) -> None:
        """Re-evaluate readiness."""


class IPAMManager:
    """Applies allocations and computes the demand.

    Args:
        ipam: the node allocator.
        pools: the allocation ↔ CIDR bookkeeping.
        node: the local node.
        metrics: the agent's metrics (IPAM gauges).
        pending_ttl: ``--ipam-pending-allocation-ttl`` (s).
    """

    def __init__(
        self, ipam: IPAM, pools: NodePools, node: NodeHooks, metrics: Metrics, pending_ttl: float
    ) -> None:
        self.ipam = ipam
        self.pools = pools
        self.node = node
        self.metrics = metrics
        self.pending_ttl = pending_ttl
        self._listeners: list[Callable[[], None]] = []

    def on_demand_changed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the event loop) whenever the demand may have changed."""
        self._listeners.append(callback)

    def demand_changed(self) -> None:
        """Endpoints or CIDRs changed: update the gauges and tell the listeners."""
        self.update_gauges()
        for callback in self._listeners:
            callback()

    def start(self) -> None:
        """Hook IPAM's failed allocations into the demand (call on the running loop)."""
        loop = asyncio.get_running_loop()

        def pending() -> None:  # runs on any thread: IPAM is called from workers too
            loop.call_soon_threadsafe(self.demand_changed)
            loop.call_soon_threadsafe(loop.call_later, self.pending_ttl + 0.5, self.demand_changed)

        self.ipam.on_pending = pending
        self.update_gauges()

    async def apply_allocation(self, allocation: cp.NodeAllocation) -> None:
        """Take the node's allocation from the operator (see the module docstring)."""
        async with self.node.lock:
            if allocation.error:
                log.warning("operator reports an IPAM error", extra={"error": allocation.error})
            change = self.pools.apply(
                self.node.default_pool,
                {p.pool: list(p.cidrs) for p in allocation.pools},
                list(allocation.pod_cidrs),
                {p.pool: list(p.cidrs) for p in allocation.draining},
                allocation.error,
                {p.pool: (p.allow_first_ip, p.allow_last_ip) for p in allocation.pools},
                allocation.resource_version,
            )
            if change.stale:
                return
            for pool, reason in change.rejected.items():
                log.error("allocation rejected", extra={"pool": pool, "reason": reason})
            for pool, cidrs in change.added.items():
                log.info("CIDRs added", extra={"pool": pool, "cidrs": cidrs})
            for pool, cidrs in change.dropped.items():
                log.info("CIDRs dropped", extra={"pool": pool, "cidrs": cidrs})
            for pool, cidrs in change.draining.items():
                log.info("CIDRs draining", extra={"pool": pool, "cidrs": cidrs})
            await self.node.router_ip_changed()
            await self.node.persist()
            self.update_gauges()
            await self.node.check_ready()
        self.demand_changed()

    async def demand(self) -> Demand | None:
        """The demand to send (None in cluster-pool mode); persists CIDRs handed back."""
        demand = self.pools.demand(self.node.default_pool)
        if demand is not None and demand.handed_back_now:
            async with self.node.lock:
                await self.node.persist()
            self.update_gauges()
        return demand

    def demand_sent(self, demand: SentDemand, resource_version: str) -> None:
        """The operator accepted ``demand`` (its write of the node: ``resource_version``)."""
        self.pools.release_acknowledged(demand.released, resource_version)

    def update_gauges(self) -> None:
        """``cilium_ip_addresses`` / ``cilium_ipam_capacity`` from IPAM's pools."""
        status = self.ipam.status()
        self.metrics.ip_addresses.labels(family="ipv4").set(sum(p.used for p in status))
        self.metrics.ipam_capacity.labels(family="ipv4").set(sum(p.capacity for p in status))
