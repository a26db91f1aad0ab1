"""A fake relay: a real in-process ``grpc.aio`` server of ``observer.Observer`` on port 0.

GetFlows answers the last ``number`` of its flows that pass a (small) whitelist check, then,
with ``follow``, every flow :meth:`FakeRelay.push` adds. It records each request. A
whitelist carrying a label ``refuse`` is answered ``INVALID_ARGUMENT``, as the real relay
answers a filter it cannot use.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia_common.tls import ServerTLS, server_credentials


def _passes(flow: flow_pb2.Flow, whitelist: list[flow_pb2.FlowFilter]) -> bool:
    if not whitelist:
        return True
    for f in whitelist:
        if f.verdict and flow.verdict not in f.verdict:
            continue
        if f.source_pod and not any(
            f"{flow.source.namespace}/{flow.source.pod_name}".startswith(p) for p in f.source_pod
        ):
            continue
        if f.destination_pod and not any(
            f"{flow.destination.namespace}/{flow.destination.pod_name}".startswith(p)
            for p in f.destination_pod
        ):
            continue
        return True
    return False


class FakeRelay(observer_pb2_grpc.ObserverServicer):
    """The servicer and its server; :meth:`start` binds 127.0.0.1:0 and sets ``address``."""

    def __init__(self, flows: list[flow_pb2.Flow] | None = None) -> None:
        self.flows = list(flows or [])
        self.requests: list[observer_pb2.GetFlowsRequest] = []
        self.address = ""
        self._new = asyncio.Condition()
        self._server: grpc.aio.Server | None = None

    async def start(self, tls: ServerTLS | None = None) -> None:
        """Serve on 127.0.0.1:0, in plaintext or with ``tls`` (mutual with client CAs)."""
        self._server = grpc.aio.server()
        observer_pb2_grpc.add_ObserverServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        if tls is None:
            port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            port = self._server.add_secure_port("127.0.0.1:0", server_credentials(tls)[0])
        await self._server.start()
        self.address = f"127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(0)

    async def push(self, flow: flow_pb2.Flow) -> None:
        async with self._new:
            self.flows.append(flow)
            self._new.notify_all()

    async def GetFlows(  # noqa: N802 (gRPC method name)
        self, request: observer_pb2.GetFlowsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[observer_pb2.GetFlowsResponse]:
        self.requests.append(request)
        whitelist = list(request.whitelist)
        if any("refuse" in f.source_label for f in whitelist):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "source_label: cannot use 'refuse'"
            )
        for flow in self.flows[-request.number :] if request.number else []:
            if _passes(flow, whitelist):
                yield observer_pb2.GetFlowsResponse(flow=flow, node_name=flow.node_name)
        sent = len(self.flows)
        while request.follow:
            async with self._new:
                await self._new.wait_for(lambda n=sent: len(self.flows) > n)
            for flow in self.flows[sent:]:
                if _passes(flow, whitelist):
                    yield observer_pb2.GetFlowsResponse(flow=flow, node_name=flow.node_name)
            sent = len(self.flows)
