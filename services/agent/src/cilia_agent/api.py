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

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol

import grpc

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia_agent.config import Config
from cilia_agent.controlplane import OperatorRejected, OperatorUnavailable
from cilia_agent.datapath import (
    DatapathError,
    DefaultRouteExists,
    HostNetns,
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
from cilia_agent.endpoint.regeneration import InvalidLabels, PolicyNotReady
from cilia_agent.ipam import PoolExhausted, PoolPending
from cilia_agent.k8s import PodUnknown
from cilia_agent.policy.maps import PolicyMapFull
from cilia_common import grpcerrors
from cilia_common.grpcserver import Service, bound_port, set_serving, start_server_with_ports
from cilia_common.runtime import announce_listening
from cilia_common.tls import server_credentials

log = logging.getLogger(__name__)

ATTACHMENT_SERVICE = "cilia.agent.v1.AttachmentService"
DEBUG_SERVICE = "cilia.agent.v1.DebugService"

# exception → (status code, ErrorInfo reason); the first match wins (subclasses first)
_CODES: list[tuple[type[BaseException], grpc.StatusCode, str]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_REQUEST"),
    (InvalidLabels, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_LABELS"),
    (DefaultRouteExists, grpc.StatusCode.INVALID_ARGUMENT, "DEFAULT_ROUTE_EXISTS"),
    (HostNetns, grpc.StatusCode.INVALID_ARGUMENT, "HOST_NETNS"),
    (PolicyMapFull, grpc.StatusCode.RESOURCE_EXHAUSTED, "POLICY_MAP_FULL"),
    (OperatorRejected, grpc.StatusCode.INVALID_ARGUMENT, "OPERATOR_REJECTED"),
    (OperatorUnavailable, grpc.StatusCode.UNAVAILABLE, "OPERATOR_UNAVAILABLE"),
    (PolicyNotReady, grpc.StatusCode.UNAVAILABLE, "POLICY_NOT_READY"),
    (PodUnknown, grpc.StatusCode.UNAVAILABLE, "POD_UNKNOWN"),
    (NetnsNotFound, grpc.StatusCode.NOT_FOUND, "NETNS_NOT_FOUND"),
    (UnknownAttachment, grpc.StatusCode.NOT_FOUND, "UNKNOWN_ATTACHMENT"),
    (CheckFailed, grpc.StatusCode.FAILED_PRECONDITION, "CHECK_FAILED"),
    (InterfaceExists, grpc.StatusCode.ALREADY_EXISTS, "INTERFACE_EXISTS"),
    (EndpointConflict, grpc.StatusCode.ALREADY_EXISTS, "ENDPOINT_CONFLICT"),
    (PoolExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, "POOL_EXHAUSTED"),
    (PoolPending, grpc.StatusCode.UNAVAILABLE, "POOL_PENDING"),
    (AgentNotReady, grpc.StatusCode.UNAVAILABLE, "NOT_READY"),
    (DatapathError, grpc.StatusCode.INTERNAL, "DATAPATH_ERROR"),
    (StateError, grpc.StatusCode.INTERNAL, "STATE_ERROR"),
]
"""Reasons are sent as ``google.rpc.ErrorInfo`` (domain ``agent.cilia.io``): the CNI plugin
maps ``POOL_EXHAUSTED`` to CNI code 101 from the reason, not from the message text."""


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
    for kind, code, reason in _CODES:
        if isinstance(exc, kind):
            await grpcerrors.abort(
                context, code, str(exc), reason=reason, domain=grpcerrors.AGENT_DOMAIN
            )
    log.exception("unexpected error", exc_info=exc)
    await grpcerrors.abort(
        context,
        grpc.StatusCode.INTERNAL,
        f"internal error: {exc}",
        reason="INTERNAL",
        domain=grpcerrors.AGENT_DOMAIN,
    )


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

    def __init__(self, manager: EndpointManager) -> None:
        self.manager = manager

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
        router = self.manager.node.router_ip
        return add_response(rec, str(router) if router else "")

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


class StatusSource(Protocol):
    """Collects the debug Status (``cilia_agent.status.StatusCollector``)."""

    def collect(self) -> agent_pb2.StatusResponse:
        """The current status."""


class DebugServicer(agent_pb2_grpc.DebugServiceServicer):
    """Read-only introspection used by ``cilia-agent status|endpoint list``."""

    def __init__(self, manager: EndpointManager, status: StatusSource) -> None:
        self.manager = manager
        self._status = status

    async def Status(  # noqa: N802 - gRPC method name
        self, request: agent_pb2.StatusRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> agent_pb2.StatusResponse:
        return self._status.collect()

    async def ListEndpoints(  # noqa: N802 - gRPC method name
        self,
        request: agent_pb2.ListEndpointsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> agent_pb2.ListEndpointsResponse:
        return agent_pb2.ListEndpointsResponse(
            endpoints=[endpoint_message(r) for r in self.manager.list()]
        )


class HubbleServer(Protocol):
    """The Hubble facade's serving side (``cilia_agent.hubble.service.Hubble``)."""

    def services(self) -> list[Service]:
        """Observer + Peer."""

    def health_names(self) -> list[str]:
        """Names reported SERVING in ``grpc.health.v1`` (incl. ``hubble.server.Observer``)."""


async def _serve_hubble_tcp(cfg: Config, hubble: HubbleServer) -> grpc.aio.Server | None:
    """Hubble's TCP server (``--hubble-listen-address``): TLS with ``--hubble-tls-*`` (mutual
    when client CAs are given; renewed files are taken at the next handshake), else
    plaintext with a warning unless ``--hubble-disable-tls``. None when TCP is off.

    Raises:
        BindError: the address cannot be bound.
        TLSFileError: a TLS file is unusable.
    """
    tcp = cfg.hubble_listen()
    if not tcp:
        return None
    tls = cfg.hubble_tls
    credentials = None
    if tls is not None:
        credentials, reloader = server_credentials(tls)
        log.info(
            "Hubble TCP server uses TLS",
            extra={"mutual": bool(tls.client_ca_files), "serial": f"{reloader.serial:x}"},
        )
    elif not cfg.hubble_disable_tls:
        log.warning(
            "Hubble TCP server is plaintext: give --hubble-tls-cert-file, --hubble-tls-key-file "
            "and --hubble-tls-client-ca-files (or --hubble-disable-tls to mean it)",
            extra={"listen": tcp},
        )
    server, health, ports = await start_server_with_ports(
        hubble.services(), [tcp], credentials=credentials
    )
    await set_serving(health, hubble.health_names())
    announce_listening(log, "hubble-tcp", bound_port(tcp, ports[tcp]))
    return server


async def serve_api(
    cfg: Config, manager: EndpointManager, status: StatusSource, hubble: HubbleServer
) -> Callable[[], Awaitable[None]]:
    """Serve the agent API on ``--socket`` (mode 0600) and Hubble on ``--hubble-socket``
    and ``--hubble-listen-address``; each listener is announced with its bound address.

    Returns the coroutine function that stops both servers (in-flight RPCs get
    ``--shutdown-grace-period``) and removes the sockets.

    Raises:
        BindError: an address cannot be bound.
    """
    api, health, _ = await start_server_with_ports(
        [
            Service(
                agent_pb2_grpc.add_AttachmentServiceServicer_to_server,
                AttachmentServicer(manager),
                ATTACHMENT_SERVICE,
            ),
            Service(
                agent_pb2_grpc.add_DebugServiceServicer_to_server,
                DebugServicer(manager, status),
                DEBUG_SERVICE,
            ),
        ],
        [f"unix:{cfg.socket}"],
        socket_mode=0o600,
    )
    await set_serving(health, [ATTACHMENT_SERVICE, DEBUG_SERVICE])
    announce_listening(log, "api", f"unix:{cfg.socket}")
    unix = f"unix:{cfg.hubble_socket_path()}"
    hubble_server, hubble_health, _ = await start_server_with_ports(
        hubble.services(), [unix], socket_mode=0o600
    )
    await set_serving(hubble_health, hubble.health_names())
    announce_listening(log, "hubble", unix)
    tcp_server = await _serve_hubble_tcp(cfg, hubble)

    async def stop() -> None:
        for server, path in ((api, cfg.socket), (hubble_server, cfg.hubble_socket_path())):
            await server.stop(cfg.shutdown_grace_period)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if tcp_server is not None:
            await tcp_server.stop(cfg.shutdown_grace_period)

    return stop
