"""gRPC errors with a machine-readable reason (``google.rpc.ErrorInfo``).

A server aborts with :func:`abort`: besides the status code and message, the RPC's trailers
carry ``grpc-status-details-bin``, a serialized ``google.rpc.Status`` whose details hold one
``google.rpc.ErrorInfo`` (``reason`` in UPPER_SNAKE_CASE, ``domain`` naming the service,
optional string ``metadata``). A client reads the reason back with :func:`error_reason` and
acts on it (the CNI plugin maps ``POOL_EXHAUSTED`` to CNI code 101) instead of matching
message text, which stays free for people.

Source: the gRPC richer error model (``google.rpc.Status`` in the
``grpc-status-details-bin`` trailer, as ``grpcio-status``'s ``rpc_status`` module builds and
parses it) and AIP-193 (``ErrorInfo``: reason UPPER_SNAKE, domain a service name).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

__all__ = [
    "AGENT_DOMAIN",
    "DETAILS_KEY",
    "OPERATOR_DOMAIN",
    "abort",
    "error_info",
    "error_info_from_trailers",
    "error_reason",
    "printable",
    "rich_status",
]

DETAILS_KEY = "grpc-status-details-bin"
"""The trailer carrying the serialized ``google.rpc.Status``."""

AGENT_DOMAIN = "agent.cilia.io"
OPERATOR_DOMAIN = "operator.cilia.io"

_ERROR_INFO = error_details_pb2.ErrorInfo.DESCRIPTOR.full_name
_REASON = re.compile(r"^[A-Z][A-Z0-9_]{0,62}[A-Z0-9]$")


def printable(text: str) -> str:
    """``text`` as valid UTF-8: characters that cannot be encoded (lone surrogates, which
    JSON's ``\\ud800`` escapes produce in Python) become ``\\ud800``-style escapes.
    Protobuf strings and gRPC status messages must be valid UTF-8; an error message that
    quotes a client's bad input would otherwise turn the status into UNKNOWN."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def rich_status(
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str,
    domain: str,
    metadata: Mapping[str, str] | None = None,
) -> grpc.Status:
    """The ``grpc.Status`` (code, details, trailing metadata) of an error with an
    ``ErrorInfo``; pass it to ``context.abort_with_status`` (sync or asyncio servers).

    Raises:
        ValueError: ``code`` is OK, or ``reason`` is not UPPER_SNAKE_CASE (AIP-193:
            ``[A-Z][A-Z0-9_]+[A-Z0-9]``, at most 64 characters).
    """
    if code is grpc.StatusCode.OK:
        raise ValueError("an error status cannot be OK")
    if not _REASON.match(reason):
        raise ValueError(f"reason {reason!r} is not UPPER_SNAKE_CASE (e.g. POOL_EXHAUSTED)")
    message = printable(message)
    metadata = {printable(k): printable(v) for k, v in (metadata or {}).items()}
    info = error_details_pb2.ErrorInfo(reason=reason, domain=domain, metadata=metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=message, details=[detail])
    return rpc_status.to_status(status)


async def abort(
    context: Any,
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str,
    domain: str,
    metadata: dict[str, str] | None = None,
) -> NoReturn:
    """End the current RPC of an asyncio servicer (``grpc.aio.ServicerContext``) with
    ``code`` and ``message``, and a ``google.rpc.ErrorInfo(reason, domain, metadata)`` in the
    ``grpc-status-details-bin`` trailer. Use ``await grpcerrors.abort(context, ...)``.

    Args:
        context: the servicer context of the RPC.
        code: the status code (not OK).
        message: for people (``"pool 'default' has no free CIDR"``).
        reason: for programs, UPPER_SNAKE (``POOL_EXHAUSTED``, ``NOT_READY``).
        domain: the service the reason belongs to (:data:`AGENT_DOMAIN`).
        metadata: facts about the error (``{"pool": "default"}``).

    Raises:
        grpc.aio.AbortError: always (what ends the RPC; let it propagate).
        ValueError: ``code`` OK or a malformed ``reason``.
    """
    await context.abort_with_status(
        rich_status(code, message, reason=reason, domain=domain, metadata=metadata)
    )
    raise AssertionError("abort_with_status returned")  # pragma: no cover


def error_info_from_trailers(
    trailers: Iterable[tuple[str, str | bytes]] | None,
) -> error_details_pb2.ErrorInfo | None:
    """The first ``google.rpc.ErrorInfo`` in the ``grpc-status-details-bin`` trailer of
    ``trailers`` (pairs of key and value, as grpc and HTTP/2 clients give them), or None
    when there is no such trailer, it does not parse, or it holds no ErrorInfo."""
    for key, value in trailers or ():
        if key.lower() != DETAILS_KEY:
            continue
        raw = value.encode("latin-1") if isinstance(value, str) else bytes(value)
        status = status_pb2.Status()
        try:
            status.ParseFromString(raw)
        except Exception:  # protobuf's DecodeError is a plain Exception subclass
            return None
        for detail in status.details:
            if detail.TypeName() == _ERROR_INFO:
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                return info
        return None
    return None


def error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The ``google.rpc.ErrorInfo`` an RPC failed with, or None when the server sent none.

    Args:
        exc: the error a call raised: ``grpc.aio.AioRpcError`` or a sync ``grpc.RpcError``
            that is also a ``grpc.Call`` (what sync stubs raise).
    """
    trailing = getattr(exc, "trailing_metadata", None)
    if trailing is None:
        return None
    try:
        trailers = trailing()
    except Exception:  # a call object without trailers: no details
        return None
    return error_info_from_trailers(trailers)


def error_reason(exc: grpc.RpcError) -> str | None:
    """The ``ErrorInfo.reason`` an RPC failed with (``"POOL_EXHAUSTED"``), or None."""
    info = error_info(exc)
    return info.reason if info is not None and info.reason else None
