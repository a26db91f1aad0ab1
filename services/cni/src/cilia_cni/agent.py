"""Client of the agent's ``cilia.agent.v1.AttachmentService`` over its unix socket.

Imported lazily by the plugin, only once the invocation is valid and the socket exists:
this is the module that pays for the HTTP/2 client (:mod:`cilia_cni.h2grpc`: hpack,
hyperframe). Messages and method paths are :mod:`cilia_cni.wire`'s (the protobuf runtime
is not imported on the success path; its tests check them against the contract).

gRPC status → CNI error (documented in services/cni/README.md):

=========================================================  =======================
UNAVAILABLE, DEADLINE_EXCEEDED, connection failures         11 AgentUnavailable
the socket does not speak HTTP/2 (first frame not SETTINGS)  11 AgentUnreachable
INVALID_ARGUMENT                                            7  InvalidNetworkConfig
NOT_FOUND (ADD: netns does not exist)                       8  InvalidNetNS
NOT_FOUND (CHECK: unknown container_id/ifname)              3  UnknownContainer
FAILED_PRECONDITION (CHECK: mismatch, differences listed)   102 CheckMismatch
ALREADY_EXISTS (ifname exists in the netns)                 100 AttachmentExists
ErrorInfo reason POOL_EXHAUSTED (domain agent.cilia.io)      101 PoolExhausted
RESOURCE_EXHAUSTED "no free IPv4 address in pool ..."       101 PoolExhausted (older agent)
RESOURCE_EXHAUSTED "... message larger than max ..."        7  InvalidNetworkConfig
RESOURCE_EXHAUSTED, anything else (e.g. policy map full)    999 InternalError
anything else                                               999 InternalError
=========================================================  =======================

The agent names what went wrong for programs in the status's ``google.rpc.ErrorInfo``
(``grpc-status-details-bin``; cilia_common.grpcerrors on its side): a (domain, reason) in
:data:`_BY_REASON` decides the CNI code whatever the status code. The google.rpc messages
are imported only when an error carries details (about 2 ms on an idle host, -X importtime;
nothing on the success path). An agent that sends no ErrorInfo (older versions) is still
understood by the message text below.

RESOURCE_EXHAUSTED means two unrelated things: the agent's IPAM has no address (its
``PoolExhausted``: reason ``POOL_EXHAUSTED``, or for an older agent the message
:data:`POOL_EXHAUSTED_PREFIX`, checked against the real agent by test_cni_conformance) and
gRPC's own message size limit (grpc core: "Received message
larger than max (N vs. M)" on the server, "Sent message larger than max" on a client),
which a request with e.g. 50,000 labels hits: that is the netconf's doing (code 7).

The transport is :func:`cilia_cni.h2grpc.unary_call`: one HTTP/2 connection per call, no
retries, no proxy (as the grpcio channel before it: ``grpc.enable_retries=0``).
"""

from __future__ import annotations

import time

from cilia_cni import wire
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
from cilia_cni.h2grpc import (
    INTERNAL,
    MAX_RESPONSE_MESSAGE_BYTES,
    NotHttp2,
    ResponseTooLarge,
    RpcError,
    unary_call,
)

# typing is not imported at run time (start-up cost); mypy honours this constant.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import TypeVar

    _Response = TypeVar("_Response", bound=wire.Message)

#: How cilia-agent's IPAM ``PoolExhausted`` message starts (services/agent ipam/allocator.py);
#: read only when the agent sent no ErrorInfo (an agent older than the reasons).
POOL_EXHAUSTED_PREFIX = "no free IPv4 address in pool"
#: ``google.rpc.ErrorInfo.domain`` of cilia-agent's errors (cilia_common.grpcerrors).
AGENT_DOMAIN = "agent.cilia.io"
#: ErrorInfo reason of the agent's IPAM ``PoolExhausted``.
POOL_EXHAUSTED_REASON = "POOL_EXHAUSTED"
#: (domain, reason) → CNI error, ahead of the status code.
_BY_REASON: dict[tuple[str, str], type[CniError]] = {
    (AGENT_DOMAIN, POOL_EXHAUSTED_REASON): PoolExhausted,
}
_ERROR_INFO_TYPE = "google.rpc.ErrorInfo"


def error_reason(exc: RpcError) -> tuple[str, str] | None:
    """``(domain, reason)`` of the first ``google.rpc.ErrorInfo`` in ``exc``'s
    ``grpc-status-details-bin`` (a serialized ``google.rpc.Status``), or None when the
    trailer is absent, malformed or holds no ErrorInfo.

    The ``google.rpc`` messages (googleapis-common-protos) are imported here, on the error
    path only.
    """
    if not exc.status_details:
        return None
    from google.protobuf.message import DecodeError
    from google.rpc import error_details_pb2, status_pb2

    try:
        status = status_pb2.Status.FromString(exc.status_details)
        for detail in status.details:
            if detail.type_url.rpartition("/")[2] == _ERROR_INFO_TYPE:
                info = error_details_pb2.ErrorInfo.FromString(detail.value)
                return info.domain, info.reason
    except DecodeError:
        return None
    return None


#: grpc core's message size limit errors ("Received/Sent message larger than max (N vs. M)").
SIZE_LIMIT_TEXT = "message larger than max"

_BY_STATUS: dict[str, type[CniError]] = {
    "UNAVAILABLE": AgentUnavailable,
    "DEADLINE_EXCEEDED": AgentUnavailable,
    "INVALID_ARGUMENT": InvalidNetworkConfig,
    "NOT_FOUND": InvalidNetNS,
    "ALREADY_EXISTS": AttachmentExists,
    "RESOURCE_EXHAUSTED": PoolExhausted,
}
#: CHECK reads NOT_FOUND and FAILED_PRECONDITION differently (agent.proto, Check).
_BY_STATUS_CHECK: dict[str, type[CniError]] = {
    **_BY_STATUS,
    "NOT_FOUND": UnknownContainer,
    "FAILED_PRECONDITION": CheckMismatch,
}


class AgentClient:
    """Calls to the agent at ``unix:<socket_path>``; use as a context manager.

    Each call is a single attempt on its own connection (:func:`cilia_cni.h2grpc.unary_call`):
    an absent or refusing socket fails at once with UNAVAILABLE instead of waiting for the
    timeout.
    """

    def __init__(
        self, socket_path: str, max_response_bytes: int = MAX_RESPONSE_MESSAGE_BYTES
    ) -> None:
        self.socket_path = socket_path
        #: Largest response message accepted (netconf ``agent-max-response-bytes``).
        self.max_response_bytes = max_response_bytes
        #: Milliseconds spent in calls to the agent (connection set-up included), for the log.
        self.call_ms = 0.0

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # every call closes its own connection

    def add(self, request: wire.AddRequest, timeout: float) -> wire.AddResponse:
        """Call ``Add`` with a deadline of ``timeout`` seconds.

        Raises:
            CniError: the subclass mapped from the gRPC status (see the module table).
        """
        try:
            response = self._call(wire.ADD_METHOD, request, wire.AddResponse, timeout)
        except RpcError as exc:
            raise self._error("ADD", exc, timeout, "agent-timeout-seconds") from None
        return response

    def delete(self, request: wire.DelRequest, timeout: float) -> bool:
        """Call ``Del`` with a deadline of ``timeout`` seconds.

        Returns whether the agent had something to delete.

        Raises:
            CniError: the subclass mapped from the gRPC status (see the module table).
        """
        try:
            response = self._call(wire.DEL_METHOD, request, wire.DelResponse, timeout)
        except RpcError as exc:
            raise self._error("DEL", exc, timeout, "agent-del-timeout-seconds") from None
        return bool(response.deleted)

    def check(self, request: wire.CheckRequest, timeout: float) -> wire.CheckResponse:
        """Call ``Check`` with a deadline of ``timeout`` seconds.

        Raises:
            CniError: UnknownContainer (NOT_FOUND), CheckMismatch (FAILED_PRECONDITION),
                AgentUnavailable, ... (see the module table).
        """
        try:
            response = self._call(wire.CHECK_METHOD, request, wire.CheckResponse, timeout)
        except RpcError as exc:
            raise self._error(
                "CHECK", exc, timeout, "agent-timeout-seconds", _BY_STATUS_CHECK
            ) from None
        return response

    def gc(self, request: wire.GCRequest, timeout: float) -> wire.GCResponse:
        """Call ``GC`` with a deadline of ``timeout`` seconds.

        Raises:
            CniError: the subclass mapped from the gRPC status (see the module table).
        """
        try:
            response = self._call(wire.GC_METHOD, request, wire.GCResponse, timeout)
        except RpcError as exc:
            raise self._error("GC", exc, timeout, "agent-timeout-seconds") from None
        return response

    def status(self, timeout: float) -> wire.StatusResponse:
        """Call ``DebugService.Status`` with a deadline of ``timeout`` seconds.

        Raises:
            CniError: the subclass mapped from the gRPC status (see the module table).
        """
        try:
            response = self._call(
                wire.STATUS_METHOD, wire.StatusRequest(), wire.StatusResponse, timeout
            )
        except RpcError as exc:
            raise self._error("STATUS", exc, timeout, "agent-timeout-seconds") from None
        return response

    def _call(
        self, method: str, request: wire.Message, response: type[_Response], timeout: float
    ) -> _Response:
        """One unary call of ``method`` (its path); the response as ``response``.

        Raises:
            RpcError: the call's status is not OK; a response that does not parse as
                ``response`` is INTERNAL (as grpcio's deserializer failure).
        """
        started = time.monotonic()
        try:
            raw = unary_call(
                self.socket_path,
                method,
                request.SerializeToString(),
                timeout,
                max_response_bytes=self.max_response_bytes,
            )
        except ResponseTooLarge as exc:
            raise RpcError(
                INTERNAL, f"{exc.details}: raise netconf `agent-max-response-bytes`"
            ) from None
        finally:
            self.call_ms += (time.monotonic() - started) * 1000
        try:
            return response.FromString(raw)
        except wire.DecodeError as exc:
            name = method.rpartition("/")[2]
            raise RpcError(INTERNAL, f"the agent's {name} response does not parse: {exc}") from None

    def _error(
        self,
        op: str,
        exc: RpcError,
        timeout: float,
        timeout_key: str,
        by_status: dict[str, type[CniError]] = _BY_STATUS,
    ) -> CniError:
        status = exc.name
        agent_msg = exc.details.strip() or "(no message)"
        where = f"cilia-agent at unix:{self.socket_path}"
        check = (
            f"start or check cilia-agent (cilia-agent status --socket {self.socket_path}); "
            "the runtime will retry"
        )
        if status == "DEADLINE_EXCEEDED":
            return AgentTimeout(
                f"{where} did not answer {op} within {timeout:g}s (netconf "
                f"`{timeout_key}`): {check}",
                f"gRPC {status}: {agent_msg}",
            )
        reason = error_reason(exc)
        if reason is not None and reason in _BY_REASON:
            return _BY_REASON[reason](
                f"{where} refused {op}: {agent_msg}", f"gRPC {status} ({reason[1]})"
            )
        cls = by_status.get(status, InternalError)
        if status == "RESOURCE_EXHAUSTED":
            if SIZE_LIMIT_TEXT in agent_msg:
                return InvalidNetworkConfig(
                    f"{where} refused {op}: the request is larger than the agent's gRPC "
                    f"message size limit ({agent_msg}, bytes): the network config carries "
                    "too much (labels, annotations, prevResult or attachments)",
                    f"gRPC {status}",
                )
            if reason is not None or not agent_msg.startswith(POOL_EXHAUSTED_PREFIX):
                cls = InternalError  # an agent with reasons names pool exhaustion by one
        if cls is AgentUnavailable and not (exc.transport or agent_msg == "(no message)"):
            # The agent answered: it is up but cannot serve the request now (for
            # example its operator is unreachable). Say why, in its own words.
            return AgentUnavailable(
                f"{where} cannot complete {op} now: {agent_msg}; the runtime will retry",
                f"gRPC {status}",
            )
        if isinstance(exc, NotHttp2):
            return AgentUnreachable(
                f"{where}: the agent socket does not speak HTTP/2 (gRPC), cannot {op}: is "
                f"netconf `agent-socket` cilia-agent's socket? {check}",
                f"gRPC {status}: {agent_msg}",
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
