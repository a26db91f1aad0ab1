"""The IPAM controller's view of the pools (one job: pools).

Loads the CiliumPodIPPools into the allocator (oldest first: of two overlapping pools the
later one is refused and its ``status.conflict`` says why), follows their watch, and keeps
each pool's status true (:meth:`PoolsMixin.sync_draining`: draining CIDRs, node-network
conflicts). Part of :class:`.controller.IPAMController`.
"""

from __future__ import annotations

import copy
import logging

from ..errors import InvalidResource
from ..kinds import POOL
from ..store import (
    NotFound,
    Resource,
    WatchEvent,
)
from . import claims
from .pool import (
    DRAINING_FIELD,
    pool_overlaps,
    pool_spec_from_resource,
)
from .state import ControllerState

log = logging.getLogger(__name__)


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


class PoolsMixin(ControllerState):
    """Pool watch, pool view and pool status of :class:`.controller.IPAMController`."""

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
            self._retry_waiting(name)  # extended: its waiting nodes first, oldest first
        self._publish_stats_soon()
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
