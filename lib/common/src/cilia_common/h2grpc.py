"""A small gRPC server on the ``h2`` HTTP/2 library for server-streaming methods that send
many small messages, with every other method forwarded to a grpcio server.

Why: grpcio sends each message of a stream as its own write that completes through its
poller thread and the event loop before the next may start; streaming 400-byte messages to
the upstream ``hubble observe`` (Go) cost 70-110 µs of server CPU per message on a 2-core
host. Here the messages a handler yields while the event loop is busy are packed into the
same HTTP/2 DATA frames (a DATA frame may carry several length-prefixed gRPC messages, and a
message may span frames; the client decodes them one by one): 3-6 µs per message measured
the same way, and the Go client spends less too (bench/README.md, "flows").

Served: methods registered with :meth:`GrpcH2Server.add_unary_stream` (one request, a stream
of responses; the handler is ``handler(request, context)`` → async iterator, as grpcio's
asyncio API calls it; ``context`` is an :class:`H2Context`). Every other path is forwarded
byte for byte to ``forward_to`` (a grpcio server, normally on a private unix socket) as a
generic stream-stream call: request messages, metadata and deadline go there; response
messages, initial and trailing metadata, status code and message come back. So unary,
client-, server- and bidi-streaming methods of any service (health, reflection, ...) keep
grpcio's behaviour exactly; only the registered methods take the fast path.

gRPC over HTTP/2 rules implemented (the gRPC project's PROTOCOL-HTTP2 document):

* Requests: ``:method`` must be POST (else HTTP 405), ``content-type`` ``application/grpc``
  or ``application/grpc+...`` (else HTTP 415); ``:path`` = ``/service/method``;
  ``grpc-timeout`` (``\\d{1,8}[HMSmun]``) sets the call's deadline (a malformed one ends
  the call INTERNAL, as grpc-go's server does); custom metadata are
  every other non-reserved header, ``-bin`` values base64 (padded or not) decoded.
* Messages: 1 byte compressed-flag + 4 bytes big-endian length + payload. Compressed
  requests are refused (UNIMPLEMENTED: no ``grpc-encoding`` is supported, and
  ``grpc-accept-encoding: identity`` is announced); a request longer than
  ``max_receive_message_bytes`` answers RESOURCE_EXHAUSTED.
* Responses: HEADERS (``:status 200``, ``content-type: application/grpc``) before the first
  message, then DATA, then trailers ``grpc-status`` and ``grpc-message`` (percent-encoded
  as the spec says: bytes outside 0x20-0x7E and ``%``). A call that ends before any
  message answers Trailers-Only (one HEADERS frame with END_STREAM).
* Cancellation: a client RST_STREAM, a lost connection or the server's stop cancel the
  handler (its ``finally`` blocks run). At the deadline the handler is cancelled and the
  call ends DEADLINE_EXCEEDED, or with RST_STREAM(CANCEL) when part of a message was
  already sent (a status after half a message would not parse).
* Flow control: DATA is sent only within the peer's stream and connection windows and in
  frames of at most its SETTINGS_MAX_FRAME_SIZE; WINDOW_UPDATE and SETTINGS resume
  sending. Each call buffers at most ``send_buffer_bytes`` of encoded messages: past that
  the handler waits (backpressure reaches the producer, nothing grows without bound); the
  socket's write buffer is bounded too (asyncio ``pause_writing``). Received DATA is
  acknowledged (WINDOW_UPDATE) only once the request reader took it.
* Connections: SETTINGS_MAX_CONCURRENT_STREAMS = ``max_concurrent_streams``; PING is
  answered (h2 does it); a protocol error closes the connection with GOAWAY. TLS comes
  from an ``ssl.SSLContext`` (see :func:`server_ssl_context`: ALPN ``h2``, optional client
  certificates, files re-read at a handshake after they changed).

Not implemented (not needed by its users): compression, server push, request streaming on
the fast path, per-message metadata beyond initial/trailing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import logging
import os
import re
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from .tls import ServerTLS, TLSFileError, file_stamp, read_ca_bundle, read_key_pair

log = logging.getLogger(__name__)

DEFAULT_MAX_CONCURRENT_STREAMS = 100
"""Streams one client connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS)."""
DEFAULT_SEND_BUFFER_BYTES = 256 * 1024
"""Encoded response bytes one call holds before its handler waits for the client."""
DEFAULT_MAX_RECEIVE_MESSAGE_BYTES = 4 * 1024 * 1024
"""Largest request message accepted (grpcio's default)."""
WRITE_BUFFER_HIGH_BYTES = 256 * 1024
"""A connection's socket write buffer past which its calls stop sending until it drains."""
MAX_FORWARD_TIMEOUT_S = 10.0**9
"""Longest timeout a forwarded call is given (~31.7 years). ``grpc-timeout`` allows up to
99,999,999 hours; grpcio keeps deadlines in int64 nanoseconds (~292 years) and ends a call
whose deadline overflows that at once with DEADLINE_EXCEEDED, so farther ones are capped."""

_PREFIX_LEN = 5
_CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HTTP1_REQUEST = re.compile(rb"^[A-Z]{3,10} ")
_HTTP1_BODY = b"cilia: this port serves gRPC (HTTP/2 only); use a gRPC client such as hubble\n"
_HTTP1_ANSWER = (
    b"HTTP/1.1 505 HTTP Version Not Supported\r\nContent-Type: text/plain\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(_HTTP1_BODY) + _HTTP1_BODY
)
_TIMEOUT = re.compile(r"^(\d{1,8})([HMSmun])$")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# Headers that are the transport's, never metadata (the gRPC HTTP/2 spec's reserved names).
_RESERVED = frozenset(
    {"content-type", "te", "user-agent", "grpc-timeout", "grpc-encoding",
     "grpc-accept-encoding", "grpc-message-type", "host", "connection"}
)  # fmt: skip


class AbortError(Exception):
    """Raised by :meth:`H2Context.abort`: ends the call with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def parse_timeout(value: str) -> float | None:
    """``grpc-timeout`` (``"100m"``, ``"5S"``) in seconds; None when malformed."""
    match = _TIMEOUT.match(value)
    if match is None:
        return None
    return int(match.group(1)) * _TIMEOUT_UNITS[match.group(2)]


def encode_grpc_message(text: str) -> bytes:
    """``grpc-message`` value: UTF-8, bytes outside 0x20-0x7E and ``%`` as ``%XX``."""
    out = bytearray()
    for byte in text.encode("utf-8"):
        if 0x20 <= byte <= 0x7E and byte != 0x25:
            out.append(byte)
        else:
            out += b"%%%02X" % byte
    return bytes(out)


def _metadata_value(key: str, value: bytes) -> str | bytes:
    if key.endswith("-bin"):
        return base64.b64decode(value + b"=" * (-len(value) % 4))
    return value.decode("latin-1")


def _header_value(key: str, value: str | bytes) -> bytes:
    if key.endswith("-bin"):
        raw = value if isinstance(value, bytes) else value.encode()
        return base64.b64encode(raw).rstrip(b"=")
    return value if isinstance(value, bytes) else value.encode("latin-1")


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
class _Method:
    handler: StreamHandler
    deserializer: Callable[[bytes], Any]
    serializer: Callable[[Any], bytes]


class _Reset(Exception):
    """The call ends with RST_STREAM(CANCEL) instead of a status."""


class _Call:
    """One HTTP/2 stream carrying one gRPC call."""

    def __init__(self, conn: _Connection, stream_id: int, headers: dict[str, bytes]) -> None:
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
            if name.startswith(":") or name in _RESERVED:
                continue
            if for_forwarding and name.startswith("grpc-"):
                continue
            try:
                out.append((name, _metadata_value(name, value)))
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
            while len(buf) >= _PREFIX_LEN:
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
                if len(buf) < _PREFIX_LEN + length:
                    break
                yield bytes(buf[_PREFIX_LEN : _PREFIX_LEN + length])
                del buf[: _PREFIX_LEN + length]
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
        headers += [(k.encode(), _header_value(k, v)) for k, v in metadata]
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
        trailers += [(k.encode(), _header_value(k, v)) for k, v in trailing]
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

    async def _serve(self, method: _Method) -> None:
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


class _H2Connection(h2.connection.H2Connection):
    """h2's server connection, except for a HEADERS frame that opens one stream more than
    our SETTINGS_MAX_CONCURRENT_STREAMS: RFC 9113 section 5.1.2 makes that a stream error
    (PROTOCOL_ERROR or REFUSED_STREAM), but h2 4.x raises TooManyStreamsError, a connection
    error (GOAWAY), which failed every other call of the connection. Such a frame is taken
    as usual (its header block must still pass the connection's HPACK decoder) and its
    stream id put in :attr:`refused`; the server resets it with REFUSED_STREAM.

    Attributes:
        refused: ids of streams opened past the limit, not answered yet.
    """

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config=config)
        self.refused: set[int] = set()
        self._admitting = False

    @property
    def open_inbound_streams(self) -> int:
        """h2's count of open inbound streams (0 while an over-limit stream is taken)."""
        count = super().open_inbound_streams
        return 0 if self._admitting else count

    def _receive_headers_frame(self, frame: Any) -> Any:
        if (
            frame.stream_id not in self.streams
            and self.open_inbound_streams + 1 > self.local_settings.max_concurrent_streams
        ):
            self.refused.add(frame.stream_id)
            self._admitting = True
            try:
                return super()._receive_headers_frame(frame)
            finally:
                self._admitting = False
        return super()._receive_headers_frame(frame)


class _Connection(asyncio.Protocol):
    """One client connection: the h2 state machine and its calls."""

    def __init__(self, server: GrpcH2Server) -> None:
        self.server = server
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.h2 = _H2Connection(config=config)
        self.calls: dict[int, _Call] = {}
        self.raw_headers: dict[int, list[tuple[bytes, bytes]]] = {}
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.peer = "unknown"
        self.greeted = False  # the client's first bytes were seen (and were not HTTP/1)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH_BYTES)
        self.peer = _peer_name(transport)
        self.server.connections.add(self)
        self.h2.update_settings(
            {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.server.max_concurrent_streams}
        )
        self.h2.initiate_connection()  # sent with the first answer: see data_received

    def write(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def acknowledge(self, stream_id: int, length: int) -> None:
        if length and self.transport is not None and not self.transport.is_closing():
            with contextlib.suppress(h2.exceptions.H2Error):
                self.h2.acknowledge_received_data(length, stream_id)
                self.write()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        for call in list(self.calls.values()):
            if call.out:
                call.schedule_flush()

    def data_received(self, data: bytes) -> None:
        if not self.greeted:
            # Our SETTINGS wait for the client's first bytes, so an HTTP/1.x client (curl,
            # a browser, a probe) gets a readable 505 instead of a binary frame and a close.
            self.greeted = True
            if not _CLIENT_PREFACE.startswith(data[: len(_CLIENT_PREFACE)]) and (
                _HTTP1_REQUEST.match(data)
            ):
                log.info("HTTP/1 request on the gRPC port: 505", extra={"peer": self.peer})
                if self.transport is not None:
                    self.transport.write(_HTTP1_ANSWER)
                    self.transport.close()
                return
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.info("HTTP/2 protocol error: closing", extra={"peer": self.peer, "error": str(exc)})
            self.write()
            if self.transport is not None:
                self.transport.close()
            return
        for event in events:
            self._event(event)
        self.write()

    def _event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._request(event)
        elif isinstance(event, h2.events.DataReceived):
            call = self.calls.get(event.stream_id)
            if call is None:
                self.acknowledge(event.stream_id, event.flow_controlled_length)
            else:
                call.inbox.put_nowait((event.data, event.flow_controlled_length))
        elif isinstance(event, h2.events.StreamEnded):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.inbox.put_nowait(None)
        elif isinstance(event, h2.events.StreamReset):
            call = self.calls.pop(event.stream_id, None)
            if call is not None:
                call.closed = True
                if call.task is not None:
                    call.task.cancel()
        elif isinstance(event, h2.events.WindowUpdated):
            targets = (
                self.calls.values() if event.stream_id == 0 else [self.calls.get(event.stream_id)]
            )
            for call in list(targets):
                if call is not None and call.out:
                    call.schedule_flush()
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            for call in list(self.calls.values()):
                if call.out:
                    call.schedule_flush()

    def _request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        raw = [(bytes(k), bytes(v)) for k, v in event.headers or ()]
        headers = {k.decode("latin-1"): v for k, v in raw}
        if self.server.stopping or sid in self.h2.refused:
            self.h2.refused.discard(sid)
            self.h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if headers.get(":method") != b"POST":
            self.h2.send_headers(sid, [(b":status", b"405")], end_stream=True)
            return
        if not headers.get("content-type", b"").startswith(b"application/grpc"):
            self.h2.send_headers(sid, [(b":status", b"415")], end_stream=True)
            return
        self.raw_headers[sid] = raw
        call = _Call(self, sid, headers)
        self.calls[sid] = call
        call.task = asyncio.get_running_loop().create_task(self._run(call))
        if event.stream_ended is not None:
            call.inbox.put_nowait(None)

    async def _run(self, call: _Call) -> None:
        try:
            await call.run()
        finally:
            self.raw_headers.pop(call.id, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            call.closed = True
            call.wake()
            if call.task is not None:
                call.task.cancel()
        self.calls.clear()

    def close(self) -> None:
        """GOAWAY and close (calls still running are cancelled by ``connection_lost``)."""
        with contextlib.suppress(h2.exceptions.H2Error):
            self.h2.close_connection()
            self.write()
        if self.transport is not None:
            self.transport.close()


def _bound_socket(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)``; IPv6 ones take IPv4 too (V6ONLY off).

    Raises:
        OSError: it cannot be made or bound.
    """
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _peer_name(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        return f"unix:{peer or ''}"
    if isinstance(peer, tuple) and len(peer) >= 2:
        if sock is not None and sock.family == socket.AF_INET6:
            return f"ipv6:[{peer[0]}]:{peer[1]}"
        return f"ipv4:{peer[0]}:{peer[1]}"
    return "unknown"


class GrpcH2Server:
    """The server (see the module docstring).

    Args:
        forward_to: gRPC target (``unix:/path``, ``host:port``) every path without a
            registered method is forwarded to; None answers those UNIMPLEMENTED.
        ssl_context: TLS for every listener (:func:`server_ssl_context`); None: plaintext.
        max_concurrent_streams: :data:`DEFAULT_MAX_CONCURRENT_STREAMS`.
        send_buffer_bytes: per call, :data:`DEFAULT_SEND_BUFFER_BYTES`.
        max_receive_message_bytes: :data:`DEFAULT_MAX_RECEIVE_MESSAGE_BYTES`.
        socket_mode: permissions of a unix-socket listener (root-only by default).
    """

    def __init__(
        self,
        *,
        forward_to: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_concurrent_streams: int = DEFAULT_MAX_CONCURRENT_STREAMS,
        send_buffer_bytes: int = DEFAULT_SEND_BUFFER_BYTES,
        max_receive_message_bytes: int = DEFAULT_MAX_RECEIVE_MESSAGE_BYTES,
        socket_mode: int = 0o600,
    ) -> None:
        if max_concurrent_streams < 1 or send_buffer_bytes < 1 or max_receive_message_bytes < 1:
            raise ValueError("h2 gRPC server limits must be >= 1")
        self.forward_to = forward_to
        self.ssl_context = ssl_context
        self.max_concurrent_streams = max_concurrent_streams
        self.send_buffer_bytes = send_buffer_bytes
        self.max_receive_message_bytes = max_receive_message_bytes
        self.socket_mode = socket_mode
        self.methods: dict[str, _Method] = {}
        self.connections: set[_Connection] = set()
        self.stopping = False
        self._servers: list[asyncio.Server] = []
        self._channel: grpc.aio.Channel | None = None

    def add_unary_stream(
        self,
        path: str,
        handler: StreamHandler,
        request_deserializer: Callable[[bytes], Any],
        response_serializer: Callable[[Any], bytes],
    ) -> None:
        """Serve ``path`` (``/package.Service/Method``) on the fast path."""
        self.methods[path] = _Method(handler, request_deserializer, response_serializer)

    def channel(self) -> grpc.aio.Channel:
        """The channel to ``forward_to`` (made at first use)."""
        if self._channel is None:
            assert self.forward_to is not None
            self._channel = grpc.aio.insecure_channel(self.forward_to)
        return self._channel

    async def start(self, address: str) -> str:
        """Listen on ``host:port`` (``[::]:0`` / ``0.0.0.0:0`` pick a port; ``[::]`` takes
        IPv4 too) or ``unix:/path`` and return the bound address (``host:port`` with the
        port bound, or the ``unix:`` address).

        Raises:
            OSError: the address cannot be bound.
            ValueError: the address is not host:port or unix:/path.
        """
        loop = asyncio.get_running_loop()
        if address.startswith("unix:"):
            path = address[len("unix:") :]
            if os.path.exists(path):
                os.unlink(path)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            server = await loop.create_unix_server(
                lambda: _Connection(self), path, ssl=self.ssl_context
            )
            os.chmod(path, self.socket_mode)
            self._servers.append(server)
            return address
        host, _, port_text = address.rpartition(":")
        if not host or not port_text.isdigit():
            raise ValueError(f"{address!r} is not host:port or unix:/path")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            sock = _bound_socket(family, host, int(port_text))
        except OSError as exc:
            if host != "::" or exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
            # a host without IPv6: all interfaces means all IPv4 ones (as grpcio does)
            family, host = socket.AF_INET, "0.0.0.0"
            sock = _bound_socket(family, host, int(port_text))
        server = await loop.create_server(
            lambda: _Connection(self), sock=sock, ssl=self.ssl_context
        )
        self._servers.append(server)
        bound = sock.getsockname()[1]
        return f"[{host}]:{bound}" if family == socket.AF_INET6 else f"{host}:{bound}"

    async def stop(self, grace: float | None) -> None:
        """Stop accepting, refuse new calls, give running ones ``grace`` seconds (None:
        none), then close every connection (cancelling what still runs)."""
        self.stopping = True
        for server in self._servers:
            server.close()
        if grace:
            deadline = time.monotonic() + grace
            while any(c.calls for c in self.connections) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        tasks = [call.task for c in self.connections for call in c.calls.values() if call.task]
        for conn in list(self.connections):
            conn.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._servers = []
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def _context(tls: ServerTLS) -> ssl.SSLContext:
    cert_pem, key_pem = read_key_pair(tls.cert_file, tls.key_file)  # checked to match
    del cert_pem, key_pem
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise TLSFileError(tls.cert_file, str(exc)) from None
    if tls.client_ca_files:
        ctx.load_verify_locations(cadata=read_ca_bundle(tls.client_ca_files).decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ReloadingSSLContext:
    """A server ``ssl.SSLContext`` whose files are re-read at a handshake after they changed
    (mtime, size or inode), like :class:`cilia_common.tls.CertificateReloader` for grpcio:
    a pair that does not load is not taken (the previous one stays; logged).

    Attributes:
        context: the context to listen with (its SNI callback swaps in the new one).
        reloads: how many times changed files were taken.
    """

    def __init__(self, tls: ServerTLS) -> None:
        self.tls = tls
        self._paths = (tls.cert_file, tls.key_file, *tls.client_ca_files)
        self._stamp = file_stamp(self._paths)
        self.context = _context(tls)
        self._current = self.context
        self.reloads = 0
        self.context.sni_callback = self._on_hello

    def _on_hello(
        self, sslobj: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext
    ) -> None:
        stamp = file_stamp(self._paths)
        if stamp != self._stamp:
            try:
                fresh = _context(self.tls)
            except (TLSFileError, ssl.SSLError) as exc:
                log.warning("TLS files changed but cannot be used", extra={"error": str(exc)})
            else:
                self._stamp, self._current = stamp, fresh
                self.reloads += 1
                log.info("TLS certificate reloaded", extra={"cert_file": self.tls.cert_file})
        if self._current is not self.context:
            sslobj.context = self._current


def server_ssl_context(tls: ServerTLS) -> ReloadingSSLContext:
    """TLS for :class:`GrpcH2Server`: ALPN ``h2``, TLS >= 1.2, the certificate pair of
    ``tls``, client certificates required and verified against ``tls.client_ca_files`` when
    given; renewed files are taken at the next handshake.

    Raises:
        TLSFileError: a file is unusable at start-up.
    """
    return ReloadingSSLContext(tls)
