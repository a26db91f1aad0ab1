"""The IPAM controller (one job: its lifecycle): keeps the allocator in step with the store
and writes nodes.

Start-up order (upstream multi-pool operator, reference: cilium-upstream.md §1):
list pools -> list nodes -> occupy every recorded block (:meth:`IPAMController.start`,
claims included) -> only then reconcile nodes and report ready. Afterwards the store
watches feed a single worker that reconciles one node at a time, so the allocator is never
used concurrently. Node writes use optimistic concurrency; a Conflict re-reads and retries.

The jobs live in one module each, joined here as mixins of :class:`IPAMController`:

- :mod:`.reconcile`: the work queue and a node's reconcile (demand -> blocks);
- :mod:`.pools`: the pools the allocator serves and each pool's status;
- :mod:`.sources`: the watches (nodes, claims, core Nodes for ``--ipam kubernetes``);
- :mod:`.subscriptions`: ``WatchAllocations`` subscriptions and the follower's watches;
- :mod:`.migration`: cluster-pool -> multi-pool migration.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence

from ..kinds import NODE, POOL
from ..metrics import Metrics
from ..store import (
    Resource,
    Store,
)
from ..tasks import cancel_all
from . import claims
from . import node as nodes
from .allocator import Holding, MultiPoolAllocator
from .migration import MigrationFailed, MigrationMixin, MigrationProgress
from .pool import (
    PoolSpec,
)
from .pools import CLUSTER_POOL, CONFLICT_FIELD, CONFLICTS_FIELD, PoolsMixin
from .reconcile import ReconcileMixin
from .sources import K8S_NODE_KIND, SourcesMixin, k8s_pod_cidrs
from .subscriptions import NodeSubscription, SubscriptionsMixin

__all__ = [
    "CLUSTER_POOL",
    "CONFLICTS_FIELD",
    "CONFLICT_FIELD",
    "K8S_NODE_KIND",
    "IPAMController",
    "MigrationFailed",
    "MigrationProgress",
    "NodeSubscription",
    "k8s_pod_cidrs",
]

log = logging.getLogger(__name__)


class IPAMController(ReconcileMixin, PoolsMixin, SourcesMixin, SubscriptionsMixin, MigrationMixin):
    """Owns the :class:`MultiPoolAllocator` and the reconcile loop (run it on the leader
    only; every block it hands out is claimed in the store first, see :mod:`.claims`,
    so even two running controllers never give one block to two nodes).

    Args:
        store: the Store.
        metrics: where to publish pool gauges and counters.
        mode: ``multi-pool`` (``spec.ipam.pools``), ``cluster-pool``
            (one ``spec.ipam.podCIDRs`` block per node, never more) or ``kubernetes``
            (the Node objects' ``spec.podCIDRs``, see the module docstring).
        default_pool: ``--ipam-default-ip-pool`` (migration target).
        cluster_cidrs / cluster_mask_size: ``--cluster-pool-ipv4-cidr`` and
            ``--cluster-pool-ipv4-mask-size``.
        migrate: ``--enable-cluster-pool-to-multi-pool-migration``.
        conflict_retries: attempts per node write before re-queueing it (>= 1).
        retry_interval: seconds to wait after a store error before relisting (> 0).
        release_grace: ``--node-cidr-release-grace-period`` seconds.
        service_cidrs: ``--service-cluster-ip-range``: no block overlapping one is handed
            out, so a pool CIDR may contain one (upstream's default pod range 10.0.0.0/8
            contains kube-apiserver's default 10.96.0.0/12: its blocks there are skipped;
            upstream would hand them out and shadow ClusterIPs).
    """

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        *,
        mode: str = "multi-pool",
        default_pool: str = "default",
        cluster_cidrs: Sequence[ipaddress.IPv4Network] = (),
        cluster_mask_size: int = 24,
        migrate: bool = False,
        conflict_retries: int = 5,
        retry_interval: float = 1.0,
        release_grace: float = 0.0,
        service_cidrs: Sequence[ipaddress.IPv4Network] = (),
    ) -> None:
        self.store = store
        self.release_grace = release_grace
        # node -> event-loop time its record was found deleted (blocks held until + grace)
        self._deleted_at: dict[str, float] = {}
        # nodes whose Kubernetes Node was deleted: no grace, their blocks go at once
        self._gone: set[str] = set()
        self._deleted_hooks: list[Callable[[str], Awaitable[object]]] = []
        self._hook_tasks: set[asyncio.Task[None]] = set()
        self.metrics = metrics
        self.mode = mode
        self.default_pool = default_pool
        self.cluster_cidrs = tuple(cluster_cidrs)
        self.cluster_mask_size = cluster_mask_size
        self._draining_warned: set[tuple[str, ipaddress.IPv4Network]] = set()
        self._node_nets: dict[str, dict[ipaddress.IPv4Network, str]] = {}
        # the service ranges: no block overlapping one is ever handed out (a pod there
        # would shadow a ClusterIP); fixed for the operator's life
        self._service_nets: dict[ipaddress.IPv4Network, str] = {
            net: f"service CIDR {net} (--service-cluster-ip-range)" for net in service_cidrs
        }
        self._conflicting: dict[str, str] = {}  # pool -> why it is not allocated from
        self.migrate = migrate
        self.migration = MigrationProgress()
        self.allocator = MultiPoolAllocator()
        self.allocator.set_excluded(self._service_nets)
        self.running = False
        self._conflict_retries = max(1, conflict_retries)
        self._retry_interval = retry_interval
        self._queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self._queued: set[tuple[str, str]] = set()
        self._known: set[str] = set()
        self._subs: dict[str, set[NodeSubscription]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._observers: list[asyncio.Task[None]] = []
        # --ipam kubernetes: the core Nodes as the Node watch delivers them (by name)
        self._k8s_nodes: dict[str, Resource] = {}
        # pool -> node -> event-loop time it began waiting for a free block of the pool
        self._waiting: dict[str, dict[str, float]] = {}
        self._stats_pending = False  # a pool-stats publish is scheduled

    async def start(self, run: bool = True) -> None:
        """Migrate (when enabled), restore state from the store and start the watches
        and the worker (``run`` False: restore only; the caller drives
        :meth:`reconcile`, :meth:`sync_draining` and the relists itself -- property tests).

        Returns once every recorded block is occupied (the allocator is ready). A failed
        migration is logged and shown in :attr:`migration`; the allocator then does not
        start (no node gets new blocks until the operator restarts with a fix).

        Raises:
            StoreError: the store failed during the initial lists.
        """
        await self.stop_observing()
        if self.migrate:
            try:
                await self._migrate()
            except MigrationFailed as exc:
                self.migration.state = f"failed: {exc}"
                log.error("migration to multi-pool IPAM failed", extra={"error": str(exc)})
                return
        if self.mode == "cluster-pool":
            self.allocator.upsert_pool(
                PoolSpec(CLUSTER_POOL, self.cluster_cidrs, self.cluster_mask_size)
            )
        pools_rv = await self._load_pools()
        listed = await self.store.list(NODE.kind)
        for obj in listed.items:
            self._node_networks(obj["metadata"]["name"], obj)
        warnings = self.allocator.restore(
            (o["metadata"]["name"], self._recorded(o)) for o in listed.items
        )
        for warning in warnings:
            log.warning("duplicate CIDR in node records", extra={"detail": warning})
        await self._restore_claims(listed.items)
        claims_rv = (await self.store.list(claims.KIND)).resource_version
        self._known = {o["metadata"]["name"] for o in listed.items}
        log.info(
            "ipam allocator restored",
            extra={"nodes": len(listed.items), "pools": sorted(self.allocator.pools),
                   "mode": self.mode},
        )  # fmt: skip
        self._publish_stats()
        for name in sorted(self._known):
            self.enqueue(name)
        for pool in sorted(self.allocator.pools):
            self.enqueue_pool(pool)
        if not run:
            return
        if self.mode == "kubernetes":
            nodes_rv = await self._relist_k8s()
            self._tasks.append(
                asyncio.create_task(
                    self._watch(K8S_NODE_KIND, nodes_rv, self._on_k8s_node, self._relist_k8s)
                )
            )
        self._tasks += [
            asyncio.create_task(
                self._watch(POOL.kind, pools_rv, self._on_pool, self._relist_pools)
            ),
            asyncio.create_task(
                self._watch(NODE.kind, listed.resource_version, self._on_node, self._relist_nodes)
            ),
            asyncio.create_task(
                self._watch(claims.KIND, claims_rv, self._on_claim, self._relist_claims)
            ),
            asyncio.create_task(self._worker()),
        ]
        self.running = True

    async def stop(self) -> None:
        """Cancel the watches and the worker and wait for them (see :func:`cancel_all`:
        a cancellation the redis client swallowed is repeated)."""
        await self.stop_observing()
        await cancel_all([*self._tasks, *self._hook_tasks])
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.warning("controller task failed", extra={"error": str(task.exception())})
        self._tasks = []
        self.running = False

    def _recorded(self, record: Resource) -> dict[str, list[ipaddress.IPv4Network]]:
        """Every block a node record holds: ``pools.allocated`` plus ``podCIDRs``
        (filed under :data:`CLUSTER_POOL`)."""
        out = nodes.allocated(record)
        pod = nodes.pod_cidrs(record)
        if pod:
            out[CLUSTER_POOL] = pod
        return out

    async def _restore_claims(self, records: Sequence[Resource]) -> None:
        """Occupy claimed blocks no record lists yet; claim recorded unclaimed blocks."""
        stored = {c.block: c for c in await claims.list_claims(self.store)}
        for c in stored.values():
            if self.allocator.holder(c.block) is None:
                other = self.allocator.occupy(c.block, Holding(c.node, c.pool))
                if other is not None:
                    log.warning("claim overlaps a held block", extra={
                        "cidr": str(c.block), "node": c.node, "holder": other.node})  # fmt: skip
        for record in records:
            name = record["metadata"]["name"]
            for pool, blocks in self._recorded(record).items():
                for block in blocks:
                    if block in stored:
                        continue
                    got = await claims.claim(self.store, block, name, pool)
                    if got.node != name:
                        log.warning("recorded CIDR is claimed by another node", extra={
                            "cidr": str(block), "node": name, "holder": got.node})  # fmt: skip
