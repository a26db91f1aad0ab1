"""Map domain errors to gRPC status codes at the boundary."""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from ..endpoint.records import InvalidEndpoint
from ..errors import InvalidResource
from ..identity.allocator import AllocationContention, IdentitiesExhausted
from ..identity.labels import InvalidLabels
from ..kinds import UnknownKind
from ..manifests import InvalidManifest
from ..store import AlreadyExists, Conflict, NotFound, StoreUnavailable

R = TypeVar("R")
Y = TypeVar("Y")

_CODES: tuple[tuple[type[Exception], Any], ...] = (
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (Conflict, grpc.StatusCode.ABORTED),
    (StoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (InvalidManifest, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidResource, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownKind, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidLabels, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidEndpoint, grpc.StatusCode.INVALID_ARGUMENT),
    (IdentitiesExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AllocationContention, grpc.StatusCode.ABORTED),
)


def status_for(exc: Exception) -> Any:
    """The gRPC status code for a domain error, or None when it is not one."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return None


async def _abort_for(exc: Exception, context: Any) -> None:
    """Abort the RPC with ``exc``'s status; return (the caller re-raises) when ``exc``
    is not a domain error."""
    code = status_for(exc)
    if code is not None:
        await context.abort(code, str(exc))


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
