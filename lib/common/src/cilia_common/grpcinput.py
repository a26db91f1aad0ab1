"""Requests whose bytes do not parse answer INVALID_ARGUMENT, not UNKNOWN.

grpcio's asyncio server deserializes a request before any handler or interceptor sees it;
when the bytes are not the request message (a corrupt or hostile client), the protobuf
``DecodeError`` escapes as status UNKNOWN with an error traceback in the log.
:class:`MalformedRequestGuard` wraps each method's request deserializer: a failure becomes
a marker, and the method's handler answers INVALID_ARGUMENT naming the method and the
protobuf error before anything else runs (so nothing changes). Client-streaming methods
(reflection) are left as they are. :func:`cilia_common.grpcserver.start_server_with_ports`
installs the guard first, before the caller's interceptors.

Source: gRPC status code guide (INVALID_ARGUMENT: the client specified an invalid
argument; UNKNOWN is for errors without more information).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


class _Malformed:
    """A request whose bytes did not parse, with the reason."""

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return _Malformed(str(exc) or type(exc).__name__)

    return parse


class MalformedRequestGuard(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Unparsable request bytes -> INVALID_ARGUMENT (see the module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """The method's handler with a guarded request deserializer."""
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        method = handler_call_details.method

        async def refuse(request: _Malformed, context: Any) -> None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{method}: malformed request: {request.error}"
            )

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=_safe(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        inner_us = handler.unary_stream
        stream_handler: Any
        if inspect.iscoroutinefunction(inner_us):
            # writes with context.write() (grpc's health Watch): stays a coroutine, which
            # is how grpc tells the two kinds apart
            async def unary_stream_writer(request: Any, context: Any) -> None:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                await inner_us(request, context)

            stream_handler = unary_stream_writer
        else:

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await refuse(request, context)
                responses = inner_us(request, context)
                try:
                    async for response in responses:
                        yield response
                finally:
                    # a cancelled stream ends the handler's generator now
                    aclose = getattr(responses, "aclose", None)
                    if aclose is not None:
                        await aclose()

            stream_handler = unary_stream

        return grpc.unary_stream_rpc_method_handler(
            stream_handler,
            request_deserializer=_safe(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
