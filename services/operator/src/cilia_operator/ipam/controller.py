"""The IPAM controller: keeps the allocator in step with the store and writes nodes.

Start-up order (upstream multi-pool operator, reference: cilium-upstream.md §1):
list pools -> list nodes -> occupy every recorded block (:meth:`restore`) -> only then
reconcile nodes and report ready. Afterwards two store watches (pools, nodes) feed a
single worker that reconciles one node at a time, so the allocator is never used
concurrently. Node writes use optimistic concurrency; a Conflict re-reads and retries.

The node watch also feeds :meth:`subscribe` (used by ``WatchAllocations`` streams):
each subscription holds the newest record of its node, so a slow stream coalesces
changes instead of buffering them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ..errors import InvalidResource
from ..kinds import NODE, POOL
from ..metrics import Metrics
from ..store import (
    Conflict,
    Contention,
    Expired,
    NotFound,
    Resource,
    Store,
    StoreError,
    WatchEvent,
)
from ..tasks import cancel_all
from . import node as nodes
from .allocator import MultiPoolAllocator
from .pool import pool_spec_from_resource

log = logging.getLogger(__name__)


@dataclass(eq=False)
class NodeSubscription:
    """Newest record of one node, for a WatchAllocations stream.

    Attributes:
        node: node name.
        latest: newest record seen by the node watch (None until a change arrives).
        deleted: the node record was deleted.
    """

    node: str
    latest: Resource | None = None
    deleted: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class IPAMController:
    """Owns the :class:`MultiPoolAllocator` and the reconcile loop.

    Args:
        store: the Store.
        metrics: where to publish pool gauges and counters.
        conflict_retries: attempts per node write before re-queueing it (>= 1).
        retry_interval: seconds to wait after a store error before relisting (> 0).
    """

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        *,
        conflict_retries: int = 5,
        retry_interval: float = 1.0,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.allocator = MultiPoolAllocator()
        self._conflict_retries = max(1, conflict_retries)
        self._retry_interval = retry_interval
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._known: set[str] = set()
        self._subs: dict[str, set[NodeSubscription]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Restore state from the store and start the watches and the worker.

        Returns once every recorded block is occupied (the allocator is ready).

        Raises:
            StoreError: the store failed during the initial lists.
        """
        pools_rv = await self._load_pools()
        listed = await self.store.list(NODE.kind)
        warnings = self.allocator.restore(
            (o["metadata"]["name"], nodes.allocated(o)) for o in listed.items
        )
        for warning in warnings:
            log.warning("duplicate CIDR in node records", extra={"detail": warning})
        self._known = {o["metadata"]["name"] for o in listed.items}
        log.info(
            "ipam allocator restored",
            extra={"nodes": len(listed.items), "pools": sorted(self.allocator.pools)},
        )
        self._publish_stats()
        for name in sorted(self._known):
            self.enqueue(name)
        self._tasks = [
            asyncio.create_task(
                self._watch(POOL.kind, pools_rv, self._on_pool, self._relist_pools)
            ),
            asyncio.create_task(
                self._watch(NODE.kind, listed.resource_version, self._on_node, self._relist_nodes)
            ),
            asyncio.create_task(self._worker()),
        ]

    async def stop(self) -> None:
        """Cancel the watches and the worker and wait for them (see :func:`cancel_all`:
        a cancellation the redis client swallowed is repeated)."""
        await cancel_all(self._tasks)
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.warning("controller task failed", extra={"error": str(task.exception())})
        self._tasks = []

    # -- pools ---------------------------------------------------------------------

    async def _load_pools(self) -> str:
        listed = await self.store.list(POOL.kind)
        names = set()
        for obj in listed.items:
            self._upsert_pool(obj)
            names.add(obj["metadata"]["name"])
        for name in set(self.allocator.pools) - names:
            self.allocator.remove_pool(name)
        return listed.resource_version

    def _upsert_pool(self, obj: Resource) -> None:
        try:
            self.allocator.upsert_pool(pool_spec_from_resource(obj))
        except InvalidResource as exc:
            log.error(
                "ignoring invalid CiliumPodIPPool",
                extra={"pool": obj.get("metadata", {}).get("name"), "error": str(exc)},
            )

    async def _on_pool(self, event: WatchEvent) -> None:
        name = event.object["metadata"]["name"]
        if event.type == "DELETED":
            holders = self.allocator.pool_holders(name)
            if holders:
                log.warning("pool still in use by node", extra={"pool": name, "nodes": holders})
            self.allocator.remove_pool(name)
        else:
            self._upsert_pool(event.object)
        self._publish_stats()
        for node in sorted(self._known):
            self.enqueue(node)

    async def _relist_pools(self) -> str:
        rv = await self._load_pools()
        for node in sorted(self._known):
            self.enqueue(node)
        return rv

    # -- nodes ---------------------------------------------------------------------

    async def _get_node(self, name: str) -> Resource | None:
        try:
            return await self.store.get(NODE.kind, name)
        except NotFound:
            return None

    async def _on_node(self, event: WatchEvent) -> None:
        name = event.object["metadata"]["name"]
        if event.type == "DELETED":
            self._known.discard(name)
        else:
            self._known.add(name)
        self.enqueue(name)
        for sub in self._subs.get(name, ()):
            sub.latest = event.object
            sub.deleted = event.type == "DELETED"
            sub.changed.set()

    async def _relist_nodes(self) -> str:
        listed = await self.store.list(NODE.kind)
        current = {o["metadata"]["name"]: o for o in listed.items}
        for name in self._known | set(current):
            self.enqueue(name)
            for sub in self._subs.get(name, ()):
                sub.latest = current.get(name)
                sub.deleted = name not in current
                sub.changed.set()
        self._known = set(current)
        return listed.resource_version

    def enqueue(self, name: str) -> None:
        """Schedule a reconcile of node ``name`` (deduplicated while queued)."""
        if name not in self._queued:
            self._queued.add(name)
            self._queue.put_nowait(name)

    async def _worker(self) -> None:
        while True:
            name = await self._queue.get()
            self._queued.discard(name)
            try:
                await self.reconcile(name)
            except StoreError as exc:
                log.warning("reconcile failed; retrying", extra={"node": name, "error": str(exc)})
                self.metrics.reconciles.labels("error").inc()
                await asyncio.sleep(self._retry_interval)
                self.enqueue(name)
            except Exception:
                log.exception("reconcile crashed", extra={"node": name})
                self.metrics.reconciles.labels("error").inc()

    async def reconcile(self, name: str) -> None:
        """Bring node ``name``'s record to its demand (see :meth:`MultiPoolAllocator.reconcile`).

        A deleted node releases all its blocks.

        Raises:
            StoreError: the store failed; Conflict after ``conflict_retries`` attempts.
        """
        for attempt in range(self._conflict_retries):
            record = await self._get_node(name)
            if record is None:
                released = self.allocator.release_node(name)
                if released:
                    log.info("node deleted; CIDRs released", extra={"node": name,
                             "cidrs": [str(b) for b in released]})  # fmt: skip
                    self._publish_stats()
                return
            result = self.allocator.reconcile(
                name, nodes.requested(record), nodes.allocated(record)
            )
            updated = nodes.with_allocation(record, result.allocated, result.error)
            if updated == record:
                self._count(result.error)
                return
            try:
                await self.store.update(updated)
            except Conflict:
                log.debug(
                    "node changed under us; retrying", extra={"node": name, "attempt": attempt}
                )
                continue
            for pool, block in result.added:
                self.metrics.allocations.labels(pool).inc()
                log.info("CIDR allocated", extra={"node": name, "pool": pool, "cidr": str(block)})
            if result.error:
                log.warning("ipam-multi-pool-sync allocation failed",
                            extra={"node": name, "error": result.error})  # fmt: skip
            self._count(result.error)
            self._publish_stats()
            return
        raise Contention(NODE.kind, "", name)

    def _count(self, error: str) -> None:
        self.metrics.reconciles.labels("error" if error else "success").inc()

    def _publish_stats(self) -> None:
        self.metrics.set_pool_stats(self.allocator.stats())

    # -- subscriptions -------------------------------------------------------------

    def subscribe(self, name: str) -> NodeSubscription:
        """Follow node ``name``'s record; call :meth:`unsubscribe` when done."""
        sub = NodeSubscription(name)
        self._subs.setdefault(name, set()).add(sub)
        return sub

    def unsubscribe(self, sub: NodeSubscription) -> None:
        """Stop following."""
        subs = self._subs.get(sub.node)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.node]

    # -- watch loop ----------------------------------------------------------------

    async def _watch(
        self,
        kind: str,
        since: str,
        on_event: Callable[[WatchEvent], Awaitable[None]],
        relist: Callable[[], Awaitable[str]],
    ) -> None:
        while True:
            try:
                async for event in self.store.watch(kind, since):
                    since = event.resource_version
                    await on_event(event)
            except Expired as exc:
                log.info("watch expired; relisting", extra={"kind": kind, "error": str(exc)})
            except StoreError as exc:
                log.warning("watch failed; relisting", extra={"kind": kind, "error": str(exc)})
                await asyncio.sleep(self._retry_interval)
            while True:
                try:
                    since = await relist()
                    break
                except StoreError as exc:
                    log.warning("relist failed", extra={"kind": kind, "error": str(exc)})
                    await asyncio.sleep(self._retry_interval)
