"""Map domain errors to gRPC statuses at the boundary.

Each domain error becomes a status code, its message, and a machine-readable
``google.rpc.ErrorInfo`` (reason in UPPER_SNAKE, domain ``operator.cilia.io``) in the
``grpc-status-details-bin`` trailer (:mod:`cilia_common.grpcerrors`), so a client acts on
the reason instead of the text.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from cilia_common import grpcerrors

from ..endpoint.records import InvalidEndpoint
from ..errors import InvalidResource
from ..identity.allocator import AllocationContention, IdentitiesExhausted
from ..identity.labels import InvalidLabels
from ..kinds import UnknownKind
from ..manifests import InvalidManifest
from ..store import AlreadyExists, Conflict, NotFound, StoreUnavailable
from .applyfence import ApplyAbandoned

R = TypeVar("R")
Y = TypeVar("Y")

_CODES: tuple[tuple[type[Exception], Any, str], ...] = (
    (NotFound, grpc.StatusCode.NOT_FOUND, "NOT_FOUND"),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS"),
    (Conflict, grpc.StatusCode.ABORTED, "CONFLICT"),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE, "STORE_UNAVAILABLE"),
    (InvalidManifest, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_MANIFEST"),
    (InvalidResource, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_RESOURCE"),
    (UnknownKind, grpc.StatusCode.INVALID_ARGUMENT, "UNKNOWN_KIND"),
    (InvalidLabels, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_LABELS"),
    (InvalidEndpoint, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ENDPOINT"),
    (IdentitiesExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED, "IDENTITIES_EXHAUSTED"),
    (AllocationContention, grpc.StatusCode.ABORTED, "ALLOCATION_CONTENTION"),
    (ApplyAbandoned, grpc.StatusCode.ABORTED, "APPLY_ABANDONED"),
)


def status_for(exc: Exception) -> tuple[Any, str] | None:
    """``(gRPC status code, ErrorInfo reason)`` for a domain error, or None when it is not
    one (``NotFound`` -> ``(NOT_FOUND, "NOT_FOUND")``)."""
    for cls, code, reason in _CODES:
        if isinstance(exc, cls):
            return code, reason
    return None


async def _abort_for(exc: Exception, context: Any) -> None:
    """Abort the RPC with ``exc``'s status and a ``google.rpc.ErrorInfo`` (reason from
    :data:`_CODES`, domain ``operator.cilia.io``); return (the caller re-raises) when
    ``exc`` is not a domain error."""
    mapped = status_for(exc)
    if mapped is not None:
        code, reason = mapped
        await grpcerrors.abort(
            context, code, str(exc), reason=reason, domain=grpcerrors.OPERATOR_DOMAIN
        )


def unary(
    fn: Callable[[Any, Any, Any], Awaitable[R]],
) -> Callable[[Any, Any, Any], Awaitable[R]]:
    """Decorate a unary servicer method: domain errors become gRPC statuses."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> R:
        try:
            return await fn(self, request, context)
        except Exception as exc:
            await _abort_for(exc, context)
            raise  # not a domain error (abort raises otherwise)

    return wrapper


def streaming(
    fn: Callable[[Any, Any, Any], AsyncIterator[Y]],
) -> Callable[[Any, Any, Any], AsyncIterator[Y]]:
    """Decorate a server-streaming servicer method (an async generator): domain errors
    raised while producing responses become gRPC statuses, as with :func:`unary`."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> AsyncIterator[Y]:
        responses = fn(self, request, context)
        try:
            async for response in responses:
                yield response
        except Exception as exc:
            await _abort_for(exc, context)
            raise  # not a domain error (abort raises otherwise)
        finally:
            if isinstance(responses, AsyncGenerator):
                await responses.aclose()

    return wrapper
