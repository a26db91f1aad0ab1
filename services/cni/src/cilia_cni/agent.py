"""Client of the agent's ``cilia.agent.v1.AttachmentService`` over its unix socket.

Imported lazily by the plugin, only once the invocation is valid and the socket exists:
this is the module that pays for ``import grpc`` and the generated messages. Method
paths come from the contract's descriptor, so the service name is not repeated here.

gRPC status → CNI error (documented in services/cni/README.md):

=========================================================  =======================
UNAVAILABLE, DEADLINE_EXCEEDED, connection failures         11 AgentUnavailable
INVALID_ARGUMENT                                            7  InvalidNetworkConfig
NOT_FOUND (ADD: netns does not exist)                       8  InvalidNetNS
NOT_FOUND (CHECK: unknown container_id/ifname)              3  UnknownContainer
FAILED_PRECONDITION (CHECK: mismatch, differences listed)   102 CheckMismatch
ALREADY_EXISTS (ifname exists in the netns)                 100 AttachmentExists
RESOURCE_EXHAUSTED (pool has no free address)               101 PoolExhausted
anything else                                               999 InternalError
=========================================================  =======================

Every method uses grpcio's synchronous API (no asyncio event loop is started).
"""

from __future__ import annotations

import time
from typing import Any  # grpc imports typing anyway

import grpc

from cilia.agent.v1 import agent_pb2
from cilia_cni.errors import (
    AgentTimeout,
    AgentUnavailable,
    AgentUnreachable,
    AttachmentExists,
    CheckMismatch,
    CniError,
    InternalError,
    InvalidNetNS,
    InvalidNetworkConfig,
    PoolExhausted,
    UnknownContainer,
)

_SERVICE = agent_pb2.DESCRIPTOR.services_by_name["AttachmentService"]
_DEBUG = agent_pb2.DESCRIPTOR.services_by_name["DebugService"]
#: Channel options: no transparent retries or proxies; a CNI call is one attempt.
_CHANNEL_OPTIONS = (
    ("grpc.enable_retries", 0),
    ("grpc.enable_http_proxy", 0),
)

_BY_STATUS: dict[object, type[CniError]] = {
    grpc.StatusCode.UNAVAILABLE: AgentUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: AgentUnavailable,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidNetworkConfig,
    grpc.StatusCode.NOT_FOUND: InvalidNetNS,
    grpc.StatusCode.ALREADY_EXISTS: AttachmentExists,
    grpc.StatusCode.RESOURCE_EXHAUSTED: PoolExhausted,
}
#: CHECK reads NOT_FOUND and FAILED_PRECONDITION differently (agent.proto, Check).
_BY_STATUS_CHECK: dict[object, type[CniError]] = {
    **_BY_STATUS,
    grpc.StatusCode.NOT_FOUND: UnknownContainer,
    grpc.StatusCode.FAILED_PRECONDITION: CheckMismatch,
}


def _method(name: str, service: object = _SERVICE) -> str:
    svc = service  # a ServiceDescriptor
    return f"/{svc.full_name}/{svc.methods_by_name[name].name}"  # type: ignore[attr-defined]


def _unary(
    channel: grpc.Channel, name: str, request: Any, response: Any, service: object = _SERVICE
) -> Any:
    """Return the unary-unary callable of method ``name`` of ``service`` on ``channel``.

    ``request``/``response`` are the generated message classes (``agent_pb2.AddRequest``, ...)
    whose ``SerializeToString``/``FromString`` (de)serialize the call.
    """
    return channel.unary_unary(
        _method(name, service),
        request_serializer=request.SerializeToString,
        response_deserializer=response.FromString,
    )


class AgentClient:
    """One insecure channel to ``unix:<socket_path>``; use as a context manager.

    Each call is a single attempt without ``wait_for_ready``: an absent or refusing
    socket fails at once with UNAVAILABLE instead of waiting for the timeout.
    """

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        #: Milliseconds spent in calls to the agent (channel set-up included), for the log.
        self.call_ms = 0.0
        self._channel = grpc.insecure_channel("unix:" + socket_path, options=_CHANNEL_OPTIONS)
        channel = self._channel
        self._add = _unary(channel, "Add", agent_pb2.AddRequest, agent_pb2.AddResponse)
        self._del = _unary(channel, "Del", agent_pb2.DelRequest, agent_pb2.DelResponse)
        self._check = _unary(channel, "Check", agent_pb2.CheckRequest, agent_pb2.CheckResponse)
        self._gc = _unary(channel, "GC", agent_pb2.GCRequest, agent_pb2.GCResponse)
        self._status = _unary(
            channel, "Status", agent_pb2.StatusRequest, agent_pb2.StatusResponse, _DEBUG
        )

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._channel.close()

    def add(self, request: agent_pb2.AddRequest, timeout: float) -> agent_pb2.AddResponse:
        """Call ``Add`` with a deadline of ``timeout`` seconds.

        Raises:
            CniError: the subclass mapped from the gRPC status (see the module table).
        """
        try:
            response: agent_pb2.AddResponse = self._timed(self._add, request, timeout)
        except grpc.RpcError as exc:
            raise self._error("ADD", exc, timeout, "agent-timeout-seconds") from None
        return response

    def delete(self, request: agent_pb2.DelRequest, timeout: float) -> bool:
        """Call ``Del`` with a deadline of ``timeout`` seconds.

        Returns whether the agent had something to delete.

        Raises:
            CniError: the subclass mapped from the gRPC status (see the module table).
        """
        try:
            response: agent_pb2.DelResponse = self._timed(self._del, request, timeout)
        except grpc.RpcError as exc:
            raise self._error("DEL", exc, timeout, "agent-del-timeout-seconds") from None
        return bool(response.deleted)

    def check(self, request: agent_pb2.CheckRequest, timeout: float) -> agent_pb2.CheckResponse:
        """Call ``Check`` with a deadline of ``timeout`` seconds.

        Raises:
            CniError: UnknownContainer (NOT_FOUND), CheckMismatch (FAILED_PRECONDITION),
                AgentUnavailable, ... (see the module table).
        """
        try:
            response: agent_pb2.CheckResponse = self._timed(self._check, request, timeout)
        except grpc.RpcError as exc:
            raise self._error(
                "CHECK", exc, timeout, "agent-timeout-seconds", _BY_STATUS_CHECK
            ) from None
        return response

    def gc(self, request: agent_pb2.GCRequest, timeout: float) -> agent_pb2.GCResponse:
        """Call ``GC`` with a deadline of ``timeout`` seconds.

        Raises:
            CniError: the subclass mapped from the gRPC status (see the module table).
        """
        try:
            response: agent_pb2.GCResponse = self._timed(self._gc, request, timeout)
        except grpc.RpcError as exc:
            raise self._error("GC", exc, timeout, "agent-timeout-seconds") from None
        return response

    def status(self, timeout: float) -> agent_pb2.StatusResponse:
        """Call ``DebugService.Status`` with a deadline of ``timeout`` seconds.

        Raises:
            CniError: the subclass mapped from the gRPC status (see the module table).
        """
        try:
            response: agent_pb2.StatusResponse = self._timed(
                self._status, agent_pb2.StatusRequest(), timeout
            )
        except grpc.RpcError as exc:
            raise self._error("STATUS", exc, timeout, "agent-timeout-seconds") from None
        return response

    def _timed(self, method: Any, request: object, timeout: float) -> Any:
        started = time.monotonic()
        try:
            return method(request, timeout=timeout)
        finally:
            self.call_ms += (time.monotonic() - started) * 1000

    def _error(
        self,
        op: str,
        exc: grpc.RpcError,
        timeout: float,
        timeout_key: str,
        by_status: dict[object, type[CniError]] = _BY_STATUS,
    ) -> CniError:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        text = exc.details() if callable(getattr(exc, "details", None)) else None
        status = getattr(code, "name", "UNKNOWN")
        agent_msg = str(text or "").strip() or "(no message)"
        where = f"cilia-agent at unix:{self.socket_path}"
        check = (
            f"start or check cilia-agent (cilia-agent status --socket {self.socket_path}); "
            "the runtime will retry"
        )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return AgentTimeout(
                f"{where} did not answer {op} within {timeout:g}s (netconf "
                f"`{timeout_key}`): {check}",
                f"gRPC {status}: {agent_msg}",
            )
        cls = by_status.get(code, InternalError)
        if cls is AgentUnavailable and not _is_transport_failure(agent_msg):
            # The agent answered: it is up but cannot serve the request now (for
            # example its operator is unreachable). Say why, in its own words.
            return AgentUnavailable(
                f"{where} cannot complete {op} now: {agent_msg}; the runtime will retry",
                f"gRPC {status}",
            )
        if cls is AgentUnavailable:
            return AgentUnreachable(
                f"{where} is unreachable or not ready for {op}: {check}",
                f"gRPC {status}: {agent_msg}",
            )
        if cls is InternalError:
            return InternalError(f"{where} failed {op}: {agent_msg}", f"gRPC {status}")
        if cls is UnknownContainer:
            return UnknownContainer(
                f"{where} holds no attachment for this container and ifname ({agent_msg}): "
                "nothing to check; ADD it again",
                f"gRPC {status}",
            )
        if cls is CheckMismatch:
            return CheckMismatch(
                f"{where}: CHECK found the attachment differs from prevResult: {agent_msg}; "
                "the runtime should DEL and ADD the container again",
                f"gRPC {status}",
            )
        return cls(f"{where} refused {op}: {agent_msg}", f"gRPC {status}")


# Texts grpc uses when the transport to the agent failed (no answer from the agent).
_TRANSPORT_FAILURES = ("failed to connect", "connection refused", "socket closed", "no such file")


def _is_transport_failure(details: str) -> bool:
    """True when an UNAVAILABLE came from gRPC's transport, not from the agent itself."""
    lowered = details.lower()
    return details == "(no message)" or any(text in lowered for text in _TRANSPORT_FAILURES)
