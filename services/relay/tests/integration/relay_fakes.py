"""Contract-level fake agents for the relay tests.

A :class:`FakeAgent` is a real in-process ``grpc.aio`` server on a unix socket serving
``observer.Observer`` (GetFlows with number/follow, ServerStatus, GetNodes, GetNamespaces) and,
optionally, ``peer.Peer`` (Notify: every known peer as PEER_ADDED, then changes).
It records the GetFlows requests and metadata it received.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from cilia.flowbatch.v1 import flowbatch_pb2, flowbatch_pb2_grpc
from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia.hubble.peer import peer_pb2, peer_pb2_grpc

NS = 1_000_000_000


def make_flow(
    t_ns: int,
    node: str,
    *,
    src: tuple[str, str, int, int] = ("default", "frontend", 40000, 1001),
    dst: tuple[str, str, int, int] = ("default", "backend", 8080, 1002),
    verdict: int = flow_pb2.FORWARDED,
    drop_reason: int = 0,
    syn: bool = True,
) -> observer_pb2.GetFlowsResponse:
    """A GetFlowsResponse carrying one TCP flow at ``t_ns`` (ns since the epoch)."""
    flow = flow_pb2.Flow(
        verdict=verdict,  # type: ignore[arg-type]
        node_name=node,
        Type=flow_pb2.L3_L4,
        IP=flow_pb2.IP(source="10.200.0.10", destination="10.200.0.20", ipVersion=flow_pb2.IPv4),
        l4=flow_pb2.Layer4(
            TCP=flow_pb2.TCP(
                source_port=src[2], destination_port=dst[2], flags=flow_pb2.TCPFlags(SYN=syn)
            )
        ),
        source=flow_pb2.Endpoint(
            ID=11,
            identity=src[3],
            namespace=src[0],
            pod_name=src[1],
            labels=[f"k8s:app={src[1]}"],
        ),
        destination=flow_pb2.Endpoint(
            ID=12,
            identity=dst[3],
            namespace=dst[0],
            pod_name=dst[1],
            labels=[f"k8s:app={dst[1]}"],
        ),
        traffic_direction=flow_pb2.INGRESS,
        trace_observation_point=flow_pb2.TO_ENDPOINT,
    )
    flow.time.FromNanoseconds(t_ns)
    flow.is_reply.value = False
    if verdict == flow_pb2.DROPPED:
        flow.event_type.type = 1
        flow.drop_reason = drop_reason
        flow.drop_reason_desc = drop_reason  # type: ignore[assignment]
    else:
        flow.event_type.type = 4
    response = observer_pb2.GetFlowsResponse(flow=flow, node_name=node)
    response.time.FromNanoseconds(t_ns)
    return response


class _Observer(observer_pb2_grpc.ObserverServicer):
    def __init__(self, agent: FakeAgent) -> None:
        self.agent = agent

    async def GetFlows(  # noqa: N802
        self, request: observer_pb2.GetFlowsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[observer_pb2.GetFlowsResponse]:
        agent = self.agent
        agent.requests.append(request)
        agent.metadata.append(dict(context.invocation_metadata() or ()))
        flows = list(agent.flows)
        if request.number:
            flows = flows[-int(request.number) :]
        for response in flows:
            yield response
        if not request.follow:
            return
        queue: asyncio.Queue[observer_pb2.GetFlowsResponse] = asyncio.Queue()
        agent.followers.append(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            agent.followers.remove(queue)

    async def ServerStatus(  # noqa: N802
        self, request: observer_pb2.ServerStatusRequest, context: grpc.aio.ServicerContext
    ) -> observer_pb2.ServerStatusResponse:
        if self.agent.fail_status:
            await context.abort(grpc.StatusCode.INTERNAL, "status broken")
        return self.agent.status

    async def GetNamespaces(  # noqa: N802
        self, request: observer_pb2.GetNamespacesRequest, context: grpc.aio.ServicerContext
    ) -> observer_pb2.GetNamespacesResponse:
        if self.agent.fail_status:
            await context.abort(grpc.StatusCode.INTERNAL, "namespaces broken")
        return observer_pb2.GetNamespacesResponse(
            namespaces=[
                observer_pb2.Namespace(cluster=c, namespace=n) for c, n in self.agent.namespaces
            ]
        )


class _Batches(flowbatch_pb2_grpc.FlowBatchServiceServicer):
    """FlowBatchService over the fake's GetFlows: the stored flows in batches of
    ``max_batch``, then each followed flow as a batch of one."""

    def __init__(self, observer: _Observer) -> None:
        self.observer = observer

    async def GetFlowBatches(  # noqa: N802
        self, request: flowbatch_pb2.GetFlowBatchesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[flowbatch_pb2.GetFlowBatchesResponse]:
        self.observer.agent.batch_requests.append(request)
        stored = len(self.observer.agent.flows)
        size = request.max_batch or 256
        batch = flowbatch_pb2.GetFlowBatchesResponse()
        async for response in self.observer.GetFlows(request.request, context):
            batch.responses.append(response.SerializeToString())
            batch.times_ns.append(response.time.ToNanoseconds())
            batch.flows.append(response.HasField("flow"))
            stored -= 1
            if len(batch.responses) >= size or stored <= 0:
                yield batch
                batch = flowbatch_pb2.GetFlowBatchesResponse()
        if batch.responses:
            yield batch


class _Peer(peer_pb2_grpc.PeerServicer):
    def __init__(self, agent: FakeAgent) -> None:
        self.agent = agent

    async def Notify(  # noqa: N802
        self, request: peer_pb2.NotifyRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[peer_pb2.ChangeNotification]:
        queue: asyncio.Queue[peer_pb2.ChangeNotification] = asyncio.Queue()
        for name, address in self.agent.peers.items():
            await queue.put(
                peer_pb2.ChangeNotification(name=name, address=address, type=peer_pb2.PEER_ADDED)
            )
        self.agent.peer_watchers.append(queue)
        try:
            while True:
                yield await queue.get()
        finally:
            self.agent.peer_watchers.remove(queue)


class FakeAgent:
    """An in-process agent serving the Observer (and optionally Peer) contract.

    Args:
        name: node name put on its flows.
        socket: unix socket path it listens on.
        flows: responses served to GetFlows (the last ``number`` of them).
        status: ServerStatus answer.
        peers: when given, serve peer.Peer announcing ``{name: address}``.
        fail_status: ServerStatus and GetNamespaces fail with INTERNAL.
        namespaces: GetNamespaces answer, ``(cluster, namespace)`` pairs.
        batches: also serve the Cilia-private FlowBatchService (else the relay gets
            UNIMPLEMENTED for it and must fall back to GetFlows).
    """

    def __init__(
        self,
        name: str,
        socket: pathlib.Path,
        flows: Sequence[observer_pb2.GetFlowsResponse] = (),
        status: observer_pb2.ServerStatusResponse | None = None,
        peers: dict[str, str] | None = None,
        fail_status: bool = False,
        namespaces: Sequence[tuple[str, str]] = (),
        batches: bool = False,
    ) -> None:
        self.name = name
        self.socket = socket
        self.address = f"unix:{socket}"
        self.flows = list(flows)
        self.status = status or observer_pb2.ServerStatusResponse(version=f"fake {name}")
        self.peers = dict(peers) if peers is not None else None
        self.fail_status = fail_status
        self.namespaces = list(namespaces)
        self.batches = batches
        self.requests: list[observer_pb2.GetFlowsRequest] = []
        self.batch_requests: list[flowbatch_pb2.GetFlowBatchesRequest] = []
        self.metadata: list[dict[str, str]] = []
        self.followers: list[asyncio.Queue[observer_pb2.GetFlowsResponse]] = []
        self.peer_watchers: list[asyncio.Queue[peer_pb2.ChangeNotification]] = []
        self.server: grpc.aio.Server | None = None

    async def start(self) -> FakeAgent:
        server = grpc.aio.server()
        observer = _Observer(self)
        observer_pb2_grpc.add_ObserverServicer_to_server(observer, server)
        if self.batches:
            flowbatch_pb2_grpc.add_FlowBatchServiceServicer_to_server(_Batches(observer), server)
        if self.peers is not None:
            peer_pb2_grpc.add_PeerServicer_to_server(_Peer(self), server)
        server.add_insecure_port(self.address)
        await server.start()
        self.server = server
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    async def push(self, response: observer_pb2.GetFlowsResponse) -> None:
        """Send ``response`` to every follow stream (and keep it for later calls)."""
        self.flows.append(response)
        for queue in self.followers:
            await queue.put(response)

    async def announce(self, name: str, address: str, kind: int = peer_pb2.PEER_ADDED) -> None:
        """Send a peer change to every Notify stream."""
        assert self.peers is not None
        if kind == peer_pb2.PEER_DELETED:
            self.peers.pop(name, None)
        else:
            self.peers[name] = address
        for queue in self.peer_watchers:
            await queue.put(
                peer_pb2.ChangeNotification(name=name, address=address, type=kind)  # type: ignore[arg-type]
            )


async def wait_until(predicate: object, timeout: float = 5.0) -> None:
    """Poll ``predicate()`` every 20 ms until true; AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def agents(*items: FakeAgent) -> AsyncIterator[list[FakeAgent]]:
    """Start the agents; stop every one still running on exit."""
    started = [await agent.start() for agent in items]
    try:
        yield started
    finally:
        for agent in started:
            await agent.stop()
