"""The IPAM controller's cluster-pool -> multi-pool migration (one job: migration).

Upstream's one-shot ``from-cluster-pool-migration`` (reference: cilium-upstream.md §3):
every node's ``spec.ipam.podCIDRs`` is adopted into the default pool, which is created or
extended to cover them. Part of :class:`.controller.IPAMController`.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ..kinds import NODE, POOL
from ..store import (
    AlreadyExists,
    Conflict,
    Contention,
)
from . import claims
from . import node as nodes
from .pool import (
    PoolSpec,
    pool_manifest,
    pool_overlaps,
    pool_specs,
)
from .state import ControllerState

log = logging.getLogger(__name__)


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


class MigrationFailed(Exception):
    """The default pool cannot take the nodes' podCIDRs (mask mismatch, overlap)."""


class MigrationMixin(ControllerState):
    """Cluster-pool to multi-pool migration of :class:`.controller.IPAMController`."""

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
