"""gRPC boundary of ``cilia.agent.v1``: AttachmentService and DebugService.

Domain exceptions become gRPC status codes here (STYLE.md "Errors"):
InvalidRequest/InvalidLabels/OperatorRejected → INVALID_ARGUMENT, NetnsNotFound/UnknownAttachment →
NOT_FOUND, CheckFailed → FAILED_PRECONDITION,
InterfaceExists/EndpointConflict → ALREADY_EXISTS, PoolExhausted/PolicyMapFull →
RESOURCE_EXHAUSTED, AgentNotReady/OperatorUnavailable (identity allocation)/
PolicyNotReady → UNAVAILABLE, anything else → INTERNAL with the reason (never a
bare traceback).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NoReturn

import grpc

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia_agent.controlplane import OperatorRejected, OperatorUnavailable
from cilia_agent.datapath import (
    DatapathError,
    DefaultRouteExists,
    InterfaceExists,
    NetnsNotFound,
)
from cilia_agent.endpoint import (
    AddParams,
    AgentNotReady,
    CheckFailed,
    CheckParams,
    EndpointConflict,
    EndpointManager,
    EndpointRecord,
    InvalidRequest,
    StateError,
    UnknownAttachment,
)
from cilia_agent.endpoint.chaining import parse_prev_result
from cilia_agent.endpoint.enforcement import InvalidLabels, PolicyNotReady
from cilia_agent.ipam import PoolExhausted, PoolPending
from cilia_agent.policy.maps import PolicyMapFull

log = logging.getLogger(__name__)

ATTACHMENT_SERVICE = "cilia.agent.v1.AttachmentService"
DEBUG_SERVICE = "cilia.agent.v1.DebugService"

_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidLabels, grpc.StatusCode.INVALID_ARGUMENT),
    (DefaultRouteExists, grpc.StatusCode.INVALID_ARGUMENT),
    (PolicyMapFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (OperatorRejected, grpc.StatusCode.INVALID_ARGUMENT),  # before its base class
    (OperatorUnavailable, grpc.StatusCode.UNAVAILABLE),
    (PolicyNotReady, grpc.StatusCode.UNAVAILABLE),
    (NetnsNotFound, grpc.StatusCode.NOT_FOUND),
    (UnknownAttachment, grpc.StatusCode.NOT_FOUND),
    (CheckFailed, grpc.StatusCode.FAILED_PRECONDITION),
    (InterfaceExists, grpc.StatusCode.ALREADY_EXISTS),
    (EndpointConflict, grpc.StatusCode.ALREADY_EXISTS),
    (PoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PoolPending, grpc.StatusCode.UNAVAILABLE),
    (AgentNotReady, grpc.StatusCode.UNAVAILABLE),
    (DatapathError, grpc.StatusCode.INTERNAL),
    (StateError, grpc.StatusCode.INTERNAL),
]


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
    for kind, code in _CODES:
        if isinstance(exc, kind):
            await context.abort(code, str(exc))
    log.exception("unexpected error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}")
    raise AssertionError("unreachable")  # pragma: no cover


def add_response(rec: EndpointRecord, router_ip: str) -> agent_pb2.AddResponse:
    """Build the CNI-shaped AddResponse of a ready endpoint.

    Own endpoints: host veth and container interface, the pod /32 via the router, the
    default route. Chained endpoints: the previous plugin's interfaces, IPs and routes
    unchanged (so the plugin passes its result through).
    """
    if rec.chained:
        prev = parse_prev_result(rec.prev_result, rec.ifname)
        return agent_pb2.AddResponse(
            interfaces=[
                agent_pb2.Interface(
                    name=i["name"], mac=i["mac"], sandbox=i["sandbox"], mtu=i["mtu"]
                )
                for i in prev.interfaces
            ],
            ips=[
                agent_pb2.IPConfig(
                    address=i["address"],
                    gateway=i["gateway"],
                    interface=max(i["interface"], 0),
                )
                for i in prev.ips
            ],
            routes=[agent_pb2.Route(dst=r["dst"], gw=r["gw"]) for r in prev.routes],
            endpoint_id=rec.id,
        )
    return agent_pb2.AddResponse(
        interfaces=[
            agent_pb2.Interface(name=rec.host_ifname, mac=rec.host_mac, mtu=rec.mtu),
            agent_pb2.Interface(
                name=rec.ifname, mac=rec.container_mac, sandbox=rec.netns, mtu=rec.mtu
            ),
        ],
        ips=[agent_pb2.IPConfig(address=f"{rec.ipv4}/32", gateway=router_ip, interface=1)],
        routes=[agent_pb2.Route(dst="0.0.0.0/0", gw=router_ip)],
        endpoint_id=rec.id,
    )


def endpoint_message(rec: EndpointRecord) -> agent_pb2.Endpoint:
    """Convert an endpoint record to its debug-API message."""
    return agent_pb2.Endpoint(
        id=rec.id,
        container_id=rec.container_id,
        ifname=rec.ifname,
        netns=rec.netns,
        ipv4=rec.ipv4,
        host_ifname=rec.host_ifname,
        pool=rec.pool,
        labels=rec.labels,
        pod_namespace=rec.pod_namespace,
        pod_name=rec.pod_name,
        state=rec.state,
        identity=rec.identity,
        chained=rec.chained,
    )


class AttachmentServicer(agent_pb2_grpc.AttachmentServiceServicer):
    """Add/Del/Check/GC of pod attachments, called by ``cilia-cni``."""

    def __init__(self, manager: EndpointManager, router_ip: Callable[[], str]) -> None:
        self.manager = manager
        self.router_ip = router_ip

    async def Add(  # noqa: N802 - gRPC method name
        self, request: agent_pb2.AddRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.AddResponse:
        params = AddParams(
            container_id=request.container_id,
            ifname=request.ifname,
            netns=request.netns,
            labels=dict(request.labels),
            pod_namespace=request.pod_namespace,
            pod_name=request.pod_name,
            pool=request.pool,
            mtu=request.mtu,
            prev_result=request.prev_result,
            annotations=dict(request.annotations),
        )
        try:
            rec = await self.manager.add(params)
        except Exception as exc:
            await _abort(context, exc)
        return add_response(rec, self.router_ip())

    async def Del(  # noqa: N802 - gRPC method name
        self, request: agent_pb2.DelRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.DelResponse:
        try:
            deleted = await self.manager.delete(request.container_id, request.ifname, request.netns)
        except Exception as exc:
            await _abort(context, exc)
        return agent_pb2.DelResponse(deleted=deleted)

    async def Check(  # noqa: N802 - gRPC method name
        self, request: agent_pb2.CheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.CheckResponse:
        params = CheckParams(
            container_id=request.container_id,
            ifname=request.ifname,
            netns=request.netns,
            addresses=list(request.addresses),
            routes=[(r.dst, r.gw) for r in request.routes],
            mac=request.mac,
        )
        try:
            rec = await self.manager.check(params)
        except Exception as exc:
            await _abort(context, exc)
        return agent_pb2.CheckResponse(endpoint_id=rec.id)

    async def GC(  # noqa: N802 - gRPC method name
        self, request: agent_pb2.GCRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.GCResponse:
        valid = {(a.container_id, a.ifname) for a in request.valid_attachments}
        try:
            released = await self.manager.gc(valid)
        except Exception as exc:
            await _abort(context, exc)
        return agent_pb2.GCResponse(
            released=[agent_pb2.Attachment(container_id=c, ifname=i) for c, i in released]
        )


class DebugServicer(agent_pb2_grpc.DebugServiceServicer):
    """Read-only introspection used by ``cilia-agent status|endpoint list``."""

    def __init__(
        self, manager: EndpointManager, status: Callable[[], agent_pb2.StatusResponse]
    ) -> None:
        self.manager = manager
        self._status = status

    async def Status(  # noqa: N802 - gRPC method name
        self, request: agent_pb2.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.StatusResponse:
        return self._status()

    async def ListEndpoints(  # noqa: N802 - gRPC method name
        self,
        request: agent_pb2.ListEndpointsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> agent_pb2.ListEndpointsResponse:
        return agent_pb2.ListEndpointsResponse(
            endpoints=[endpoint_message(r) for r in self.manager.list()]
        )
