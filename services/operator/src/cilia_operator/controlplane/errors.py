"""Map domain errors to gRPC status codes at the boundary."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
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


def unary(
    fn: Callable[[Any, Any, Any], Awaitable[R]],
) -> Callable[[Any, Any, Any], Awaitable[R]]:
    """Decorate a unary servicer method: domain errors become gRPC statuses."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: Any) -> R:
        try:
            return await fn(self, request, context)
        except Exception as exc:
            code = status_for(exc)
            if code is None:
                raise
            await context.abort(code, str(exc))
            raise  # unreachable: abort raises

    return wrapper
