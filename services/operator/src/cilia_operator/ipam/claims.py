"""Block claims: one store record per handed-out block, created before a node gets it.

Two allocators on the same store (a second replica, an old leader that has not noticed
it lost the lease, a restart racing its predecessor) each see only their own memory; the
per-node resourceVersion check cannot stop them giving one block to two *different*
nodes. A claim closes that gap with the store's atomic create: a block goes into a
node's record only after a ``CiliaIPAMBlock`` named after the block was created for that
node (``AlreadyExists`` for another node = someone else has it). Claims are deleted when
the node hands the block back or the node record is deleted.

Record shape (cluster-scoped, works on any Store backend)::

    apiVersion: cilia.io/v1alpha1
    kind: CiliaIPAMBlock
    metadata: {name: 10.0.1.0-24}
    spec: {cidr: 10.0.1.0/24, node: n1, pool: default}
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from ..store import AlreadyExists, Conflict, NotFound, Resource, Store, resource_version

API_VERSION = "cilia.io/v1alpha1"
KIND = "CiliaIPAMBlock"


def claim_name(block: ipaddress.IPv4Network) -> str:
    """Record name of ``block``: ``10.0.1.0/24`` -> ``10.0.1.0-24``."""
    return f"{block.network_address}-{block.prefixlen}"


@dataclass(frozen=True)
class Claim:
    """A stored claim: ``block`` held by ``node`` under ``pool``."""

    block: ipaddress.IPv4Network
    node: str
    pool: str
    resource_version: str = ""


def claim_from_resource(obj: Resource) -> Claim | None:
    """Parse a stored claim (None when malformed)."""
    spec = obj.get("spec") or {}
    try:
        block = ipaddress.IPv4Network(str(spec.get("cidr")))
    except ValueError:
        return None
    return Claim(block, str(spec.get("node") or ""), str(spec.get("pool") or ""),
                 resource_version(obj))  # fmt: skip


def claim_manifest(block: ipaddress.IPv4Network, node: str, pool: str) -> dict[str, Any]:
    """The record claiming ``block`` for ``node``."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": claim_name(block)},
        "spec": {"cidr": str(block), "node": node, "pool": pool},
    }


async def get_claim(store: Store, block: ipaddress.IPv4Network) -> Claim | None:
    """The claim of ``block`` (None when unclaimed).

    Raises:
        StoreError: the store failed.
    """
    try:
        return claim_from_resource(await store.get(KIND, claim_name(block)))
    except NotFound:
        return None


async def claim(store: Store, block: ipaddress.IPv4Network, node: str, pool: str) -> Claim:
    """Claim ``block`` for ``node``; returns the claim that holds it afterwards.

    The result's ``node`` is ``node`` when the claim was created now or already was
    ``node``'s (its pool is updated then); another node's name when it holds the block.

    Raises:
        StoreError: the store failed.
    """
    for _ in range(5):
        try:
            created = await store.create(claim_manifest(block, node, pool))
            return Claim(block, node, pool, resource_version(created))
        except AlreadyExists:
            current = await get_claim(store, block)
            if current is None:
                continue  # released in between: try again
            if current.node == node and current.pool != pool:
                obj = claim_manifest(block, node, pool)
                obj["metadata"]["resourceVersion"] = current.resource_version
                try:
                    await store.update(obj)
                except (Conflict, NotFound):
                    continue
            return current
    current = await get_claim(store, block)
    return current if current is not None else Claim(block, "", pool)


async def unclaim(store: Store, block: ipaddress.IPv4Network, node: str) -> bool:
    """Delete ``node``'s claim of ``block``; another node's claim is left alone.

    Returns whether a claim was deleted.

    Raises:
        StoreError: the store failed.
    """
    for _ in range(5):
        current = await get_claim(store, block)
        if current is None or current.node != node:
            return False
        try:
            await store.delete(KIND, claim_name(block), "", current.resource_version)
            return True
        except NotFound:
            return False
        except Conflict:
            continue
    return False


async def list_claims(store: Store) -> list[Claim]:
    """Every stored claim (malformed records skipped).

    Raises:
        StoreError: the store failed.
    """
    out = []
    for obj in (await store.list(KIND)).items:
        parsed = claim_from_resource(obj)
        if parsed is not None:
            out.append(parsed)
    return out
