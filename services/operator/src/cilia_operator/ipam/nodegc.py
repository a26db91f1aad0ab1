"""Node lifecycle in Kubernetes mode: a CiliumNode follows its Kubernetes Node.

Upstream has two mechanisms and Cilia keeps both:

- **ownerReference** (upstream's agent writes it): every CiliumNode whose Node exists gets
  ``metadata.ownerReferences: [{apiVersion: v1, kind: Node, name, uid}]``, written when the
  agent registers (``NodeService.Register``) and whenever the Node appears or changes. The API
  server's garbage collector (kube-controller-manager) then deletes the CiliumNode when the
  Node goes, even while no operator runs.
- **operator GC** (upstream ``operator/watchers/cilium_node_gc.go``, ``--nodes-gc-interval``):
  the leader watches the Nodes. A Node DELETED event deletes its CiliumNode at once (no
  wait on kube-controller-manager, which test clusters may not run; its GC is also the slower
  path); a periodic pass deletes a CiliumNode whose owner Node (by uid) is gone, and one
  without an ownerReference whose Node is missing on two passes in a row (upstream's
  candidate rule: an agent may register a moment before its Node is visible).

A Node deletion also tells the IPAM controller (:meth:`IPAMController.node_gone`) to release
the node's blocks at once instead of after ``--node-cidr-release-grace-period``; the IPAM
controller's node-deleted hook then runs an endpoint GC pass (the node's CiliumEndpoints go,
so every peer's ipcache drops them). Every peer's routes and tunnel entries go when the CiliumNode leaves the
operator's node stream. Deletes carry the record's resourceVersion precondition.

The Node's ``InternalIP`` addresses are written first in the CiliumNode's
``spec.addresses`` (:func:`merged_addresses`): peers take the first one as the next hop.

Leader-only; ``--store kubernetes`` only (the Redis store has no Nodes).
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from ..store import Conflict, Expired, NotFound, Resource, Store, StoreError, resource_version
from ..tasks import cancel_all
from . import node as nodes

log = logging.getLogger(__name__)

K8S_NODE_KIND = "Node"


def internal_ips(k8s_node: Mapping[str, Any]) -> list[str]:
    """The Node's ``status.addresses`` of type ``InternalIP``, IPv4 first, in order."""
    found: list[str] = []
    for entry in (k8s_node.get("status") or {}).get("addresses") or []:
        if isinstance(entry, dict) and entry.get("type") == "InternalIP":
            try:
                found.append(str(ipaddress.ip_address(str(entry.get("address")))))
            except ValueError:
                continue
    return sorted(found, key=lambda a: ipaddress.ip_address(a).version)


def owner_reference(k8s_node: Mapping[str, Any]) -> dict[str, str]:
    """The ownerReference naming ``k8s_node`` (no ``blockOwnerDeletion``: that would need
    rights on the Node's finalizers)."""
    meta = k8s_node.get("metadata") or {}
    return {"apiVersion": "v1", "kind": "Node", "name": str(meta.get("name", "")),
            "uid": str(meta.get("uid", ""))}  # fmt: skip


def merged_addresses(node_ips: Sequence[str], registered: Sequence[str]) -> list[dict[str, str]]:
    """``spec.addresses``: the Node's InternalIPs first, then the addresses the agent
    registered that are not among them, all of type InternalIP."""
    ordered = [*node_ips, *(a for a in registered if a not in node_ips)]
    return [{"type": "InternalIP", "ip": a} for a in ordered]


def adopted(record: Resource, k8s_node: Mapping[str, Any] | None) -> Resource:
    """A copy of CiliumNode ``record`` owned by ``k8s_node`` with its InternalIPs first (the
    record itself when ``k8s_node`` is None)."""
    if k8s_node is None:
        return record
    out = copy.deepcopy(record)
    out["metadata"]["ownerReferences"] = [owner_reference(k8s_node)]
    ips = internal_ips(k8s_node)
    if ips:
        current = [a.get("ip", "") for a in (out.get("spec") or {}).get("addresses") or []]
        out.setdefault("spec", {})["addresses"] = merged_addresses(ips, current)
    return out


def _identity(k8s_node: Mapping[str, Any]) -> tuple[str, list[str]]:
    """What a CiliumNode takes from its Node: the uid and the InternalIPs."""
    return str((k8s_node.get("metadata") or {}).get("uid") or ""), internal_ips(k8s_node)


def _owner_uid(record: Resource) -> str:
    for ref in (record.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("kind") == "Node":
            return str(ref.get("uid") or "")
    return ""


class NodeGC:
    """See the module docstring.

    Args:
        store: the Kubernetes store (Nodes read, CiliumNodes written).
        interval: ``--nodes-gc-interval`` seconds (0: no periodic pass; events still act).
        release: called with a node's name just before its CiliumNode is deleted because
            its Node is gone (:meth:`IPAMController.node_gone`: no release grace).
        on_gone: awaited with a node's name after that delete (a failure is logged).
        retry_interval: seconds after a store error before the watch is reopened.
        conflict_retries: attempts of one CiliumNode write.
    """

    def __init__(
        self,
        store: Store,
        *,
        interval: float,
        release: Callable[[str], None] | None = None,
        on_gone: Sequence[Callable[[str], Awaitable[object]]] = (),
        retry_interval: float = 1.0,
        conflict_retries: int = 5,
    ) -> None:
        self.store = store
        self.interval = interval
        self.release = release
        self.on_gone = list(on_gone)
        self.retry_interval = retry_interval
        self.conflict_retries = max(1, conflict_retries)
        self.k8s_nodes: dict[str, Resource] = {}
        self._candidates: set[str] = set()
        self._pass = asyncio.Lock()  # one pass at a time: each replaces the candidate set
        #: set once the Nodes were listed and the first (marking) pass ran
        self.listed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the Node watch and the periodic pass."""
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._follow(), name="node-gc-watch")]
            if self.interval > 0:
                self._tasks.append(asyncio.create_task(self._periodic(), name="node-gc"))

    async def stop(self) -> None:
        """Stop both tasks (see :func:`cancel_all`)."""
        await cancel_all(self._tasks)
        self._tasks = []

    # -- the Node watch --------------------------------------------------------------------

    async def _relist(self) -> str:
        listed = await self.store.list(K8S_NODE_KIND)
        self.k8s_nodes = {o["metadata"]["name"]: o for o in listed.items}
        await self.run_once(candidates=False)
        self.listed.set()
        return listed.resource_version

    async def _follow(self) -> None:
        rv = ""
        while True:
            try:
                if not rv:
                    rv = await self._relist()
                async for event in self.store.watch(K8S_NODE_KIND, rv):
                    rv = event.resource_version or rv
                    await self.node_event(event.type, event.object)
                rv = ""  # the watch ended: relist
            except Expired:
                rv = ""
            except StoreError as exc:
                log.warning("node watch failed; retrying", extra={"error": str(exc)})
                rv = ""
                await asyncio.sleep(self.retry_interval)

    async def node_event(self, kind: str, k8s_node: Resource) -> None:
        """One Node event: ``DELETED`` deletes its CiliumNode, others adopt it.

        Raises:
            StoreError: the store failed.
        """
        name = k8s_node["metadata"]["name"]
        if kind == "DELETED":
            self.k8s_nodes.pop(name, None)
            await self._delete(name, str(k8s_node["metadata"].get("uid") or ""), "Node deleted")
            return
        old = self.k8s_nodes.get(name)
        self.k8s_nodes[name] = k8s_node
        if old is not None and _identity(old) == _identity(k8s_node):
            return  # a status heartbeat: neither the uid nor the InternalIPs changed
        await self.adopt(name)

    # -- actions ---------------------------------------------------------------------------

    async def adopt(self, name: str) -> None:
        """Write the ownerReference and InternalIPs of Node ``name`` into its CiliumNode
        (nothing when either is missing or nothing changes).

        Raises:
            StoreError: the store failed (Conflict after the retries).
        """
        for _ in range(self.conflict_retries):
            k8s_node = self.k8s_nodes.get(name)
            try:
                record = await self.store.get(nodes.KIND, name)
            except NotFound:
                return
            desired = adopted(record, k8s_node)
            if desired == record:
                return
            try:
                await self.store.update(desired)
                return
            except Conflict:
                continue

    async def _delete(self, name: str, uid: str, reason: str) -> bool:
        """Delete CiliumNode ``name`` unless a Node of another uid owns it now (``uid`` empty:
        an orphan, kept once any Node owns it or a Node of its name appears); True when
        deleted (then the IPAM release and the ``on_gone`` hooks ran).

        A Conflict (the IPAM controller rewrote the record between the read and the delete,
        e.g. to write its ``spec.ipam.podCIDRs``) reads it again and retries, up to
        ``conflict_retries`` times, so a record being written is not kept for another pass.
        """
        for _ in range(self.conflict_retries):
            try:
                record = await self.store.get(nodes.KIND, name)
            except NotFound:
                return False
            owner = _owner_uid(record)
            if owner and owner != uid:
                return False  # a new Node of that name adopted it meanwhile
            if not uid and name in self.k8s_nodes:
                return False  # an orphan whose Node appeared meanwhile
            if self.release is not None:  # before the delete: no grace for these blocks
                self.release(name)
            try:
                await self.store.delete(nodes.KIND, name, "", resource_version(record))
            except NotFound:
                return False  # deleted meanwhile
            except Conflict:
                continue  # rewritten meanwhile: read it again
            break
        else:
            return False  # rewritten every time: the next pass looks again
        log.info("CiliumNode deleted: its Node is gone", extra={"node": name, "reason": reason})
        for hook in self.on_gone:
            try:
                await hook(name)
            except StoreError as exc:
                log.warning("node-gone hook failed", extra={"node": name, "error": str(exc)})
        return True

    async def run_once(self, *, candidates: bool = True) -> list[str]:
        """One GC pass over every CiliumNode against :attr:`k8s_nodes`; returns the names
        deleted. Owned records whose owner uid is gone go at once; unowned ones without a
        Node go on their second pass in a row (``candidates`` False: only marked).

        Raises:
            StoreError: the store failed.
        """
        async with self._pass:
            return await self._pass_once(candidates)

    async def _pass_once(self, candidates: bool) -> list[str]:
        deleted: list[str] = []
        listed = await self.store.list(nodes.KIND)
        orphans: set[str] = set()
        for record in listed.items:
            name = record["metadata"]["name"]
            k8s_node = self.k8s_nodes.get(name)
            uid = str((k8s_node or {}).get("metadata", {}).get("uid") or "")
            owner = _owner_uid(record)
            if k8s_node is not None and (not owner or owner == uid):
                if adopted(record, k8s_node) != record:
                    await self.adopt(name)
                continue
            if owner:  # its owner Node (that uid) is gone
                if await self._delete(name, owner, "owner Node gone"):
                    deleted.append(name)
                continue
            orphans.add(name)
            second = candidates and name in self._candidates
            if second and await self._delete(name, "", "no Node of that name (two passes)"):
                deleted.append(name)
        self._candidates = orphans - set(deleted)
        return deleted

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.run_once()
            except StoreError as exc:
                log.warning("node gc pass failed", extra={"error": str(exc)})
