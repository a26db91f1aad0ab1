"""The Hubble gRPC servicers of one agent: ``observer.Observer`` (GetFlows, GetAgentEvents,
GetDebugEvents, GetNamespaces, ServerStatus, GetNodes) and ``FlowBatchService``, over the flow
store (:mod:`.flowstore`, where the GetFlows semantics are written down).

GetAgentEvents and GetDebugEvents stream the agent's :class:`~.eventlog.EventLog` s (same
window rules, no filters); GetNamespaces lists the namespaces of the last hour's flows
(:class:`~.eventlog.NamespaceTracker`). ServerStatus fills what upstream's local observer
fills: num/max/seen flows, uptime, version and the flows rate (the node counts are the relay's).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from cilia.flowbatch.v1 import flowbatch_pb2, flowbatch_pb2_grpc
from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia.hubble.relay import relay_pb2
from cilia_agent.hubble.errors import InvalidFilter, InvalidRequest
from cilia_agent.hubble.eventlog import EventLog
from cilia_agent.hubble.flowstore import DEFAULT_MAX_BATCH, MAX_BATCH_LIMIT, FlowStore
from cilia_agent.hubble.parser import timestamp

_ntohs, _htons = socket.ntohs, socket.htons

T = TypeVar("T")


async def _refusing(
    open_stream: Callable[[], AsyncIterator[T]], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[T]:
    """The items of ``open_stream()``; a request it refuses before sending anything
    (InvalidRequest, InvalidFilter) ends the RPC with INVALID_ARGUMENT and its message."""
    try:
        stream = open_stream()
    except (InvalidRequest, InvalidFilter) as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return
    async for item in stream:
        yield item


class ObserverServicer(observer_pb2_grpc.ObserverServicer):
    """``observer.Observer`` for one agent: GetFlows, GetAgentEvents, GetDebugEvents,
    GetNamespaces, ServerStatus, GetNodes.

    Args:
        store: the agent's :class:`FlowStore`.
        address: this node's Hubble address reported by GetNodes (e.g. "10.0.0.5:4244").
        agent_events: the agent's agent-event log (default: a new, empty one).
        debug_events: the datapath debug-event log (default: a new, empty one).
    """

    def __init__(
        self,
        store: FlowStore,
        address: str = "",
        *,
        agent_events: EventLog[flow_pb2.AgentEvent] | None = None,
        debug_events: EventLog[flow_pb2.DebugEvent] | None = None,
    ) -> None:
        self.store = store
        self.address = address
        self.agent_events: EventLog[flow_pb2.AgentEvent] = (
            agent_events if agent_events is not None else EventLog()
        )
        self.debug_events: EventLog[flow_pb2.DebugEvent] = (
            debug_events if debug_events is not None else EventLog()
        )

    async def GetFlows(  # noqa: N802 - gRPC method name
        self, request: observer_pb2.GetFlowsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        """Stream flows as serialized ``GetFlowsResponse`` s (register this servicer with
        :func:`add_observer_to_server`, whose GetFlows passes bytes through);
        INVALID_ARGUMENT for bad option combinations or filters."""
        async for response in _refusing(lambda: self.store.get_flows_wire(request), context):
            yield response

    async def ServerStatus(  # noqa: N802 - gRPC method name
        self,
        request: observer_pb2.ServerStatusRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> observer_pb2.ServerStatusResponse:
        """Flow counts, capacity, uptime, flows/s over the last minute, version."""
        return self.store.status()

    async def GetNodes(  # noqa: N802 - gRPC method name
        self, request: observer_pb2.GetNodesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> observer_pb2.GetNodesResponse:
        """This node only (an agent knows no other Hubble servers' status)."""
        status = self.store.status()
        node = observer_pb2.Node(
            name=self.store.node_name,
            version=status.version,
            address=self.address,
            state=relay_pb2.NODE_CONNECTED,
            tls=observer_pb2.TLS(enabled=False),
            uptime_ns=status.uptime_ns,
            num_flows=status.num_flows,
            max_flows=status.max_flows,
            seen_flows=status.seen_flows,
        )
        return observer_pb2.GetNodesResponse(nodes=[node])

    async def GetAgentEvents(  # noqa: N802 - gRPC method name
        self,
        request: observer_pb2.GetAgentEventsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[observer_pb2.GetAgentEventsResponse]:
        """Stream the agent's events (e.g. AGENT_STARTED); INVALID_ARGUMENT for bad windows."""
        async for time_ns, event in _refusing(lambda: self.agent_events.stream(request), context):
            yield observer_pb2.GetAgentEventsResponse(
                agent_event=event, node_name=self.store.node_name, time=timestamp(time_ns)
            )

    async def GetDebugEvents(  # noqa: N802 - gRPC method name
        self,
        request: observer_pb2.GetDebugEventsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[observer_pb2.GetDebugEventsResponse]:
        """Stream datapath debug events (none are emitted: an empty stream, or a follow that
        waits); INVALID_ARGUMENT for bad windows."""
        async for time_ns, event in _refusing(lambda: self.debug_events.stream(request), context):
            yield observer_pb2.GetDebugEventsResponse(
                debug_event=event, node_name=self.store.node_name, time=timestamp(time_ns)
            )

    async def GetNamespaces(  # noqa: N802 - gRPC method name
        self,
        request: observer_pb2.GetNamespacesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> observer_pb2.GetNamespacesResponse:
        """Namespaces with flows in the last hour, sorted by cluster, then namespace."""
        return observer_pb2.GetNamespacesResponse(namespaces=self.store.namespaces.namespaces())


OBSERVER_SERVICE_NAME = "observer.Observer"


class _HandlerCapture:
    """Stands in for a server to catch the method handlers a generated adder registers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.handlers = dict(handlers)


def _passthrough(response: bytes | observer_pb2.GetFlowsResponse) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_observer_to_server(servicer: ObserverServicer, server: Any) -> None:
    """Register ``observer.Observer`` as the generated ``add_ObserverServicer_to_server``
    does, but for GetFlows, whose responses may be already-serialized bytes (the ring's
    :attr:`RingEntry.wire`) and are sent as they are; the wire is the same."""
    capture = _HandlerCapture()
    observer_pb2_grpc.add_ObserverServicer_to_server(servicer, capture)  # type: ignore[no-untyped-call]
    handlers = capture.handlers
    handlers["GetFlows"] = grpc.unary_stream_rpc_method_handler(
        servicer.GetFlows,
        request_deserializer=observer_pb2.GetFlowsRequest.FromString,
        response_serializer=_passthrough,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(OBSERVER_SERVICE_NAME, handlers),)
    )
    server.add_registered_method_handlers(OBSERVER_SERVICE_NAME, handlers)


class FlowBatchServicer(flowbatch_pb2_grpc.FlowBatchServiceServicer):
    """``cilia.flowbatch.v1.FlowBatchService`` (Cilia-private, for the relay): the
    GetFlows stream of a request in batches of serialized responses (see the proto).

    Args:
        store: the agent's :class:`FlowStore`.
    """

    def __init__(self, store: FlowStore) -> None:
        self.store = store

    async def GetFlowBatches(  # noqa: N802 - gRPC method name
        self,
        request: flowbatch_pb2.GetFlowBatchesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[flowbatch_pb2.GetFlowBatchesResponse]:
        """Batched GetFlows; INVALID_ARGUMENT as GetFlows for bad options or filters."""
        max_batch = min(int(request.max_batch) or DEFAULT_MAX_BATCH, MAX_BATCH_LIMIT)
        async for batch in _refusing(
            lambda: self.store.get_flow_batches(request.request, max_batch), context
        ):
            yield batch
