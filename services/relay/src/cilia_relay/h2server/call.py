"""One gRPC call on one HTTP/2 stream of the relay's HTTP/2 server: the handler's context,
the request reader, the response packer (many messages per DATA frame within the flow-control
windows and the call's send buffer), deadline, cancellation and the forwarding of methods the
server does not serve itself."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import h2.errors
import h2.exceptions

from .wire import (
    MAX_FORWARD_TIMEOUT_S,
    PREFIX_LEN,
    RESERVED_HEADERS,
    AbortError,
    encode_grpc_message,
    header_value,
    metadata_value,
    parse_timeout,
)

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger(__name__)


class H2Context:
    """What a fast-path handler gets as ``context``: the part of
    ``grpc.aio.ServicerContext`` such handlers use.

    Attributes:
        method: the call's ``:path`` (``/package.Service/Method``).
    """

    def __init__(
        self,
        method: str,
        metadata: tuple[tuple[str, str | bytes], ...],
        peer: str,
        deadline: float | None,
    ) -> None:
        self.method = method
        self._metadata = metadata
        self._peer = peer
        self._deadline = deadline

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The client's custom metadata (keys lower-case; ``-bin`` values as bytes)."""
        return self._metadata

    def peer(self) -> str:
        """``ipv4:ADDR:PORT``, ``ipv6:[ADDR]:PORT`` or ``unix:PATH``, as grpcio writes it."""
        return self._peer

    def time_remaining(self) -> float | None:
        """Seconds until the client's deadline, None without one."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        """End the call with ``code`` and ``details``.

        Raises:
            AbortError: always (caught by the server).
        """
        raise AbortError(code, details)


StreamHandler = Callable[[Any, H2Context], AsyncIterator[Any]]


@dataclass(frozen=True)
class Method:
    handler: StreamHandler
    deserializer: Callable[[bytes], Any]
    serializer: Callable[[Any], bytes]


class _Reset(Exception):
    """The call ends with RST_STREAM(CANCEL) instead of a status."""


class Call:
    """One HTTP/2 stream carrying one gRPC call."""

    def __init__(self, conn: Connection, stream_id: int, headers: dict[str, bytes]) -> None:
        self.conn = conn
        self.id = stream_id
        self.headers = headers
        self.path = headers.get(":path", b"").decode("latin-1")
        self.inbox: asyncio.Queue[tuple[bytes, int] | None] = asyncio.Queue()
        self.out = bytearray()
        self.limit = conn.server.send_buffer_bytes
        self.space = asyncio.Event()
        self.drained = asyncio.Event()
        self.drained.set()
        self.flush_scheduled = False
        self.headers_sent = False
        self.closed = False
        self.partial = False  # part of a message was sent and the rest is still buffered
        self.task: asyncio.Task[None] | None = None
        raw_timeout = headers.get("grpc-timeout")
        timeout = None if raw_timeout is None else parse_timeout(raw_timeout.decode("latin-1"))
        self.deadline = None if timeout is None else time.monotonic() + timeout
        # a grpc-timeout that does not parse ends the call INTERNAL, as grpc-go's server
        # does ("malformed grpc-timeout"), rather than running it without a deadline
        self.bad_timeout = raw_timeout if raw_timeout is not None and timeout is None else None

    # -- metadata -------------------------------------------------------------------------

    def metadata(self, *, for_forwarding: bool) -> tuple[tuple[str, str | bytes], ...]:
        out: list[tuple[str, str | bytes]] = []
        for key, value in self.conn.raw_headers[self.id]:
            name = key.decode("latin-1").lower()
            if name.startswith(":") or name in RESERVED_HEADERS:
                continue
            if for_forwarding and name.startswith("grpc-"):
                continue
            try:
                out.append((name, metadata_value(name, value)))
            except ValueError:
                continue  # a -bin value that is not base64: dropped
        return tuple(out)

    # -- receiving ------------------------------------------------------------------------

    async def requests(self) -> AsyncIterator[bytes]:
        """The request messages, in order, until the client half-closes.

        Raises:
            AbortError: a compressed message, one too long, or a truncated one.
        """
        buf = bytearray()
        limit = self.conn.server.max_receive_message_bytes
        while True:
            chunk = await self.inbox.get()
            if chunk is None:
                break
            data, flow_len = chunk
            buf += data
            self.conn.acknowledge(self.id, flow_len)
            while len(buf) >= PREFIX_LEN:
                compressed, length = buf[0], int.from_bytes(buf[1:5], "big")
                if compressed:
                    raise AbortError(
                        grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported"
                    )
                if length > limit:
                    raise AbortError(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"received message larger than max ({length} vs. {limit})",
                    )
                if len(buf) < PREFIX_LEN + length:
                    break
                yield bytes(buf[PREFIX_LEN : PREFIX_LEN + length])
                del buf[: PREFIX_LEN + length]
        if buf:
            raise AbortError(grpc.StatusCode.INTERNAL, "request ended inside a message")

    async def unary_request(self) -> bytes:
        """The one request message of a unary-request call.

        Raises:
            AbortError: none or more than one message, or see :meth:`requests`.
        """
        messages = [m async for m in self.requests()]
        if len(messages) != 1:
            raise AbortError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{self.path}: expected one request message, got {len(messages)}",
            )
        return messages[0]

    # -- sending --------------------------------------------------------------------------

    def _send_headers(self, metadata: tuple[tuple[str, str | bytes], ...] = ()) -> None:
        headers = [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-accept-encoding", b"identity"),
        ]
        headers += [(k.encode(), header_value(k, v)) for k, v in metadata]
        self.conn.h2.send_headers(self.id, headers)
        self.headers_sent = True

    async def send(
        self, message: bytes, metadata: tuple[tuple[str, str | bytes], ...] = ()
    ) -> None:
        """Queue one response message (framed); waits while the call's buffer is full.

        Raises:
            asyncio.CancelledError: the call was reset or its connection lost.
        """
        if not self.headers_sent:
            self._send_headers(metadata)
        out = self.out
        out += b"\x00"
        out += len(message).to_bytes(4, "big")
        out += message
        self.drained.clear()
        self.schedule_flush()
        if len(out) >= self.limit:
            self.space.clear()
            await self.space.wait()

    def schedule_flush(self) -> None:
        """Flush once the event loop is done with what is ready now: messages queued and
        window updates received in the same loop iteration go out in the same writes."""
        if not self.flush_scheduled:
            self.flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what is buffered as far as the flow-control windows and the socket allow."""
        self.flush_scheduled = False
        conn = self.conn
        if self.closed:
            return
        out = self.out
        total = len(out)
        sent = 0
        if not conn.paused:
            h2c = conn.h2
            frame = h2c.max_outbound_frame_size
            while sent < total:
                size = min(total - sent, h2c.local_flow_control_window(self.id), frame)
                if size <= 0:
                    break
                h2c.send_data(self.id, bytes(out[sent : sent + size]))
                sent += size
            if sent:
                del out[:sent]
                conn.write()
        self.partial = bool(out) and (sent > 0 or self.partial)
        if len(out) < self.limit:
            self.space.set()
        if not out:
            self.partial = False
            self.drained.set()

    async def finish(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing: tuple[tuple[str, str | bytes], ...] = (),
        *,
        wait_drained: bool = True,
    ) -> None:
        """Send the status (after what is buffered, or dropping it with ``wait_drained``
        False); trailers-only when no message was sent.

        Raises:
            _Reset: part of a message was sent and the rest is dropped: the caller resets.
        """
        if self.closed:
            return
        if wait_drained:
            await self.drained.wait()
        elif self.out:
            if self.partial:
                raise _Reset
            self.out.clear()
        if self.closed:
            return
        trailers: list[tuple[bytes, bytes]] = []
        if not self.headers_sent:
            trailers += [(b":status", b"200"), (b"content-type", b"application/grpc")]
        trailers.append((b"grpc-status", str(code.value[0]).encode()))
        if details:
            trailers.append((b"grpc-message", encode_grpc_message(details)))
        trailers += [(k.encode(), header_value(k, v)) for k, v in trailing]
        self.conn.h2.send_headers(self.id, trailers, end_stream=True)
        self.conn.write()
        self.closed = True

    def reset(self, code: int = h2.errors.ErrorCodes.CANCEL) -> None:
        """RST_STREAM this call (when not closed yet)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(h2.exceptions.H2Error):
                self.conn.h2.reset_stream(self.id, code)
                self.conn.write()

    def wake(self) -> None:
        """Stop waiting for buffer space (the call is over)."""
        self.space.set()
        self.drained.set()

    # -- running --------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the call: the fast path, forwarding, or UNIMPLEMENTED."""
        server = self.conn.server
        method = server.methods.get(self.path)
        try:
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            try:
                async with asyncio.timeout(timeout):
                    if self.bad_timeout is not None:
                        shown = self.bad_timeout[:40].decode("latin-1")
                        raise AbortError(
                            grpc.StatusCode.INTERNAL,
                            f"malformed grpc-timeout {shown!r} (1-8 digits and one of HMSmun)",
                        )
                    if method is not None:
                        await self._serve(method)
                    elif server.forward_to:
                        await self._forward()
                    else:
                        await self.finish(
                            grpc.StatusCode.UNIMPLEMENTED, f"unknown method {self.path}"
                        )
            except TimeoutError:
                await self.finish(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", wait_drained=False
                )
            except AbortError as exc:
                await self.finish(exc.code, exc.details)
        except _Reset:
            self.reset()
        except asyncio.CancelledError:
            self.reset()
            raise
        except Exception as exc:  # a handler bug: the client gets UNKNOWN, the log the trace
            log.exception("gRPC handler failed", extra={"method": self.path})
            with contextlib.suppress(_Reset, h2.exceptions.H2Error):
                await self.finish(
                    grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}"
                )
        finally:
            self.conn.calls.pop(self.id, None)
            self.closed = True
            self.wake()

    async def _serve(self, method: Method) -> None:
        raw = await self.unary_request()
        try:
            request = method.deserializer(raw)
        except Exception as exc:
            raise AbortError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{self.path}: malformed request: {exc}"
            ) from None
        context = H2Context(
            self.path, self.metadata(for_forwarding=False), self.conn.peer, self.deadline
        )
        serialize = method.serializer
        async with contextlib.aclosing(method.handler(request, context)) as responses:  # type: ignore[type-var]
            async for response in responses:
                await self.send(serialize(response))
        await self.finish(grpc.StatusCode.OK)

    async def _forward(self) -> None:
        channel = self.conn.server.channel()
        timeout = None
        if self.deadline is not None:
            timeout = min(max(0.0, self.deadline - time.monotonic()), MAX_FORWARD_TIMEOUT_S)
        aborted: list[AbortError] = []

        async def requests() -> AsyncIterator[bytes]:
            # A malformed request (see requests()) cancels the forwarded call; its status is
            # then this call's, not a bare RST_STREAM.
            try:
                async for message in self.requests():
                    yield message
            except AbortError as exc:
                aborted.append(exc)
                call.cancel()

        call = channel.stream_stream(self.path)(
            requests(), metadata=self.metadata(for_forwarding=True), timeout=timeout
        )
        try:
            first = True
            async for response in call:
                metadata: tuple[tuple[str, str | bytes], ...] = ()
                if first:
                    metadata = tuple(await call.initial_metadata() or ())
                    first = False
                await self.send(response, metadata)
            code = await call.code()
            details = await call.details()
            trailing = tuple(await call.trailing_metadata() or ())
        except grpc.aio.AioRpcError as exc:
            if aborted:
                raise aborted[0] from None
            code, details = exc.code(), exc.details() or ""
            trailing = tuple(exc.trailing_metadata() or ())
        except asyncio.CancelledError:
            call.cancel()
            task = asyncio.current_task()
            if aborted and task is not None and not task.cancelling():
                raise aborted[0] from None
            raise
        await self.finish(code, details or "", trailing)
