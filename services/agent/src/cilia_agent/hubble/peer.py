"""Known Hubble peers and the ``peer.Peer`` Notify servicer.

Every Notify stream first receives every known peer as PEER_ADDED (sorted by name,
the local node always among them), then PEER_ADDED/PEER_UPDATED/PEER_DELETED as the
set changes (upstream ``pkg/hubble/peer``: handler + buffer, re-implemented).

The agent feeds the set from the operator's ``NodeService.WatchNodes`` stream with
:meth:`PeerRegistry.consume_watch` (or by hand with ``upsert``/``delete``/``replace_all``).
Events about the local node's name are ignored: the local node is always present with
the address the agent gave it.

A subscriber that does not read fast enough to keep ``max_buffer`` changes queued is
disconnected (RESOURCE_EXHAUSTED); on reconnection it gets the full set again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2
from cilia.hubble.peer import peer_pb2, peer_pb2_grpc
from cilia_agent.hubble.errors import HubbleError
from cilia_common.tls import hubble_server_name

log = logging.getLogger(__name__)

DEFAULT_HUBBLE_PORT = 4244
DEFAULT_PEER_BUFFER = 1024


class PeerBufferOverflow(HubbleError):
    """A Notify subscriber fell ``max_buffer`` changes behind and was disconnected."""


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """One Hubble server: node name, ``host:port`` address, TLS server name ("" = no TLS)."""

    name: str
    address: str
    tls_server_name: str = ""

    def notification(self, kind: peer_pb2.ChangeNotificationType) -> peer_pb2.ChangeNotification:
        """This peer as a ChangeNotification of ``kind``."""
        note = peer_pb2.ChangeNotification(name=self.name, address=self.address, type=kind)
        if self.tls_server_name:
            note.tls.server_name = self.tls_server_name
        return note


def join_host_port(host: str, port: int) -> str:
    """``host:port``, with brackets around IPv6 addresses."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


def peer_from_node(
    node: controlplane_pb2.Node, default_port: int = DEFAULT_HUBBLE_PORT
) -> PeerInfo | None:
    """The Hubble peer of a controlplane Node.

    ``hubble_address`` is used as is when it has a host; ``":4244"`` or an empty one
    gets the node's first address (and ``default_port`` when empty). ``None`` when the
    node has neither a usable Hubble address nor any address.
    """
    address = node.hubble_address
    if address and not address.startswith(":"):
        return PeerInfo(node.name, address)
    if not node.addresses:
        return None
    port = int(address[1:]) if address.startswith(":") and address[1:].isdigit() else default_port
    return PeerInfo(node.name, join_host_port(node.addresses[0], port))


class _Subscriber:
    """A subscriber's queue; ``None`` in it means "overflowed, disconnect"."""

    def __init__(self, max_buffer: int) -> None:
        self.queue: asyncio.Queue[peer_pb2.ChangeNotification | None] = asyncio.Queue(
            max_buffer + 1
        )
        self.max_buffer = max_buffer
        self.overflowed = False


class PeerRegistry:
    """The set of Hubble peers, broadcasting changes to Notify subscribers.

    Confined to one asyncio event loop.

    Args:
        local: this node's Hubble server (always present).
        default_port: Hubble port assumed for nodes registered without one.
        max_buffer: changes queued per subscriber before it is disconnected.
        tls_cluster: the cluster name when every node's Hubble serves TLS: each peer is then
            announced with the TLS name ``<node>.<cluster>.hubble-grpc.cilium.io`` the
            relay checks (upstream assumes all nodes alike, as here); None: no TLS.
    """

    def __init__(
        self,
        local: PeerInfo,
        *,
        default_port: int = DEFAULT_HUBBLE_PORT,
        max_buffer: int = DEFAULT_PEER_BUFFER,
        tls_cluster: str | None = None,
    ) -> None:
        if max_buffer < 1:
            raise ValueError(f"max_buffer must be >= 1, got {max_buffer}")
        self.tls_cluster = tls_cluster
        local = self._tls(local)
        self.local = local
        self.default_port = default_port
        self.max_buffer = max_buffer
        self._peers: dict[str, PeerInfo] = {local.name: local}
        self._subscribers: set[_Subscriber] = set()

    def _tls(self, peer: PeerInfo) -> PeerInfo:
        if self.tls_cluster is None:
            return peer
        return dataclasses.replace(
            peer, tls_server_name=hubble_server_name(peer.name, self.tls_cluster)
        )

    def peers(self) -> list[PeerInfo]:
        """Every known peer, sorted by name."""
        return [self._peers[name] for name in sorted(self._peers)]

    def _broadcast(self, note: peer_pb2.ChangeNotification) -> None:
        for sub in self._subscribers:
            if sub.overflowed:
                continue
            if sub.queue.qsize() < sub.max_buffer:
                sub.queue.put_nowait(note)
            else:
                sub.overflowed = True
                sub.queue.put_nowait(None)  # the one spare slot

    def set_local(self, local: PeerInfo) -> None:
        """Change this node's own entry (e.g. its address became known)."""
        local = self._tls(local)
        old = self._peers.pop(self.local.name)
        if old.name != local.name:
            self._broadcast(old.notification(peer_pb2.PEER_DELETED))
            self._broadcast(local.notification(peer_pb2.PEER_ADDED))
        elif old != local:
            self._broadcast(local.notification(peer_pb2.PEER_UPDATED))
        self.local = local
        self._peers[local.name] = local

    def upsert(self, peer: PeerInfo) -> None:
        """Add (PEER_ADDED) or change (PEER_UPDATED) a remote peer; no-op if unchanged."""
        if peer.name == self.local.name:
            return
        peer = self._tls(peer)
        old = self._peers.get(peer.name)
        if old == peer:
            return
        self._peers[peer.name] = peer
        kind = peer_pb2.PEER_ADDED if old is None else peer_pb2.PEER_UPDATED
        self._broadcast(peer.notification(kind))

    def delete(self, name: str) -> None:
        """Remove a remote peer (PEER_DELETED); the local node and unknown names are ignored."""
        if name == self.local.name:
            return
        old = self._peers.pop(name, None)
        if old is not None:
            self._broadcast(old.notification(peer_pb2.PEER_DELETED))

    def replace_all(self, peers: Iterable[PeerInfo]) -> None:
        """Make the remote set exactly ``peers`` (a full resync), sending only the differences."""
        wanted = {p.name: p for p in peers if p.name != self.local.name}
        for name in [n for n in self._peers if n != self.local.name and n not in wanted]:
            self.delete(name)
        for name in sorted(wanted):
            self.upsert(wanted[name])

    def apply_node_event(self, event: controlplane_pb2.NodeEvent) -> None:
        """Apply one WatchNodes event (UPSERT or DELETE)."""
        if event.type == controlplane_pb2.EVENT_TYPE_DELETE:
            self.delete(event.node.name)
            return
        peer = peer_from_node(event.node, self.default_port)
        if peer is None:
            log.warning("node %s has no address; not announced as a Hubble peer", event.node.name)
            return
        self.upsert(peer)

    async def nodes_changed(self, nodes: Mapping[str, controlplane_pb2.Node]) -> None:
        """The node manager's full set of other nodes changed: the remote peers become
        exactly the nodes with an address (``NodeListener`` of ``cilia_agent.node``)."""
        peers = (peer_from_node(node, self.default_port) for node in nodes.values())
        self.replace_all(p for p in peers if p is not None)

    async def consume_watch(
        self, stream: AsyncIterable[controlplane_pb2.WatchNodesResponse]
    ) -> None:
        """Follow one ``NodeService.WatchNodes`` stream until it ends.

        Events before the first response with ``synced=True`` form the initial list and
        replace the remote set as a whole (so nodes deleted while the agent was not
        watching disappear); later events apply one by one. Returns when the stream
        ends; the caller reconnects and calls again (a new stream resyncs).
        """
        initial: list[controlplane_pb2.NodeEvent] = []
        synced = False
        async for response in stream:
            if synced:
                for event in response.events:
                    self.apply_node_event(event)
                continue
            initial.extend(response.events)
            if response.synced:
                synced = True
                snapshot: dict[str, PeerInfo] = {}
                for event in initial:
                    if event.type == controlplane_pb2.EVENT_TYPE_DELETE:
                        snapshot.pop(event.node.name, None)
                        continue
                    peer = peer_from_node(event.node, self.default_port)
                    if peer is not None:
                        snapshot[peer.name] = peer
                self.replace_all(snapshot.values())
                initial.clear()

    async def subscribe(self) -> AsyncIterator[peer_pb2.ChangeNotification]:
        """Every peer as PEER_ADDED, then every change, until the consumer stops.

        Raises:
            PeerBufferOverflow: the consumer fell ``max_buffer`` changes behind.
        """
        sub = _Subscriber(self.max_buffer)
        # Snapshot and registration happen without yielding to the loop: no change
        # can fall between them.
        snapshot = [p.notification(peer_pb2.PEER_ADDED) for p in self.peers()]
        self._subscribers.add(sub)
        try:
            for note in snapshot:
                yield note
            while True:
                change = await sub.queue.get()
                if change is None:
                    raise PeerBufferOverflow(
                        f"peer change notifications exceeded the buffer of {self.max_buffer}; "
                        "reconnect to resync"
                    )
                yield change
        finally:
            self._subscribers.discard(sub)


class PeerServicer(peer_pb2_grpc.PeerServicer):
    """``peer.Peer`` over a :class:`PeerRegistry`."""

    def __init__(self, registry: PeerRegistry) -> None:
        self.registry = registry

    async def Notify(  # noqa: N802 - gRPC method name
        self, request: peer_pb2.NotifyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[peer_pb2.ChangeNotification]:
        """Known peers as PEER_ADDED, then changes; RESOURCE_EXHAUSTED when too slow."""
        try:
            async for note in self.registry.subscribe():
                yield note
        except PeerBufferOverflow as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
