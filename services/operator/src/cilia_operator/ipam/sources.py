"""The IPAM controller's store watches (one job: sources).

The watch loop (list, watch, relist on ``Expired`` or a store failure), and what the node,
claim and core-Node (``--ipam kubernetes``) watches do with each event: queue reconciles,
learn claims other replicas made, run the node-deleted hooks. ``--ipam kubernetes`` copies
each Node's IPv4 ``spec.podCIDRs`` into its CiliumNode (:func:`k8s_pod_cidrs`). Part of
:class:`.controller.IPAMController`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from ..kinds import NODE
from ..store import (
    Conflict,
    Contention,
    Expired,
    NotFound,
    Resource,
    StoreError,
    WatchEvent,
    resource_version,
)
from . import claims
from . import node as nodes
from .allocator import Holding
from .state import ControllerState

WATCH_SLICE_SECONDS = 0.02
"""How long the controller's watch handles events before it lets the event loop serve
others (RPCs, streams) once."""

log = logging.getLogger(__name__)


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


class SourcesMixin(ControllerState):
    """Watches and event handlers of :class:`.controller.IPAMController`."""

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

    async def _watch(
        self,
        kind: str,
        since: str,
        on_event: Callable[[WatchEvent], Awaitable[None]],
        relist: Callable[[], Awaitable[str]],
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                turn = loop.time()
                async for event in self.store.watch(kind, since):
                    since = event.resource_version
                    await on_event(event)
                    if loop.time() - turn > WATCH_SLICE_SECONDS:
                        # a batch of events (1,000 pools applied at once) is handled in
                        # slices, so RPCs are served in between
                        await asyncio.sleep(0)
                        turn = loop.time()
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
