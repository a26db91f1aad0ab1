"""The other nodes of the cluster, from the operator's ``NodeService.WatchNodes`` stream.

:class:`NodeManager` follows the stream (messages up to the first ``synced`` are the full
list and replace the known set, so nodes deleted while the agent was not watching go away;
later events apply one by one) and tells its listeners the whole set after every change:
the routes to other nodes' pod CIDRs (:class:`RouteSync`) and Hubble's peer registry.

:class:`RouteSync` turns the set into :class:`~cilia_agent.datapath.routing.RemoteNode`
entries (the node's own address, listed first: see :func:`remote_node`; every pod CIDR) and has the routing mode
(``datapath.routing``) install exactly those routes; the netlink work runs in the worker
pool, one sync at a time, always with the latest set. Problems (a node without a reachable
address) are logged when they change and kept for ``cilia-agent status``.

Source: upstream ``pkg/node/manager`` (node discovery → datapath node handlers).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import AsyncIterable, Mapping
from concurrent.futures import Executor
from typing import Protocol

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.routing import NodeRoutes, RemoteNode

log = logging.getLogger(__name__)


class NodeListener(Protocol):
    """Told the full set of other nodes after every change."""

    async def nodes_changed(self, nodes: Mapping[str, cp.Node]) -> None:
        """``nodes``: name → the node's latest record (this node excluded)."""


class NodeManager:
    """The other nodes, from the operator's node stream.

    Args:
        local_name: this node (never listed).
        listeners: told the whole set after every change, in order.
        synced: the set is complete from the start (no operator: this node is alone).
    """

    def __init__(
        self, local_name: str, listeners: list[NodeListener], *, synced: bool = False
    ) -> None:
        self.local_name = local_name
        self.listeners = listeners
        self._nodes: dict[str, cp.Node] = {}
        self.synced = synced

    @property
    def nodes(self) -> Mapping[str, cp.Node]:
        """Name → record of every other node known now."""
        return dict(self._nodes)

    async def _changed(self) -> None:
        for listener in self.listeners:
            try:
                await listener.nodes_changed(self.nodes)
            except Exception:  # one listener's failure must not starve the others
                log.exception("node listener %s failed", type(listener).__name__)

    async def consume(self, stream: AsyncIterable[cp.WatchNodesResponse]) -> bool:
        """Follow one stream until it ends; True when it delivered anything."""
        delivered = False
        initial: dict[str, cp.Node] | None = {}
        async for response in stream:
            delivered = True
            if initial is not None:
                for event in response.events:
                    if event.type == cp.EVENT_TYPE_DELETE:
                        initial.pop(event.node.name, None)
                    elif event.node.name != self.local_name:
                        initial[event.node.name] = event.node
                if not response.synced:
                    continue
                self._nodes, initial = initial, None
                self.synced = True
            else:
                for event in response.events:
                    if event.node.name == self.local_name:
                        continue
                    if event.type == cp.EVENT_TYPE_DELETE:
                        self._nodes.pop(event.node.name, None)
                    else:
                        self._nodes[event.node.name] = event.node
            await self._changed()
        return delivered


def remote_node(node: cp.Node) -> RemoteNode:
    """The routing view of a node: its first IPv4 address ("" when none) and pod CIDRs.

    The first address is the node's own: its Kubernetes Node's ``InternalIP`` (the operator
    writes it first, ``ipam/nodegc``), or in standalone mode the address its agent
    registered first (``--ipv4-node``, ``datapath/nodeaddress``) -- never merely the first
    address the remote kernel listed (a ``docker0``)."""
    address = ""
    for candidate in node.addresses:
        try:
            ipaddress.IPv4Address(candidate)
        except ValueError:
            continue
        address = candidate
        break
    return RemoteNode(node.name, address, tuple(node.pod_cidrs))


class RouteSync:
    """:class:`NodeListener` installing the routes (or tunnel entries) to other nodes.

    Args:
        routes: the routing mode's implementation.
        executor: where the netlink work runs.
    """

    def __init__(self, routes: NodeRoutes, executor: Executor) -> None:
        self.routes = routes
        self.executor = executor
        self.problems: list[str] = []
        self._latest: list[RemoteNode] | None = None
        self._lock = asyncio.Lock()

    async def setup(self) -> None:
        """Create what the routing mode needs (the tunnel device).

        Raises:
            DatapathError: netlink refused.
        """
        await asyncio.get_running_loop().run_in_executor(self.executor, self.routes.setup)

    async def nodes_changed(self, nodes: Mapping[str, cp.Node]) -> None:
        """Sync the routes to ``nodes`` (coalesced: a sync in progress is followed by one
        with the latest set).

        Raises:
            DatapathError: the routing table or tunnel device cannot be read.
        """
        self._latest = [remote_node(n) for _, n in sorted(nodes.items())]
        async with self._lock:
            latest, self._latest = self._latest, None
            if latest is None:
                return  # a sync that started after this call has applied it already
            loop = asyncio.get_running_loop()
            problems = await loop.run_in_executor(self.executor, self.routes.sync, latest)
        if problems != self.problems:
            for problem in problems:
                log.warning("node not routed", extra={"reason": problem})
        self.problems = problems
