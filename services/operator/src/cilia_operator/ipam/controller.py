"""The IPAM controller: keeps the allocator in step with the store and writes nodes.

Start-up order (upstream multi-pool operator, reference: cilium-upstream.md §1):
list pools -> list nodes -> occupy every recorded block (:meth:`restore`) -> only then
reconcile nodes and report ready. Afterwards two store watches (pools, nodes) feed a
single worker that reconciles one node at a time, so the allocator is never used
concurrently. Node writes use optimistic concurrency; a Conflict re-reads and retries.

The node watch also feeds :meth:`subscribe` (used by ``WatchAllocations`` streams):
each subscription holds the newest record of its node, so a slow stream coalesces
changes instead of buffering them.

``--ipam kubernetes`` (upstream's Kubernetes host-scope IPAM): the operator allocates
nothing. A third watch follows the core ``Node`` objects, and a node's reconcile copies
its Node's IPv4 ``spec.podCIDRs`` (set by kube-controller-manager ``--allocate-node-cidrs``
or the cluster's own tooling) into the CiliumNode's ``spec.ipam.podCIDRs``, which the
node's allocation stream carries to its agent. A Node without podCIDRs (or no Node of that
name) is reported in the CiliumNode's operator error, never guessed.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidResource
from ..kinds import NODE, POOL
from ..metrics import Metrics
from ..store import (
    AlreadyExists,
    Conflict,
    Contention,
    Expired,
    NotFound,
    Resource,
    Store,
    StoreError,
    WatchEvent,
    resource_version,
)
from ..tasks import cancel_all
from . import claims
from . import node as nodes
from .allocator import Holding, MultiPoolAllocator
from .pool import (
    DRAINING_FIELD,
    PoolSpec,
    pool_manifest,
    pool_overlaps,
    pool_spec_from_resource,
    pool_specs,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class NodeSubscription:
    """Newest record of one node, for a WatchAllocations stream.

    Attributes:
        node: node name.
        latest: newest record seen by the node watch (None until a change arrives).
        deleted: the node record was deleted.
        pools_generation: bumped on every pool change (draining CIDRs change what the
            stream reports without touching the node record).
        peer: IP address the agent's stream comes from ("" for unix sockets); a second
            agent registering the same node name from another address is refused.
    """

    node: str
    peer: str = ""
    latest: Resource | None = None
    deleted: bool = False
    pools_generation: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


CONFLICTS_FIELD = "nodeNetworkConflicts"
"""``status.nodeNetworkConflicts`` of a pool (Cilia's addition): node networks its CIDRs
overlap; no block overlapping one is handed out while it is listed."""

CONFLICT_FIELD = "conflict"
"""``status.conflict`` of a pool (Cilia's addition): why the controller does not allocate
from it (its CIDRs overlap an older pool's), "" / absent when it does."""


def _created_order(obj: Resource) -> tuple[str, str]:
    """Sort key: creationTimestamp (RFC 3339, seconds), then name."""
    meta = obj.get("metadata") or {}
    return str(meta.get("creationTimestamp") or ""), str(meta.get("name") or "")


CLUSTER_POOL = "_cluster-pool"
"""Pool name the allocator files cluster-pool blocks (``spec.ipam.podCIDRs``) under; not
a valid CiliumPodIPPool name, so it never collides with one."""


@dataclass
class MigrationProgress:
    """Cluster-pool -> multi-pool migration state (``GetStatus``).

    Attributes:
        state: "" (not enabled), "running", "done" or "failed: <reason>".
        nodes_migrated / nodes_total: nodes whose podCIDRs were adopted, of those that
            had podCIDRs when the migration started.
    """

    state: str = ""
    nodes_migrated: int = 0
    nodes_total: int = 0


K8S_NODE_KIND = "Node"
"""Store kind of core v1 Nodes (Kubernetes store only; ``--ipam kubernetes``)."""


def k8s_pod_cidrs(
    name: str, k8s_node: Mapping[str, Any] | None
) -> tuple[list[ipaddress.IPv4Network], str]:
    """The IPv4 pod CIDRs of core Node ``name`` (``spec.podCIDRs``, else ``spec.podCIDR``)
    and the error to report ("" when there are some): ``([10.244.1.0/24], "")``.
    IPv6 entries are skipped (IPv4 only); a malformed one is named in the error."""
    if k8s_node is None:
        return [], (
            f"--ipam kubernetes: no Node object {name!r} in the API server: its pod CIDRs "
            "come from Node.spec.podCIDRs"
        )
    spec = k8s_node.get("spec") or {}
    raw = list(spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else []))
    out: list[ipaddress.IPv4Network] = []
    bad: list[str] = []
    for text in raw:
        try:
            net = ipaddress.ip_network(str(text), strict=True)
        except ValueError:
            bad.append(str(text))
            continue
        if isinstance(net, ipaddress.IPv4Network):
            out.append(net)
    if bad:
        return out, f"--ipam kubernetes: Node {name!r} has malformed spec.podCIDRs {bad}"
    if not out:
        return out, (
            f"--ipam kubernetes: Node {name!r} has no IPv4 spec.podCIDRs: set them "
            "(kube-controller-manager --allocate-node-cidrs, or the cluster's tooling); "
            "its pods get no address until then"
        )
    return out, ""


class MigrationFailed(Exception):
    """The default pool cannot take the nodes' podCIDRs (mask mismatch, overlap)."""


class IPAMController:
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
        self._conflicting: dict[str, str] = {}  # pool -> why it is not allocated from
        self.migrate = migrate
        self.migration = MigrationProgress()
        self.allocator = MultiPoolAllocator()
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

    # -- lifecycle -----------------------------------------------------------------

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

    # -- migration -----------------------------------------------------------------

    async def _migrate(self) -> None:
        """Adopt every node's podCIDRs into the default pool (upstream one-shot job
        ``from-cluster-pool-migration``; reference: cilium-upstream.md §3).

        The default pool is created, or extended with the CIDRs that cover the
        podCIDRs, when needed; its maskSize must equal the podCIDRs' prefix.

        Raises:
            MigrationFailed: the pool cannot take the podCIDRs (nothing was changed).
            StoreError: the store failed.
        """
        self.migration = MigrationProgress(state="running")
        listed = await self.store.list(NODE.kind)
        todo = [o for o in listed.items if nodes.pod_cidrs(o)]
        self.migration.nodes_total = len(todo)
        log.info("migration to multi-pool IPAM started",
                 extra={"nodes": len(todo), "pool": self.default_pool})  # fmt: skip
        if todo:
            blocks = [b for o in todo for b in nodes.pod_cidrs(o)]
            await self._ensure_default_pool(blocks)
        for record in todo:
            name = record["metadata"]["name"]
            await self._migrate_node(name)
            self.migration.nodes_migrated += 1
            log.info("node migrated to multi-pool", extra={
                "node": name, "migrated": self.migration.nodes_migrated,
                "total": self.migration.nodes_total})  # fmt: skip
        self.migration.state = "done"
        log.info("migration to multi-pool IPAM done", extra={"nodes": len(todo)})

    async def _ensure_default_pool(self, blocks: Sequence[ipaddress.IPv4Network]) -> None:
        masks = sorted({b.prefixlen for b in blocks})
        if len(masks) != 1:
            raise MigrationFailed(
                f"nodes' podCIDRs have different prefix lengths {masks}; one pool has one mask"
            )
        mask = masks[0]
        name = self.default_pool
        for _ in range(self._conflict_retries):
            listed = await self.store.list(POOL.kind)
            specs = pool_specs(listed.items)
            current = next((o for o in listed.items if o["metadata"]["name"] == name), None)
            spec = specs.get(name)
            if current is not None and spec is None:
                raise MigrationFailed(f"pool {name!r} is invalid in the store")
            if spec is not None and spec.cidrs and spec.mask_size != mask:
                raise MigrationFailed(
                    f"pool {name!r} has maskSize {spec.mask_size} but the nodes' podCIDRs "
                    f"are /{mask}: the default pool must use the same mask"
                )
            cidrs = list(spec.cidrs) if spec is not None else []
            for block in blocks:
                if any(block.subnet_of(c) for c in cidrs):
                    continue
                cover = next((c for c in self.cluster_cidrs if block.subnet_of(c)), block)
                cidrs.append(cover)
            if spec is not None and list(spec.cidrs) == cidrs:
                return
            overlaps = pool_overlaps(name, cidrs, specs.values())
            if overlaps:
                raise MigrationFailed(f"pool {name!r}: {overlaps[0].reason}")
            try:
                if current is None:
                    await self.store.create(pool_manifest(PoolSpec(name, tuple(cidrs), mask)))
                    log.info("migration created the default pool",
                             extra={"pool": name, "cidrs": [str(c) for c in cidrs]})  # fmt: skip
                else:
                    updated = copy.deepcopy(current)
                    v4 = updated["spec"].setdefault("ipv4", {"maskSize": mask})
                    v4["cidrs"] = [str(c) for c in cidrs]
                    await self.store.update(updated)
                    log.info("migration extended the default pool",
                             extra={"pool": name, "cidrs": [str(c) for c in cidrs]})  # fmt: skip
                return
            except (Conflict, AlreadyExists):
                continue
        raise Contention(POOL.kind, "", name)

    async def _migrate_node(self, name: str) -> None:
        for _ in range(self._conflict_retries * 2):
            record = await self._get_node(name)
            if record is None or not nodes.pod_cidrs(record):
                return
            for block in nodes.pod_cidrs(record):
                await claims.claim(self.store, block, name, self.default_pool)
            try:
                await self.store.update(nodes.migrated(record, self.default_pool))
                return
            except Conflict:
                await asyncio.sleep(0.01)
        raise Contention(NODE.kind, "", name)

    # -- pools ---------------------------------------------------------------------

    async def _load_pools(self) -> str:
        listed = await self.store.list(POOL.kind)
        names = set()
        # oldest first: of two overlapping pools the later one is refused
        for obj in sorted(listed.items, key=_created_order):
            self._upsert_pool(obj)
            names.add(obj["metadata"]["name"])
        for name in set(self.allocator.pools) - names - {CLUSTER_POOL}:
            self.allocator.remove_pool(name)
        return listed.resource_version

    def _upsert_pool(self, obj: Resource) -> None:
        """Give the allocator a stored pool -- unless its CIDRs overlap another pool's
        (live or draining): such a pool got past apply's check (a Kubernetes API server
        without a webhook, a direct store write) and came later, so it is refused: the
        allocator drops it (nodes keep blocks they hold, none is added) and its
        ``status.conflict`` names the other pool (written by :meth:`sync_draining`)."""
        name = str(obj.get("metadata", {}).get("name"))
        try:
            spec = pool_spec_from_resource(obj)
            others = [p for n, p in self.allocator.pools.items() if n not in (name, CLUSTER_POOL)]
            clash = pool_overlaps(name, spec.cidrs, others)
            if clash:
                reason = f"{clash[0].path}: {clash[0].reason}"
                if self._conflicting.get(name) != reason:
                    log.error("CiliumPodIPPool overlaps another pool: not allocated from",
                              extra={"pool": name, "error": reason})  # fmt: skip
                self._conflicting[name] = reason
                self.allocator.remove_pool(name)
                return
            self._conflicting.pop(name, None)
            self.allocator.upsert_pool(spec)
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
            self._conflicting.pop(name, None)
            for other in sorted(self._conflicting):  # one it clashed with may be gone
                self.enqueue_pool(other)
        else:
            self._upsert_pool(event.object)
            self.enqueue_pool(name)
        self._publish_stats()
        for node in sorted(self._known):
            self.enqueue(node)
        self._notify_pools()

    async def _relist_pools(self) -> str:
        rv = await self._load_pools()
        for node in sorted(self._known):
            self.enqueue(node)
        for pool in sorted(self.allocator.pools):
            self.enqueue_pool(pool)
        return rv

    async def sync_draining(self, name: str) -> None:
        """Keep pool ``name``'s ``status.drainingCIDRs`` true: add held blocks that lie
        outside its CIDRs and draining CIDRs (never silently forgotten), drop draining
        CIDRs no held block is inside any more (released).

        Raises:
            StoreError: the store failed (Conflict: re-queued by the worker).
        """
        if name == CLUSTER_POOL:
            return
        try:
            obj = await self.store.get(POOL.kind, name)
        except NotFound:
            return
        try:
            spec = pool_spec_from_resource(obj)
        except InvalidResource:
            return
        if name in self._conflicting:
            self._upsert_pool(obj)  # the pool it clashed with may have changed or gone
        conflict = self._conflicting.get(name, "")
        held = [b for b, h in self.allocator.held().items() if h.pool == name]
        # the store's block claims are the truth a stale replica may not have learnt yet:
        # a draining CIDR is kept while any claimed block of the pool overlaps it
        claimed = [c.block for c in await claims.list_claims(self.store) if c.pool == name]
        keep = [c for c in spec.draining if any(b.overlaps(c) for b in (*held, *claimed))]
        strays = sorted(
            b for b in held if not spec.contains(b) and not any(b.subnet_of(c) for c in keep)
        )
        wanted = keep + strays
        clashes = sorted(
            f"{why} overlaps CIDR {cidr}: no block overlapping it is handed out"
            for net, why in self.allocator.excluded.items()
            for cidr in spec.cidrs
            if net.overlaps(cidr)
        )
        status = obj.get("status") or {}
        if (
            wanted == list(spec.draining)
            and clashes == list(status.get(CONFLICTS_FIELD) or [])
            and conflict == status.get(CONFLICT_FIELD, "")
        ):
            return
        updated = copy.deepcopy(obj)
        updated.setdefault("status", {})[DRAINING_FIELD] = [str(c) for c in wanted]
        updated["status"][CONFLICTS_FIELD] = clashes
        updated["status"][CONFLICT_FIELD] = conflict
        for key in (DRAINING_FIELD, CONFLICTS_FIELD, CONFLICT_FIELD):
            if not updated["status"][key]:
                del updated["status"][key]
        if not updated["status"]:
            del updated["status"]
        await self.store.update(updated)
        if clashes != list(status.get(CONFLICTS_FIELD) or []):
            log.warning("pool CIDRs overlap node networks", extra={"pool": name,
                        "conflicts": clashes})  # fmt: skip
        for cidr in spec.draining:
            if cidr not in keep:
                log.info("draining CIDR released: no block in use",
                         extra={"pool": name, "cidr": str(cidr)})  # fmt: skip
        for block in strays:
            log.warning("CIDR outside its pool still in use: draining it",
                        extra={"pool": name, "cidr": str(block),
                               "node": self.allocator.held()[block].node})  # fmt: skip

    # -- claims --------------------------------------------------------------------

    async def _on_claim(self, event: WatchEvent) -> None:
        parsed = claims.claim_from_resource(event.object)
        if parsed is None:
            return
        if event.type == "DELETED":
            holding = self.allocator.holder(parsed.block)
            if holding is not None:
                self.enqueue(holding.node)
        elif self.allocator.holder(parsed.block) is None:
            self.allocator.occupy(parsed.block, Holding(parsed.node, parsed.pool))
            self.enqueue(parsed.node)

    async def _learn_claims(self) -> None:
        """Occupy every stored claim the allocator does not know yet."""
        for c in await claims.list_claims(self.store):
            if self.allocator.holder(c.block) is None:
                self.allocator.occupy(c.block, Holding(c.node, c.pool))

    async def _relist_claims(self) -> str:
        listed = await self.store.list(claims.KIND)
        for obj in listed.items:
            await self._on_claim(WatchEvent("ADDED", obj, resource_version(obj)))
        for node in sorted(self._known):
            self.enqueue(node)
        return listed.resource_version

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
            if event.type == "ADDED":
                self._gone.discard(name)
        self._node_networks(name, None if event.type == "DELETED" else event.object)
        self.enqueue(name)
        self._notify_node(name, event.object, deleted=event.type == "DELETED")
        if event.type == "DELETED":
            self._run_deleted_hooks(name)

    def _notify_node(self, name: str, record: Resource | None, *, deleted: bool) -> None:
        """Wake node ``name``'s WatchAllocations streams with its newest record."""
        for sub in self._subs.get(name, ()):
            sub.latest = record
            sub.deleted = deleted
            sub.changed.set()

    def _notify_pools(self) -> None:
        """Wake every WatchAllocations stream: a pool changed (draining CIDRs count)."""
        for subs in self._subs.values():
            for sub in subs:
                sub.pools_generation += 1
                sub.changed.set()

    async def _on_k8s_node(self, event: WatchEvent) -> None:
        """A core Node changed (``--ipam kubernetes``): kept, and its CiliumNode reconciled."""
        name = event.object["metadata"]["name"]
        if event.type == "DELETED":
            self._k8s_nodes.pop(name, None)
        else:
            self._k8s_nodes[name] = event.object
        self.enqueue(name)

    async def _relist_k8s(self) -> str:
        """List the core Nodes into :attr:`_k8s_nodes` and reconcile every node."""
        listed = await self.store.list(K8S_NODE_KIND)
        self._k8s_nodes = {o["metadata"]["name"]: o for o in listed.items}
        for name in self._known | set(self._k8s_nodes):
            self.enqueue(name)
        return listed.resource_version

    async def _reconcile_from_k8s_node(self, name: str) -> None:
        """``--ipam kubernetes``: CiliumNode ``name``'s podCIDRs := its Node's IPv4
        ``spec.podCIDRs`` (or ``spec.podCIDR``); none, or no Node: the operator error says
        so and the podCIDRs already recorded stay (a running node keeps its pods' range).

        Raises:
            StoreError: the store failed; Conflict after ``conflict_retries`` attempts.
        """
        for _ in range(self._conflict_retries):
            record = await self._get_node(name)
            if record is None:
                return
            cidrs, error = k8s_pod_cidrs(name, self._k8s_nodes.get(name))
            if not cidrs:
                cidrs = nodes.pod_cidrs(record)
            updated = nodes.with_pod_cidrs(record, cidrs, error)
            if updated == record:
                return
            try:
                await self.store.update(updated)
            except Conflict:
                continue
            if error:
                log.warning("node has no pod CIDRs", extra={"node": name, "error": error})
            else:
                log.info("pod CIDRs from the Node object",
                         extra={"node": name, "cidrs": [str(c) for c in cidrs]})  # fmt: skip
            return
        raise Contention(NODE.kind, "", name)

    async def _relist_nodes(self) -> str:
        listed = await self.store.list(NODE.kind)
        current = {o["metadata"]["name"]: o for o in listed.items}
        for name in self._known | set(current):
            self._node_networks(name, current.get(name))
            self.enqueue(name)
            self._notify_node(name, current.get(name), deleted=name not in current)
        self._known = set(current)
        return listed.resource_version

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

    def on_node_deleted(self, hook: Callable[[str], Awaitable[object]]) -> None:
        """Await ``hook(name)`` (in a task of its own, a failure logged) whenever the leader's
        node watch sees a CiliumNode deleted: the app runs an endpoint GC pass, so the node's
        CiliumEndpoints leave every agent's ipcache at once (standalone and Kubernetes)."""
        self._deleted_hooks.append(hook)

    def _run_deleted_hooks(self, name: str) -> None:
        async def run(hook: Callable[[str], Awaitable[object]]) -> None:
            try:
                await hook(name)
            except Exception as exc:  # a hook's failure must not stop the node watch
                log.warning("node-deleted hook failed", extra={"node": name, "error": str(exc)})

        for hook in self._deleted_hooks:
            task = asyncio.create_task(run(hook), name=f"node-deleted-{name}")
            self._hook_tasks.add(task)
            task.add_done_callback(self._hook_tasks.discard)

    def node_gone(self, name: str) -> None:
        """Node ``name``'s Kubernetes Node was deleted (``ipam.nodegc``): once its CiliumNode
        is gone too, its blocks are released at once, without
        ``--node-cidr-release-grace-period`` (upstream: a node deletion releases its CIDRs;
        the grace covers a CiliumNode deleted while its Node, and maybe its pods, still
        exist). A node registering again under that name clears the mark."""
        self._gone.add(name)
        self.enqueue(name)

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
                if released:
                    log.info("node deleted; CIDRs released", extra={"node": name,
                             "cidrs": [str(b) for b in released]})  # fmt: skip
                    self._publish_stats()
                    for pool in sorted(self.allocator.pools):
                        self.enqueue_pool(pool)
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
            for pool in {p for p, _ in result.freed}:
                self.enqueue_pool(pool)
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
            self._count(result.error)
            self._publish_stats()
            return
        raise Contention(NODE.kind, "", name)

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
        union: dict[ipaddress.IPv4Network, str] = {}
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

    # -- subscriptions -------------------------------------------------------------

    def live_peers(self, name: str) -> set[str]:
        """IP addresses of the agents whose allocation stream for node ``name`` is open."""
        return {sub.peer for sub in self._subs.get(name, ()) if sub.peer}

    # -- followers -----------------------------------------------------------------

    async def observe(self) -> None:
        """A replica that does not lead: keep the ``WatchAllocations`` subscriptions current
        (node and pool watches that only wake the streams; nothing is allocated or written),
        so every replica serves agents and reports ready (a rollout of two replicas can
        finish). :meth:`start` (on becoming leader) stops observing first.

        Raises:
            StoreError: the initial lists failed.
        """
        await self.stop_observing()
        nodes_rv = (await self.store.list(NODE.kind)).resource_version
        pools_rv = (await self.store.list(POOL.kind)).resource_version
        self._observers = [
            asyncio.create_task(
                self._watch(NODE.kind, nodes_rv, self._observe_node, self._relist_observed)
            ),
            asyncio.create_task(
                self._watch(POOL.kind, pools_rv, self._observe_pool, self._relist_observed_pools)
            ),
        ]

    async def stop_observing(self) -> None:
        """Cancel the follower's watches (no-op when not observing)."""
        await cancel_all(self._observers)
        self._observers = []

    async def _observe_node(self, event: WatchEvent) -> None:
        name = event.object["metadata"]["name"]
        self._notify_node(name, event.object, deleted=event.type == "DELETED")

    async def _observe_pool(self, event: WatchEvent) -> None:
        self._notify_pools()

    async def _relist_observed(self) -> str:
        listed = await self.store.list(NODE.kind)
        current = {o["metadata"]["name"]: o for o in listed.items}
        for name in list(self._subs):
            self._notify_node(name, current.get(name), deleted=name not in current)
        return listed.resource_version

    async def _relist_observed_pools(self) -> str:
        listed = await self.store.list(POOL.kind)
        self._notify_pools()
        return listed.resource_version

    def subscribe(self, name: str, peer: str = "") -> NodeSubscription:
        """Follow node ``name``'s record (``peer``: the agent's IP); call :meth:`unsubscribe`
        when done."""
        sub = NodeSubscription(name, peer)
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
