"""The IPAM controller's reconcile (one job: reconcile).

One worker takes node and pool names from a deduplicating queue; a node's reconcile brings
its record to its demand through the allocator (every new block claimed in the store before
the record is written), a pool's checks its status. Also the node-network exclusions and the
deleted node's grace period. Part of :class:`.controller.IPAMController`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidResource
from ..kinds import NODE, POOL
from ..store import (
    Conflict,
    Contention,
    NotFound,
    Resource,
    StoreError,
)
from . import claims
from . import node as nodes
from .allocator import Holding
from .pool import (
    PoolSpec,
    pool_spec_from_resource,
)
from .pools import CLUSTER_POOL
from .state import ControllerState

log = logging.getLogger(__name__)


class ReconcileMixin(ControllerState):
    """Work queue and node reconcile of :class:`.controller.IPAMController`."""

    def _held_after_delete(self, name: str) -> bool:
        """True while a deleted node's blocks are still held for it
        (``--node-cidr-release-grace-period``); a reconcile is scheduled for when the grace
        ends. Its routes are withdrawn at once all the same (the node is gone from the node
        stream); only the addresses wait, so pods the node may still run are not duplicated."""
        if self.release_grace <= 0 or not self.allocator.node_blocks(name):
            return False
        if name in self._gone:
            log.info("node's Kubernetes Node deleted; its CIDRs are released at once",
                     extra={"node": name})  # fmt: skip
            return False
        loop = asyncio.get_running_loop()
        deleted = self._deleted_at.setdefault(name, loop.time())
        left = deleted + self.release_grace - loop.time()
        if left <= 0:
            return False
        if left == self.release_grace:
            log.info(
                "node deleted; its CIDRs are held for the grace period",
                extra={"node": name, "release_in_s": round(left, 1)},
            )
        loop.call_later(left, self.enqueue, name)
        return True

    def enqueue(self, name: str) -> None:
        """Schedule a reconcile of node ``name`` (deduplicated while queued)."""
        self._put(("node", name))

    def enqueue_pool(self, name: str) -> None:
        """Schedule a draining check of pool ``name`` (deduplicated while queued)."""
        self._put(("pool", name))

    def _put(self, item: tuple[str, str]) -> None:
        if item not in self._queued:
            self._queued.add(item)
            self._queue.put_nowait(item)

    async def _worker(self) -> None:
        while True:
            item = await self._queue.get()
            self._queued.discard(item)
            what, name = item
            try:
                if what == "pool":
                    await self.sync_draining(name)
                else:
                    await self.reconcile(name)
            except StoreError as exc:
                log.warning("reconcile failed; retrying",
                            extra={what: name, "error": str(exc)})  # fmt: skip
                self.metrics.reconciles.labels("error").inc()
                await asyncio.sleep(self._retry_interval)
                self._put(item)
            except Exception:
                log.exception("reconcile crashed", extra={what: name})
                self.metrics.reconciles.labels("error").inc()

    async def run_queued(self) -> int:
        """Do the queued work now, in queue order, until the queue is empty, as the worker
        would (for a controller started with ``run=False``: the stress test drives it step
        by step). Returns how many items ran.

        Raises:
            StoreError: the store failed (the item is not re-queued).
        """
        done = 0
        while not self._queue.empty():
            item = self._queue.get_nowait()
            self._queued.discard(item)
            what, name = item
            if what == "pool":
                await self.sync_draining(name)
            else:
                await self.reconcile(name)
            done += 1
        return done

    async def drain(self) -> None:
        """Wait until the work queue is empty and the worker idle (tests, benchmarks)."""
        while self._queued or not self._queue.empty():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0)

    async def _reserved(self, name: str, recorded: Mapping[str, Sequence[Any]]) -> set[Any]:
        """Blocks the allocator holds for ``name`` that its record lacks but that are still
        claimed for it (kept); the others were handed back and are freed."""
        listed = {b for blocks in recorded.values() for b in blocks}
        reserved = set()
        for block in self.allocator.holdings(name):
            if block in listed:
                continue
            current = await claims.get_claim(self.store, block)
            if current is not None and current.node == name:
                reserved.add(block)
            elif current is not None:
                self.allocator.occupy(block, Holding(current.node, current.pool))
        return reserved

    async def _stale_pools(
        self, name: str, added: Sequence[tuple[str, ipaddress.IPv4Network]]
    ) -> bool:
        """Re-read the pools blocks were just taken from: a block outside its pool's live
        CIDRs in the store (the allocator's view was stale: the CIDR was removed or the
        pool deleted) is unclaimed and freed, and the pool view refreshed. Returns
        whether any was."""
        stale = False
        for pool in sorted({p for p, _ in added if p != CLUSTER_POOL}):
            try:
                spec: PoolSpec | None = pool_spec_from_resource(
                    await self.store.get(POOL.kind, pool)
                )
            except (NotFound, InvalidResource):
                spec = None
            if spec is not None:
                self.allocator.upsert_pool(spec)
            else:
                self.allocator.remove_pool(pool)
            for p, block in added:
                if p == pool and (spec is None or not spec.contains(block)):
                    log.info("pool changed under the allocator; block not handed out",
                             extra={"node": name, "pool": pool, "cidr": str(block)})  # fmt: skip
                    self.allocator.release(name, block)
                    await claims.unclaim(self.store, block, name)
                    stale = True
        return stale

    async def reconcile(self, name: str) -> None:
        """Bring node ``name``'s record to its demand (see :meth:`MultiPoolAllocator.reconcile`).

        multi-pool: ``spec.ipam.pools.requested`` -> ``allocated``. cluster-pool: one block
        in ``spec.ipam.podCIDRs`` (a node never gets a second). Every new block is claimed
        in the store before the node record is written. A deleted node releases all its
        blocks and their claims.

        Raises:
            StoreError: the store failed; Conflict after ``conflict_retries`` attempts.
        """
        if self.mode == "kubernetes":
            await self._reconcile_from_k8s_node(name)
            return
        if not self.allocator.ready:
            return
        attempt = relearned = 0
        while attempt < self._conflict_retries:
            record = await self._get_node(name)
            if record is None and self._held_after_delete(name):
                return
            self._deleted_at.pop(name, None)  # present again, or released right below
            if record is None:
                released = self.allocator.release_node(name)
                for block in released:
                    await claims.unclaim(self.store, block, name)
                self._set_waiting(name, ())
                if released:
                    log.info("node deleted; CIDRs released", extra={"node": name,
                             "cidrs": [str(b) for b in released]})  # fmt: skip
                    self._publish_stats()
                    for pool in sorted(self.allocator.pools):
                        self.enqueue_pool(pool)
                        self._retry_waiting(pool)
                return
            if self.migrate and self.mode == "multi-pool" and nodes.pod_cidrs(record):
                await self._migrate_node(name)
                attempt += 1
                continue
            recorded = self._recorded(record)
            self._node_networks(name, record)
            if self.mode == "cluster-pool":
                # one podCIDR per node, ever: a node holding one -- even outside the
                # current --cluster-pool-ipv4-cidr (a replaced range: draining) -- gets no
                # second (upstream: cluster-pool CIDRs are appended, never edited)
                held = nodes.pod_cidrs(record)
                requested = {CLUSTER_POOL: 0 if held else 1}
                self._warn_cluster_draining(name, held)
            else:
                requested = {p: n for p, n in nodes.requested(record).items() if p != CLUSTER_POOL}
            reserved = await self._reserved(name, recorded)
            result = self.allocator.reconcile(name, requested, recorded, reserved)
            lost = False
            for pool, block in result.added:
                got = await claims.claim(self.store, block, name, pool)
                if got.node != name:
                    log.info("block claimed by another node; choosing another",
                             extra={"node": name, "cidr": str(block), "holder": got.node})  # fmt: skip
                    self.allocator.occupy(block, Holding(got.node, got.pool))
                    lost = True
            if lost and relearned < 3:
                relearned += 1  # our view of other nodes was stale: learn every claim
                await self._learn_claims()
                continue
            if not lost:
                lost = await self._stale_pools(name, result.added)
            if lost:
                attempt += 1
                continue
            for pool in sorted({p for p, _ in result.freed}):
                self.enqueue_pool(pool)
                self._retry_waiting(pool)
            cluster = result.allocated.pop(CLUSTER_POOL, [])
            conflicts = self.network_conflicts(name)
            if self.mode == "cluster-pool":
                error = result.error.replace(f"pool {CLUSTER_POOL!r}", "cluster-pool")
                error = "; ".join(e for e in (error, *conflicts) if e)
                updated = nodes.with_pod_cidrs(record, cluster, error)
            else:
                error = result.error
                for pool, why in self._conflicting.items():
                    error = error.replace(
                        f"pool {pool!r} not found", f"pool {pool!r} not allocated from: {why}"
                    )
                error = "; ".join(e for e in (error, *conflicts) if e)
                updated = nodes.with_allocation(record, result.allocated, error)
            if updated == record:
                self._set_waiting(name, result.waiting)
                self._count(result.error)
                return
            try:
                await self.store.update(updated)
            except Conflict:
                log.debug(
                    "node changed under us; retrying", extra={"node": name, "attempt": attempt}
                )
                attempt += 1
                continue
            for pool, block in result.added:
                self.metrics.allocations.labels(pool).inc()
                log.info("CIDR allocated", extra={"node": name, "pool": pool, "cidr": str(block)})
            if result.error:
                log.warning("ipam-multi-pool-sync allocation failed",
                            extra={"node": name, "error": result.error})  # fmt: skip
            self._set_waiting(name, result.waiting)
            self._count(result.error)
            self._publish_stats()
            return
        raise Contention(NODE.kind, "", name)

    def _set_waiting(self, name: str, pools: Sequence[str]) -> None:
        """Node ``name`` now waits for a free block of each of ``pools`` (and of no other):
        a pool it starts waiting on records the event-loop time, so the oldest waiter is
        served first (:meth:`_retry_waiting`)."""
        now = asyncio.get_running_loop().time()
        for pool in pools:
            self._waiting.setdefault(pool, {}).setdefault(name, now)
        for pool in [p for p, waiters in self._waiting.items() if name in waiters]:
            if pool not in pools:
                del self._waiting[pool][name]
                if not self._waiting[pool]:
                    del self._waiting[pool]

    def waiting(self, pool: str) -> list[str]:
        """The nodes waiting for a free block of ``pool``, oldest first."""
        waiters = self._waiting.get(pool, {})
        return sorted(waiters, key=lambda node: (waiters[node], node))

    def _retry_waiting(self, pool: str) -> None:
        """The capacity of ``pool`` changed (a block freed, a node deleted, the pool
        extended): queue every node waiting on it, oldest first, so one refused for
        exhaustion is served before a node that asks later (upstream retries a failed
        allocation; agents re-send demand only when it changes)."""
        for node in self.waiting(pool):
            self.enqueue(node)

    def _node_networks(self, name: str, record: Resource | None) -> None:
        """Track node ``name``'s attached networks (``status.localNetworks``) that lie in
        no block it holds (those are its own pod network): the allocator hands out no
        block overlapping them, whenever they were reported (before or after a pool).
        A change re-checks every pool's conflicts (:meth:`sync_draining`)."""
        nets: dict[ipaddress.IPv4Network, str] = {}
        if record is not None:
            held = [b for blocks in self._recorded(record).values() for b in blocks]
            for iface, net in nodes.local_networks(record):
                if not any(net.subnet_of(b) for b in held):
                    nets[net] = f"node {name!r} interface {iface} subnet {net}"
        if self._node_nets.get(name, {}) == nets:
            return
        if nets:
            self._node_nets[name] = nets
        else:
            self._node_nets.pop(name, None)
        union: dict[ipaddress.IPv4Network, str] = dict(self._service_nets)
        for node in sorted(self._node_nets):
            for net, why in self._node_nets[node].items():
                union.setdefault(net, why)
        self.allocator.set_excluded(union)
        for pool in sorted(self.allocator.pools):
            self.enqueue_pool(pool)

    def network_conflicts(self, name: str) -> list[str]:
        """Why node ``name``'s attached networks clash with pool CIDRs, e.g. ``interface
        eth1 subnet 10.1.0.64/26 overlaps pool 'blue' CIDR 10.1.0.0/24: no block
        overlapping it is handed out until the network or the CIDR goes``."""
        out = []
        for net, why in sorted(self._node_nets.get(name, {}).items()):
            for pool, spec in sorted(self.allocator.pools.items()):
                for cidr in spec.cidrs:
                    if net.overlaps(cidr):
                        label = "cluster-pool" if pool == CLUSTER_POOL else f"pool {pool!r}"
                        out.append(
                            f"{why.split(' ', 2)[2]} overlaps {label} CIDR {cidr}: no block "
                            "overlapping it is handed out until the network or the CIDR goes"
                        )
        return out

    def cluster_draining(
        self, pod_cidrs: Sequence[ipaddress.IPv4Network]
    ) -> list[ipaddress.IPv4Network]:
        """The podCIDRs outside every ``--cluster-pool-ipv4-cidr`` (cluster-pool mode): a
        range removed from the flag while nodes held blocks in it. They keep serving
        their nodes and are reported draining (GetStatus, WatchAllocations)."""
        return [b for b in pod_cidrs if not any(b.subnet_of(c) for c in self.cluster_cidrs)]

    def _warn_cluster_draining(self, name: str, held: Sequence[ipaddress.IPv4Network]) -> None:
        for block in self.cluster_draining(held):
            if (name, block) not in self._draining_warned:
                self._draining_warned.add((name, block))
                log.warning(
                    "podCIDR outside --cluster-pool-ipv4-cidr: kept by its node, draining",
                    extra={"node": name, "cidr": str(block),
                           "cluster_cidrs": [str(c) for c in self.cluster_cidrs]},
                )  # fmt: skip

    def _count(self, error: str) -> None:
        self.metrics.reconciles.labels("error" if error else "success").inc()

    def _publish_stats(self) -> None:
        self.metrics.set_pool_stats(self.allocator.stats())

    def _publish_stats_soon(self) -> None:
        """:meth:`_publish_stats` once, on the loop's next turn, however many calls come
        before it: a burst of pool events (an apply of 1,000 pools) costs one publish, not
        one per event over every pool (seconds of a blocked event loop)."""
        if not self._stats_pending:
            self._stats_pending = True
            asyncio.get_running_loop().call_soon(self._publish_pending_stats)

    def _publish_pending_stats(self) -> None:
        self._stats_pending = False
        self._publish_stats()
