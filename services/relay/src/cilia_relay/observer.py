"""The relay's ``observer.Observer`` servicer: fan-out to every peer and a time-ordered merge.

GetFlows (upstream relay behaviour, cilium-upstream.md §6):

1. Lists peers; peers whose channel is missing or in TRANSIENT_FAILURE/SHUTDOWN are
   skipped. One ``NODE_CONNECTED`` event (the connected names) and one
   ``NODE_UNAVAILABLE`` event (the rest) are sent before any flow (each only when
   its list is non-empty).
2. Streams ``GetFlows`` from every connected peer with the client's request unchanged
   (filters, number, follow, since, until, first) and its gRPC metadata.
3. A peer stream error becomes a ``NODE_ERROR`` event (``rpc error: code = … desc = …``);
   identical messages within ``--error-aggregation-window`` are merged. The other
   peers keep streaming.
4. Responses pass through a bounded min-heap on ``GetFlowsResponse.time``
   (:class:`cilia_relay.merge.SortBuffer`) of ``min(--sort-buffer-len-max,
   number x peers)``; after ``--sort-buffer-drain-timeout`` without input, entries
   older than now - drain-timeout are sent; the heap is drained at the end.
5. With ``follow``, peers are re-listed every ``--peer-update-interval`` (and on every
   peer change); a new or recovered peer gets its own stream (a recovered one asks for
   flows since the last flow it delivered) and a ``NODE_CONNECTED`` event.

ServerStatus sums the peers' counters; GetNodes reports one Node per peer; GetNamespaces
merges the connected peers' namespaces (deduplicated, sorted by cluster then namespace; a
failing peer is logged and left out, as upstream tolerates partial failure). GetAgentEvents and
GetDebugEvents answer UNIMPLEMENTED, as upstream's relay does (ask an agent for them).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.wrappers_pb2 import UInt32Value

from cilia.flowbatch.v1 import flowbatch_pb2, flowbatch_pb2_grpc
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia.hubble.relay import relay_pb2
from cilia_relay import __version__
from cilia_relay.merge import (
    NANOS_PER_SECOND,
    ErrorAggregator,
    SortBuffer,
    WireResponse,
    item_time_ns,
    sort_buffer_len,
)
from cilia_relay.peers import Peer, PeerManager

log = logging.getLogger("cilia_relay.observer")

MAX_UNAVAILABLE_NODES_REPORTED = 10
"""ServerStatus lists at most this many unavailable node names (upstream)."""

RELAY_VERSION = f"cilia-relay v{__version__}"

# Metadata the transport owns; everything else a client sends is forwarded to peers.
_HOP_BY_HOP = frozenset({"user-agent", "content-type", "te", "authority", "host"})


@dataclass(frozen=True)
class ObserverOptions:
    """Tunables of the servicer (all from :class:`cilia_relay.config.Config`).

    Attributes:
        sort_buffer_len_max: capacity bound of the sort buffer (flows).
        sort_buffer_drain_timeout: idle seconds before old buffered flows are sent.
        peer_update_interval: seconds between peer re-lists of a follow GetFlows.
        error_aggregation_window: seconds identical NODE_ERROR messages are merged.
        peer_call_timeout: deadline (s) of each per-peer unary call (ServerStatus).
        node_name: name put on the relay's own node-status events.
        flow_batches: ask peers for flows through the Cilia-private
            ``FlowBatchService`` (falling back to ``GetFlows`` per peer when it is
            UNIMPLEMENTED); False = upstream's GetFlows only.
        max_batch: responses per FlowBatchService message asked for.
    """

    sort_buffer_len_max: int = 100
    sort_buffer_drain_timeout: float = 1.0
    peer_update_interval: float = 2.0
    error_aggregation_window: float = 10.0
    peer_call_timeout: float = 5.0
    node_name: str = socket.gethostname()
    flow_batches: bool = True
    max_batch: int = 256


def go_code_name(code: grpc.StatusCode) -> str:
    """``DEADLINE_EXCEEDED`` → ``DeadlineExceeded`` (the spelling of Go's ``codes.Code``)."""
    return "".join(part.capitalize() for part in code.name.split("_"))


def rpc_error_message(exc: grpc.aio.AioRpcError) -> str:
    """The NODE_ERROR message of a failed peer call, as upstream prints a gRPC status error."""
    return f"rpc error: code = {go_code_name(exc.code())} desc = {exc.details() or ''}"


def node_status_response(
    state: relay_pb2.NodeState,
    names: Sequence[str],
    node_name: str,
    message: str = "",
) -> observer_pb2.GetFlowsResponse:
    """A ``GetFlowsResponse`` carrying a ``NodeStatusEvent`` stamped with the current time."""
    response = observer_pb2.GetFlowsResponse(
        node_name=node_name,
        node_status=relay_pb2.NodeStatusEvent(
            state_change=state, node_names=list(names), message=message
        ),
    )
    response.time.FromNanoseconds(time.time_ns())
    return response


def forwardable_metadata(
    metadata: Sequence[tuple[str, str | bytes]] | None,
) -> tuple[tuple[str, str | bytes], ...]:
    """The client's gRPC metadata minus transport headers (pseudo, ``grpc-*``, hop-by-hop)."""
    out: list[tuple[str, str | bytes]] = []
    for key, value in metadata or ():
        lowered = key.lower()
        if lowered.startswith((":", "grpc-")) or lowered in _HOP_BY_HOP:
            continue
        out.append((lowered, value))
    return tuple(out)


@dataclass(frozen=True)
class _PeerDone:
    name: str


class FlowQueue(asyncio.Queue[Any]):
    """The queue from a call's peer streams to its merge, bounded in flows, not items.

    A peer's FlowBatchService message is queued as one item of up to
    ``--peer-flow-batch-size`` (256) flows; bounded in items, a call whose client reads
    slowly held ``--sort-buffer-len-max`` batches (25,600 flows at the defaults, ~12 MB per
    such client, measured) where the flag promises that many flows. Here a list counts its
    length and anything else 1; a put waits while ``maxsize`` flows are queued, so at most
    ``maxsize`` + one batch are held (a batch larger than ``maxsize`` still goes into an
    empty queue). Relies on ``asyncio.Queue``'s ``_put``/``_get`` hooks (as its
    ``PriorityQueue`` subclass does) and on ``full()`` reading :meth:`qsize`.
    """

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self._flows = 0

    def _put(self, item: Any) -> None:
        self._flows += len(item) if isinstance(item, list) else 1
        super()._put(item)

    def _get(self) -> Any:
        item = super()._get()
        self._flows -= len(item) if isinstance(item, list) else 1
        return item

    def qsize(self) -> int:
        """Flows queued (a batch counts its length)."""
        return self._flows


Outgoing = observer_pb2.GetFlowsResponse | bytes
"""What the relay's GetFlows yields: a response message, or one already serialized (a
peer's, forwarded as it came); :func:`serialize_response` writes either."""


def serialize_response(response: Outgoing) -> bytes:
    """The wire bytes of a relay GetFlows response (bytes pass through unchanged)."""
    if isinstance(response, bytes):
        return response
    return response.SerializeToString()


def add_relay_observer_to_server(servicer: observer_pb2_grpc.ObserverServicer, server: Any) -> None:
    """Register the ``observer.Observer`` methods of ``servicer`` on ``server`` as the
    generated ``add_ObserverServicer_to_server`` does, except that GetFlows may yield
    pre-serialized responses (:data:`Outgoing`): flows from an agent's FlowBatchService
    reach the client without being decoded and re-encoded."""
    p = observer_pb2
    unary = grpc.unary_unary_rpc_method_handler
    stream = grpc.unary_stream_rpc_method_handler
    handlers = {
        "GetFlows": stream(
            servicer.GetFlows,
            request_deserializer=p.GetFlowsRequest.FromString,
            response_serializer=serialize_response,
        ),
        "GetNodes": unary(
            servicer.GetNodes,
            request_deserializer=p.GetNodesRequest.FromString,
            response_serializer=p.GetNodesResponse.SerializeToString,
        ),
        "ServerStatus": unary(
            servicer.ServerStatus,
            request_deserializer=p.ServerStatusRequest.FromString,
            response_serializer=p.ServerStatusResponse.SerializeToString,
        ),
        "GetAgentEvents": stream(
            servicer.GetAgentEvents,
            request_deserializer=p.GetAgentEventsRequest.FromString,
            response_serializer=p.GetAgentEventsResponse.SerializeToString,
        ),
        "GetDebugEvents": stream(
            servicer.GetDebugEvents,
            request_deserializer=p.GetDebugEventsRequest.FromString,
            response_serializer=p.GetDebugEventsResponse.SerializeToString,
        ),
        "GetNamespaces": unary(
            servicer.GetNamespaces,
            request_deserializer=p.GetNamespacesRequest.FromString,
            response_serializer=p.GetNamespacesResponse.SerializeToString,
        ),
    }
    name = observer_pb2.DESCRIPTOR.services_by_name["Observer"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


class _FlowsCall:
    """State of one relay GetFlows call (its peer streams and merge)."""

    def __init__(
        self,
        request: observer_pb2.GetFlowsRequest,
        metadata: tuple[tuple[str, str | bytes], ...],
        peers: PeerManager,
        opts: ObserverOptions,
    ) -> None:
        self.request = request
        self.metadata = metadata
        self.peers = peers
        self.opts = opts
        self.active: dict[str, asyncio.Task[None]] = {}
        self.last_flow_ns: dict[str, int] = {}
        self.queue: asyncio.Queue[_Item] = FlowQueue()
        self.running = 0

    async def run(self) -> AsyncIterator[Outgoing]:
        peers = self.peers.list()
        capacity = sort_buffer_len(
            self.opts.sort_buffer_len_max, int(self.request.number), len(peers)
        )
        self.queue = FlowQueue(maxsize=capacity)
        connected = [p for p in peers if p.available]
        unavailable = [p.name for p in peers if not p.available and not p.error]
        if connected:
            yield node_status_response(
                relay_pb2.NODE_CONNECTED, [p.name for p in connected], self.opts.node_name
            )
        if unavailable:
            yield node_status_response(relay_pb2.NODE_UNAVAILABLE, unavailable, self.opts.node_name)
        for peer in peers:  # e.g. its certificate was refused: say why, do not just skip it
            if not peer.available and peer.error:
                yield node_status_response(
                    relay_pb2.NODE_ERROR, [peer.name], self.opts.node_name, peer.error
                )
        for peer in connected:
            self._start(peer)
        refresher = asyncio.create_task(self._refresh()) if self.request.follow else None
        try:
            async for response in self._merge(capacity):
                yield response
        finally:
            tasks = list(self.active.values())
            if refresher is not None:
                tasks.append(refresher)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- producers ----------------------------------------------------------------------

    def _request_for(self, name: str) -> observer_pb2.GetFlowsRequest:
        last = self.last_flow_ns.get(name)
        if last is None:
            return self.request
        # A recovered peer resumes after the last flow it delivered instead of
        # replaying its last `number` flows.
        resumed = observer_pb2.GetFlowsRequest()
        resumed.CopyFrom(self.request)
        resumed.number = 0
        resumed.first = False
        resumed.since.FromNanoseconds(last + 1)
        return resumed

    def _start(self, peer: Peer) -> None:
        channel = peer.channel
        if channel is None:
            return
        self.running += 1
        self.active[peer.name] = asyncio.create_task(
            self._pump(peer.name, channel, self._request_for(peer.name)),
            name=f"relay-getflows-{peer.name}",
        )

    async def _pump(
        self, name: str, channel: grpc.aio.Channel, request: observer_pb2.GetFlowsRequest
    ) -> None:
        try:
            if not await self._pump_batches(name, channel, request):
                await self._pump_responses(name, channel, request)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "peer GetFlows failed",
                extra={"peer": name, "code": exc.code().name, "details": exc.details()},
            )
            await self.queue.put(
                node_status_response(
                    relay_pb2.NODE_ERROR, [name], self.opts.node_name, rpc_error_message(exc)
                )
            )
        finally:
            if self.active.get(name) is asyncio.current_task():
                del self.active[name]
        await self.queue.put(_PeerDone(name))

    async def _pump_batches(
        self, name: str, channel: grpc.aio.Channel, request: observer_pb2.GetFlowsRequest
    ) -> bool:
        """Stream the peer's flows through ``FlowBatchService.GetFlowBatches`` (many
        serialized responses per message, queued as one item); False when the peer does
        not serve it (UNIMPLEMENTED before any batch: an agent without the service).

        Raises:
            grpc.aio.AioRpcError: the stream failed otherwise.
        """
        if not self.opts.flow_batches:
            return False
        stub = flowbatch_pb2_grpc.FlowBatchServiceStub(channel)  # type: ignore[no-untyped-call]
        call = stub.GetFlowBatches(
            flowbatch_pb2.GetFlowBatchesRequest(request=request, max_batch=self.opts.max_batch),
            metadata=self.metadata,
        )
        received = False
        try:
            async for batch in call:
                received = True
                items = [
                    WireResponse(t, raw)
                    for t, raw in zip(batch.times_ns, batch.responses, strict=True)
                ]
                for t, is_flow in zip(reversed(batch.times_ns), reversed(batch.flows), strict=True):
                    if is_flow:
                        self.last_flow_ns[name] = t
                        break
                await self.queue.put(items)
        except grpc.aio.AioRpcError as exc:
            if not received and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("peer has no FlowBatchService; using GetFlows", extra={"peer": name})
                return False
            raise
        return True

    async def _pump_responses(
        self, name: str, channel: grpc.aio.Channel, request: observer_pb2.GetFlowsRequest
    ) -> None:
        """Stream the peer's flows through upstream's ``Observer.GetFlows``."""
        stub = observer_pb2_grpc.ObserverStub(channel)  # type: ignore[no-untyped-call]
        call = stub.GetFlows(request, metadata=self.metadata)
        async for response in call:
            if not response.node_name:
                response.node_name = name
            if response.WhichOneof("response_types") == "flow":
                self.last_flow_ns[name] = item_time_ns(response)
            await self.queue.put(response)

    async def _refresh(self) -> None:
        while True:
            await self.peers.wait_changed(self.opts.peer_update_interval)
            for peer in self.peers.list():
                if peer.name in self.active or not peer.available:
                    continue
                log.info("follow: streaming from new or recovered peer", extra={"peer": peer.name})
                self._start(peer)
                await self.queue.put(
                    node_status_response(relay_pb2.NODE_CONNECTED, [peer.name], self.opts.node_name)
                )

    # -- merge --------------------------------------------------------------------------

    async def _merge(self, capacity: int) -> AsyncIterator[Outgoing]:
        loop = asyncio.get_running_loop()
        drain_timeout = self.opts.sort_buffer_drain_timeout
        drain_ns = int(drain_timeout * NANOS_PER_SECOND)
        buffer: SortBuffer[observer_pb2.GetFlowsResponse | WireResponse] = SortBuffer(
            capacity, item_time_ns
        )
        errors = ErrorAggregator(self.opts.error_aggregation_window)
        idle_since = loop.time()
        while self.request.follow or self.running > 0 or not self.queue.empty():
            deadline = idle_since + drain_timeout
            if errors.flush_at is not None:
                deadline = min(deadline, errors.flush_at)
            try:
                if self.queue.empty():  # asyncio.timeout: no task per wait (wait_for makes one)
                    async with asyncio.timeout(max(0.0, deadline - loop.time())):
                        item = await self.queue.get()
                else:  # under load: no timer either
                    item = self.queue.get_nowait()
            except TimeoutError:
                now = loop.time()
                for response in errors.due(now):
                    for out in buffer.push(response):
                        yield _outgoing(out)
                if now >= idle_since + drain_timeout:
                    for out in buffer.pop_older_than(time.time_ns() - drain_ns):
                        yield _outgoing(out)
                    idle_since = now
                continue
            if isinstance(item, _PeerDone):
                self.running -= 1
                continue
            now = loop.time()
            idle_since = now
            if isinstance(item, list):  # a peer's batch: never a NODE_ERROR
                for response in errors.due(now):
                    for out in buffer.push(response):
                        yield _outgoing(out)
                for wire in item:
                    for out in buffer.push(wire):
                        yield _outgoing(out)
                continue
            for response in errors.offer(item, now):
                for out in buffer.push(response):
                    yield _outgoing(out)
        for response in errors.flush():
            for out in buffer.push(response):
                yield _outgoing(out)
        for out in buffer.drain():
            yield _outgoing(out)


class RelayObserver(observer_pb2_grpc.ObserverServicer):
    """``observer.Observer`` served by the relay over the peers of a :class:`PeerManager`."""

    def __init__(self, peers: PeerManager, opts: ObserverOptions) -> None:
        self.peers = peers
        self.opts = opts

    async def GetFlows(  # noqa: N802 (gRPC method name)
        self, request: observer_pb2.GetFlowsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Outgoing]:
        """Stream merged flows from every connected peer (see the module docstring);
        registered by :func:`add_relay_observer_to_server`, which serializes both kinds."""
        call = _FlowsCall(
            request, forwardable_metadata(context.invocation_metadata()), self.peers, self.opts
        )
        async for response in call.run():
            yield response

    async def _peer_call(self, peer: Peer, method: str, request: Any) -> Any | None:
        """Unary ``Observer.<method>(request)`` on ``peer`` within ``--peer-call-timeout``;
        None (and one warning) when the peer has no channel or the call fails."""
        channel = peer.channel
        if channel is None:
            return None
        try:
            stub = observer_pb2_grpc.ObserverStub(channel)  # type: ignore[no-untyped-call]
            return await getattr(stub, method)(request, timeout=self.opts.peer_call_timeout)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                f"peer {method} failed",
                extra={"peer": peer.name, "code": exc.code().name, "details": exc.details()},
            )
            return None

    async def _peer_status(self, peer: Peer) -> observer_pb2.ServerStatusResponse | None:
        status: observer_pb2.ServerStatusResponse | None = await self._peer_call(
            peer, "ServerStatus", observer_pb2.ServerStatusRequest()
        )
        return status

    async def ServerStatus(  # noqa: N802 (gRPC method name)
        self, request: observer_pb2.ServerStatusRequest, context: grpc.aio.ServicerContext
    ) -> observer_pb2.ServerStatusResponse:
        """Sum num/max/seen flows and flows_rate over the connected peers; max uptime.

        A connected peer whose ServerStatus fails counts as unavailable. At most
        :data:`MAX_UNAVAILABLE_NODES_REPORTED` unavailable names are listed.
        """
        del request, context
        peers = self.peers.list()
        connected = [p for p in peers if p.available]
        unavailable = [p.name for p in peers if not p.available]
        statuses = await asyncio.gather(*(self._peer_status(p) for p in connected))
        response = observer_pb2.ServerStatusResponse(version=RELAY_VERSION)
        num_connected = 0
        for peer, status in zip(connected, statuses, strict=True):
            if status is None:
                unavailable.append(peer.name)
                continue
            num_connected += 1
            response.num_flows += status.num_flows
            response.max_flows += status.max_flows
            response.seen_flows += status.seen_flows
            response.flows_rate += status.flows_rate
            response.uptime_ns = max(response.uptime_ns, status.uptime_ns)
        response.num_connected_nodes.CopyFrom(UInt32Value(value=num_connected))
        response.num_unavailable_nodes.CopyFrom(UInt32Value(value=len(unavailable)))
        response.unavailable_nodes.extend(sorted(unavailable)[:MAX_UNAVAILABLE_NODES_REPORTED])
        return response

    async def GetNodes(  # noqa: N802 (gRPC method name)
        self, request: observer_pb2.GetNodesRequest, context: grpc.aio.ServicerContext
    ) -> observer_pb2.GetNodesResponse:
        """One Node per peer: NODE_UNAVAILABLE without a usable channel, NODE_ERROR when
        its ServerStatus fails or its dial failed for a lasting reason (a refused
        certificate), else NODE_CONNECTED with version, uptime and flow counters."""
        del request, context
        peers = self.peers.list()
        statuses = await asyncio.gather(
            *(self._peer_status(p) if p.available else _none() for p in peers)
        )
        response = observer_pb2.GetNodesResponse()
        for peer, status in zip(peers, statuses, strict=True):
            node = response.nodes.add(
                name=peer.name,
                address=peer.address,
                tls=observer_pb2.TLS(
                    enabled=bool(peer.tls_server_name), server_name=peer.tls_server_name
                ),
            )
            if not peer.available:
                node.state = relay_pb2.NODE_ERROR if peer.error else relay_pb2.NODE_UNAVAILABLE
            elif status is None:
                node.state = relay_pb2.NODE_ERROR
            else:
                node.state = relay_pb2.NODE_CONNECTED
                node.version = status.version
                node.uptime_ns = status.uptime_ns
                node.num_flows = status.num_flows
                node.max_flows = status.max_flows
                node.seen_flows = status.seen_flows
        return response

    async def _peer_namespaces(self, peer: Peer) -> list[observer_pb2.Namespace]:
        answer: observer_pb2.GetNamespacesResponse | None = await self._peer_call(
            peer, "GetNamespaces", observer_pb2.GetNamespacesRequest()
        )
        return list(answer.namespaces) if answer is not None else []

    async def GetNamespaces(  # noqa: N802 (gRPC method name)
        self, request: observer_pb2.GetNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> observer_pb2.GetNamespacesResponse:
        """The union of the connected peers' namespaces, sorted by (cluster, namespace)."""
        del request, context
        answers = await asyncio.gather(
            *(self._peer_namespaces(p) for p in self.peers.list() if p.available)
        )
        merged = {(ns.cluster, ns.namespace) for answer in answers for ns in answer}
        return observer_pb2.GetNamespacesResponse(
            namespaces=[
                observer_pb2.Namespace(cluster=cluster, namespace=namespace)
                for cluster, namespace in sorted(merged)
            ]
        )

    async def GetAgentEvents(  # noqa: N802 (gRPC method name)
        self, request: observer_pb2.GetAgentEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[observer_pb2.GetAgentEventsResponse]:
        """UNIMPLEMENTED, as upstream's relay (agents serve their own agent events)."""
        del request
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "GetAgentEvents not yet implemented")
        yield observer_pb2.GetAgentEventsResponse()  # pragma: no cover - abort raises

    async def GetDebugEvents(  # noqa: N802 (gRPC method name)
        self, request: observer_pb2.GetDebugEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[observer_pb2.GetDebugEventsResponse]:
        """UNIMPLEMENTED, as upstream's relay (agents serve their own debug events)."""
        del request
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "GetDebugEvents not yet implemented")
        yield observer_pb2.GetDebugEventsResponse()  # pragma: no cover - abort raises


async def _none() -> None:
    return None


_Item = observer_pb2.GetFlowsResponse | list[WireResponse] | _PeerDone


def _outgoing(item: observer_pb2.GetFlowsResponse | WireResponse) -> Outgoing:
    return item.data if isinstance(item, WireResponse) else item
