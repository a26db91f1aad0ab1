"""A unary gRPC client over HTTP/2 on a unix socket, without grpcio: one connection, one
stream per call.

Why not grpcio: the plugin is exec'd once per pod operation, and ``import grpc`` costs
70-150 ms on an idle 2-core host (its extension imports asyncio, ``grpc/__init__`` imports
``grpc.aio``) — more than everything else in an ADD. Nor the python-hyper libraries
(``hyperframe`` for frames, ``hpack`` for header compression) it used before: with what
they import (``logging``, ``typing``, ``enum`` flags) they were about a third of an ADD
exec's imports. The code here is the client side of the connection sequence, the frames
it sends and reads (RFC 9113 §4.1 layout, §6 payloads), and gRPC's 5-byte message
framing; header blocks are :mod:`cilia_cni.hpack`'s. The agent side (grpcio's server) is
unchanged.

Specs followed:

- gRPC over HTTP/2 (grpc/grpc ``doc/PROTOCOL-HTTP2.md``): request headers ``:method POST``,
  ``:scheme http``, ``:path /<package.Service>/<Method>``, ``:authority``, ``te: trailers``,
  ``grpc-timeout`` (from the deadline, at most 8 digits), ``content-type:
  application/grpc``; one Length-Prefixed-Message (compressed flag 0, 4-byte big-endian
  length) in DATA frames, END_STREAM on the last; status from the Trailers, or from the
  Trailers-Only HEADERS; ``grpc-message`` percent-decoded (UTF-8, invalid escapes kept
  as-is); ``grpc-status-details-bin`` base64-decoded and kept for the caller; no ``grpc-status`` → INTERNAL; a non-200 ``:status`` → the HTTP-to-gRPC mapping
  (``doc/http-grpc-status-mapping.md``); RST_STREAM codes mapped as the document's table
  (CANCEL after the deadline → DEADLINE_EXCEEDED); early Trailers → RST_STREAM NO_ERROR;
  the deadline passing → RST_STREAM CANCEL and DEADLINE_EXCEEDED.
- HTTP/2, RFC 9113: client connection preface and SETTINGS (push disabled, initial stream
  window 2^31-1) plus a connection WINDOW_UPDATE to 2^31-1, so responses never wait for
  flow control; the peer's SETTINGS applied (MAX_FRAME_SIZE, INITIAL_WINDOW_SIZE,
  HEADER_TABLE_SIZE) and ACKed; PING answered with ACK; request DATA cut to the peer's
  MAX_FRAME_SIZE and its stream and connection windows (WINDOW_UPDATE awaited when they are
  spent); header blocks across HEADERS + CONTINUATION both ways; GOAWAY with a last stream
  id below ours → UNAVAILABLE (the call was not processed), else the call may still finish.

Errors are :class:`RpcError` with the gRPC status code; ``transport`` tells that nobody
answered (connect failed, connection closed, stream refused before processing).
"""

from __future__ import annotations

# _socket: the C module under ``socket``, with the same socket objects (connect, sendall,
# recv, settimeout; timeouts raise TimeoutError). ``socket.py`` on top converts constants to
# IntEnums and imports selectors: 6.4 ms more per plugin run on this host (best of 8,
# -X importtime), for nothing this client uses.
import _socket
import struct
import time

from cilia_cni.hpack import Decoder, HPACKError
from cilia_cni.hpack import encode as encode_headers

# gRPC status codes (grpc/grpc doc/statuscodes.md), index = numeric code.
STATUS_NAMES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
OK, CANCELLED, UNKNOWN = 0, 1, 2
DEADLINE_EXCEEDED = 4
PERMISSION_DENIED, RESOURCE_EXHAUSTED = 7, 8
UNIMPLEMENTED, INTERNAL, UNAVAILABLE, UNAUTHENTICATED = 12, 13, 14, 16

#: RFC 9113 §3.4 client connection preface.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
#: The one stream of a connection (client-initiated streams are odd).
STREAM_ID = 1
#: Largest flow-control window (RFC 9113 §6.9.1); advertised for the stream and connection.
MAX_WINDOW = 2**31 - 1
#: RFC 9113 §6.5.2 defaults until the peer's SETTINGS say otherwise.
DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME_SIZE = 16384
#: Default largest response message accepted, bytes (grpcio's max_receive_message_length).
MAX_RESPONSE_MESSAGE_BYTES = 4 * 1024 * 1024
#: Largest decoded header list (response headers or trailers), bytes (hpack's default).
MAX_HEADER_LIST_BYTES = 64 * 1024
#: Bytes asked of one recv(2).
RECV_BYTES = 256 * 1024
#: ``:authority`` of every call (what grpcio sends for a ``unix:`` target).
AUTHORITY = "localhost"
USER_AGENT = "grpc-python-cilia-cni/0.1 (h2 unary)"

# RFC 9113 §6 frame types, flags and the SETTINGS identifiers used here.
_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _SETTINGS, _PUSH_PROMISE = 0, 1, 2, 3, 4, 5
_PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 6, 7, 8, 9
_END_STREAM = _ACK = 0x1
_END_HEADERS, _PADDED, _PRIORITY_FLAG = 0x4, 0x8, 0x20
_SETTINGS_HEADER_TABLE_SIZE, _SETTINGS_ENABLE_PUSH = 1, 2
_SETTINGS_INITIAL_WINDOW_SIZE, _SETTINGS_MAX_FRAME_SIZE = 4, 5
#: Frame types that belong to a stream (stream id 0 is a PROTOCOL_ERROR) and those that
#: belong to the connection (a stream id is).
_STREAM_FRAMES = {_DATA, _HEADERS, _PRIORITY, _RST_STREAM, _PUSH_PROMISE, _CONTINUATION}
_CONNECTION_FRAMES = {_SETTINGS, _PING, _GOAWAY}
#: The 9-octet frame header (RFC 9113 §4.1): 24-bit length (as 16 + 8), type, flags,
#: reserved bit + 31-bit stream id.
_FRAME_HEADER = struct.Struct(">HBBBI")

# RFC 9113 §7 error codes used here.
_NO_ERROR, _PROTOCOL_ERROR, _REFUSED_STREAM, _CANCEL = 0, 1, 7, 8
_H2_ERRORS = (
    "NO_ERROR",
    "PROTOCOL_ERROR",
    "INTERNAL_ERROR",
    "FLOW_CONTROL_ERROR",
    "SETTINGS_TIMEOUT",
    "STREAM_CLOSED",
    "FRAME_SIZE_ERROR",
    "REFUSED_STREAM",
    "CANCEL",
    "COMPRESSION_ERROR",
    "CONNECT_ERROR",
    "ENHANCE_YOUR_CALM",
    "INADEQUATE_SECURITY",
    "HTTP_1_1_REQUIRED",
)
#: RST_STREAM error code → gRPC status (PROTOCOL-HTTP2.md "Errors"); others → INTERNAL.
_RST_TO_STATUS = {_REFUSED_STREAM: UNAVAILABLE, _CANCEL: CANCELLED, 11: RESOURCE_EXHAUSTED}
_RST_TO_STATUS[12] = PERMISSION_DENIED
#: HTTP status → gRPC status (grpc/grpc doc/http-grpc-status-mapping.md); others → UNKNOWN.
_HTTP_TO_STATUS = {
    400: INTERNAL,
    401: UNAUTHENTICATED,
    403: PERMISSION_DENIED,
    404: UNIMPLEMENTED,
    429: UNAVAILABLE,
    502: UNAVAILABLE,
    503: UNAVAILABLE,
    504: UNAVAILABLE,
}
_MESSAGE_PREFIX = struct.Struct(">BI")


class RpcError(Exception):
    """A call that did not end with status OK.

    Attributes:
        code: gRPC status code (0-16, :data:`STATUS_NAMES`).
        details: the status message (``grpc-message`` percent-decoded, or this client's
            own text for transport and protocol failures).
        transport: True when the agent never answered the call: the connection could not
            be made or closed before a status, or the stream was refused unprocessed.
        status_details: the ``grpc-status-details-bin`` trailer, base64-decoded: a serialized
            ``google.rpc.Status`` (the richer error model), b"" when absent or not base64.
            Decoding it is the caller's (:mod:`cilia_cni.agent`): protobuf's ``google.rpc``
            messages are imported only when an error carries details.
    """

    def __init__(
        self, code: int, details: str, transport: bool = False, status_details: bytes = b""
    ) -> None:
        super().__init__(f"{self.name_of(code)}: {details}")
        self.code = code
        self.details = details
        self.transport = transport
        self.status_details = status_details

    @property
    def name(self) -> str:
        """The status code's name, e.g. ``"UNAVAILABLE"``."""
        return self.name_of(self.code)

    @staticmethod
    def name_of(code: int) -> str:
        return STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "UNKNOWN"


class ResponseTooLarge(RpcError):
    """The response message exceeds ``max_response_bytes`` (INTERNAL; reading stopped)."""


class NotHttp2(RpcError):
    """The peer's first bytes are not an HTTP/2 SETTINGS frame (RFC 9113 §3.4: the server
    connection preface), e.g. an HTTP/1.1 server or anything else listening on the socket:
    UNAVAILABLE with ``transport`` (the agent never got the call)."""


def timeout_header(seconds: float) -> str:
    """The ``grpc-timeout`` value for ``seconds`` left: the finest unit whose value has at
    most 8 digits, rounded up (``0.5`` → ``"500000u"``, ``240`` → ``"240000m"``)."""
    for unit, scale in (("u", 1_000_000), ("m", 1000), ("S", 1), ("M", 1 / 60), ("H", 1 / 3600)):
        value = -int(-seconds * scale // 1)  # ceil without math
        if value < 100_000_000:
            return f"{max(value, 1)}{unit}"
    return "99999999H"


def percent_decode(value: bytes) -> str:
    """Decode a ``grpc-message`` (UTF-8, then percent-encoded; PROTOCOL-HTTP2.md): valid
    ``%XX`` escapes are decoded, broken ones kept as they are, bad UTF-8 replaced."""
    from urllib.parse import unquote  # only on the error path

    return unquote(value.decode("utf-8", "replace"), errors="replace")


def unary_call(
    socket_path: str,
    method: str,
    request: bytes,
    timeout: float,
    authority: str = AUTHORITY,
    max_response_bytes: int = MAX_RESPONSE_MESSAGE_BYTES,
) -> bytes:
    """Call the unary method ``method`` (``/package.Service/Method``) on the gRPC server at
    the unix socket ``socket_path`` with the serialized request message ``request``; return
    the serialized response message.

    ``timeout`` (seconds, > 0) bounds everything: connect, send, the agent's work, receive;
    it is sent as ``grpc-timeout``. A response message larger than ``max_response_bytes``
    fails the call (:class:`ResponseTooLarge`).

    Raises:
        RpcError: the call's status is not OK (DEADLINE_EXCEEDED when ``timeout`` passed;
            UNAVAILABLE with ``transport`` when the socket refuses, is missing or closes).
    """
    deadline = time.monotonic() + timeout
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
        except TimeoutError:
            raise RpcError(
                DEADLINE_EXCEEDED, f"connecting to unix:{socket_path} took longer than {timeout:g}s"
            ) from None
        except OSError as exc:
            raise RpcError(
                UNAVAILABLE,
                f"failed to connect to unix:{socket_path}: {exc.strerror or exc}",
                transport=True,
            ) from None
        call = _Call(sock, deadline, socket_path, max_response_bytes)
        return call.run(method, request, authority)
    finally:
        sock.close()


class FrameError(ValueError):
    """A received frame breaks RFC 9113 §4-§6 (the message says how)."""


def frame_bytes(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame's bytes (RFC 9113 §4.1)."""
    size = len(payload)
    return _FRAME_HEADER.pack(size >> 8, size & 0xFF, kind, flags, stream_id) + payload


class Frame:
    """A received frame: ``kind`` (type), ``flags``, ``stream_id`` and ``data``, the
    payload without padding and priority fields (DATA, HEADERS) or as sent (the others).

    Raises (:meth:`parse`): FrameError for a payload its type does not allow.
    """

    __slots__ = ("data", "flags", "kind", "stream_id")

    def __init__(self, kind: int, flags: int, stream_id: int, data: bytes) -> None:
        self.kind = kind
        self.flags = flags
        self.stream_id = stream_id
        self.data = data

    @classmethod
    def parse(cls, kind: int, flags: int, stream_id: int, payload: bytes) -> Frame:
        """Check ``payload`` against the frame type's rules (RFC 9113 §6) and strip padding."""
        if kind in _STREAM_FRAMES and stream_id == 0:
            raise FrameError(f"frame type {kind} on stream 0")
        if kind in _CONNECTION_FRAMES and stream_id != 0:
            raise FrameError(f"frame type {kind} on stream {stream_id}")
        size = len(payload)
        fixed = {_RST_STREAM: 4, _PING: 8, _WINDOW_UPDATE: 4, _PRIORITY: 5}.get(kind)
        if fixed is not None and size != fixed:
            raise FrameError(f"frame type {kind} of {size} bytes, not {fixed}")
        if kind in (_DATA, _HEADERS) and flags & _PADDED:
            if not size or payload[0] >= size:
                raise FrameError("padding exceeds the payload")
            payload = payload[1 : size - payload[0]]
        if kind == _HEADERS and flags & _PRIORITY_FLAG:
            if len(payload) < 5:
                raise FrameError("HEADERS too short for its priority fields")
            payload = payload[5:]
        if kind == _SETTINGS and (size % 6 or (flags & _ACK and size)):
            raise FrameError(f"SETTINGS of {size} bytes")
        if kind == _GOAWAY and size < 8:
            raise FrameError(f"GOAWAY of {size} bytes")
        if kind == _WINDOW_UPDATE and not int.from_bytes(payload, "big") & 0x7FFFFFFF:
            raise FrameError("WINDOW_UPDATE with a zero increment")
        return cls(kind, flags, stream_id, payload)

    def settings(self) -> dict[int, int]:
        """A SETTINGS frame's ``{identifier: value}``."""
        data = self.data
        return {
            int.from_bytes(data[i : i + 2], "big"): int.from_bytes(data[i + 2 : i + 6], "big")
            for i in range(0, len(data), 6)
        }

    def u31(self, offset: int = 0) -> int:
        """The 31-bit value at ``offset`` (window increment, GOAWAY last stream id)."""
        return int.from_bytes(self.data[offset : offset + 4], "big") & 0x7FFFFFFF

    def u32(self, offset: int = 0) -> int:
        """The 32-bit value at ``offset`` (an error code)."""
        return int.from_bytes(self.data[offset : offset + 4], "big")


def _rst_stream(error_code: int) -> bytes:
    return frame_bytes(_RST_STREAM, 0, STREAM_ID, error_code.to_bytes(4, "big"))


class _Call:
    """The client side of one HTTP/2 connection carrying stream 1 (RFC 9113 §5.1 states:
    idle → open → half-closed (local) → closed)."""

    def __init__(
        self, sock: _socket.socket, deadline: float, where: str, max_response_bytes: int
    ) -> None:
        self.sock = sock
        self.max_response_bytes = max_response_bytes
        self.deadline = deadline
        self.where = f"unix:{where}"
        self.buf = bytearray()
        self.decoder = Decoder(MAX_HEADER_LIST_BYTES)
        # What the peer lets us send (its SETTINGS and WINDOW_UPDATEs).
        self.max_frame = DEFAULT_MAX_FRAME_SIZE
        self.peer_initial_window = DEFAULT_WINDOW
        self.conn_window = DEFAULT_WINDOW
        self.stream_window = DEFAULT_WINDOW
        # The response.
        self.block = bytearray()  # header block being assembled (HEADERS + CONTINUATION)
        self.block_stream = 0
        self.block_end_stream = False
        self.headers: dict[bytes, bytes] | None = None
        self.trailers: dict[bytes, bytes] | None = None
        self.data = bytearray()
        self.ended = False  # END_STREAM received on stream 1
        self.send_closed = False  # the socket refused more writes
        self.goaway_last_stream: int | None = None
        self.got_preface = False  # the server's SETTINGS (its connection preface) arrived

    # -- sending --------------------------------------------------------------------------

    def run(self, method: str, request: bytes, authority: str) -> bytes:
        settings = frame_bytes(
            _SETTINGS,
            0,
            0,
            struct.pack(
                ">HIHI", _SETTINGS_ENABLE_PUSH, 0, _SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW
            ),
        )
        window = frame_bytes(_WINDOW_UPDATE, 0, 0, (MAX_WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._deadline_error()
        block = encode_headers(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", method),
                (":authority", authority),
                ("grpc-timeout", timeout_header(left)),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("user-agent", USER_AGENT),
            ]
        )
        self._send(PREFACE + settings + window + self._header_frames(block))
        self._send_message(_MESSAGE_PREFIX.pack(0, len(request)) + request)
        while not self.ended:
            self._handle(self._read_frame())
        return self._result()

    def _header_frames(self, block: bytes) -> bytes:
        """HEADERS (+ CONTINUATION) frames carrying ``block`` on stream 1 (RFC 9113 §6.10)."""
        size = self.max_frame
        parts = [block[i : i + size] for i in range(0, len(block), size)] or [b""]
        return b"".join(
            frame_bytes(
                _HEADERS if i == 0 else _CONTINUATION,
                _END_HEADERS if i == len(parts) - 1 else 0,
                STREAM_ID,
                part,
            )
            for i, part in enumerate(parts)
        )

    def _send_message(self, body: bytes) -> None:
        """DATA frames of ``body`` within the peer's frame size and windows, END_STREAM on
        the last; stops early when the response has already ended (early Trailers)."""
        offset = 0
        while offset < len(body):
            if self.ended or self.send_closed:
                if self.ended and not self.send_closed:  # PROTOCOL-HTTP2 "Early Server Closure"
                    self._send(_rst_stream(_NO_ERROR))
                return
            allowed = min(self.conn_window, self.stream_window, self.max_frame)
            if allowed <= 0:
                self._handle(self._read_frame())  # wait for WINDOW_UPDATE / SETTINGS
                continue
            chunk = body[offset : offset + allowed]
            offset += len(chunk)
            end = _END_STREAM if offset == len(body) else 0
            self._send(frame_bytes(_DATA, end, STREAM_ID, chunk))
            self.conn_window -= len(chunk)
            self.stream_window -= len(chunk)

    def _send(self, data: bytes) -> None:
        """Write ``data`` before the deadline. A peer that closed the connection is not an
        error yet: its answer may be waiting to be read (else reading reports the close)."""
        if self.send_closed:
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self._deadline_error()
        self.sock.settimeout(left)
        try:
            self.sock.sendall(data)
        except TimeoutError:
            raise self._deadline_error() from None
        except OSError:
            self.send_closed = True

    # -- receiving ------------------------------------------------------------------------

    def _recv_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self._deadline_error()
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(RECV_BYTES)
            except TimeoutError:
                raise self._deadline_error() from None
            except OSError as exc:
                raise self._closed_error(exc.strerror or str(exc)) from None
            if not chunk:
                raise self._closed_error("connection closed")
            self.buf += chunk
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def _read_frame(self) -> Frame:
        header = self._recv_exact(9)
        high, low, kind, flags, stream_id = _FRAME_HEADER.unpack(header)
        length = high << 8 | low
        if not self.got_preface:
            # RFC 9113 §3.4: the server's preface is a SETTINGS frame, first. Anything else
            # (b"HTTP/1.1 ", garbage) is not an HTTP/2 server: say so, not "frame too big".
            if kind != _SETTINGS or length > DEFAULT_MAX_FRAME_SIZE:
                raise self._not_http2(header)
            self.got_preface = True
        if length > DEFAULT_MAX_FRAME_SIZE:  # RFC 9113 §4.2: our advertised maximum
            raise self._protocol_error(f"frame of {length} bytes exceeds MAX_FRAME_SIZE")
        try:
            return Frame.parse(kind, flags, stream_id & 0x7FFFFFFF, self._recv_exact(length))
        except FrameError as exc:
            raise self._protocol_error(f"malformed frame: {exc}") from None

    def _not_http2(self, first: bytes) -> NotHttp2:
        return NotHttp2(
            UNAVAILABLE,
            f"the agent socket {self.where} does not speak HTTP/2 (gRPC): its first bytes "
            f"are {first!r}, not an HTTP/2 SETTINGS frame",
            transport=True,
        )

    def _handle(self, frame: Frame) -> None:
        """Apply one received frame to the connection and stream state (RFC 9113 §6)."""
        kind = frame.kind
        if self.block_stream and kind != _CONTINUATION:
            raise self._protocol_error("header block interrupted before END_HEADERS")
        if kind == _DATA:
            if frame.stream_id == STREAM_ID:
                if self.headers is None or self.ended:
                    raise self._protocol_error("DATA outside the response")
                self.data += frame.data
                if len(self.data) > self.max_response_bytes + _MESSAGE_PREFIX.size:
                    raise ResponseTooLarge(
                        INTERNAL,
                        f"the response from {self.where} is larger than "
                        f"{self.max_response_bytes} bytes",
                    )
                if frame.flags & _END_STREAM:
                    self.ended = True
        elif kind == _HEADERS:
            self.block = bytearray(frame.data)
            self.block_stream = frame.stream_id
            self.block_end_stream = bool(frame.flags & _END_STREAM)
            if frame.flags & _END_HEADERS:
                self._header_block()
        elif kind == _CONTINUATION:
            if frame.stream_id != self.block_stream or not self.block_stream:
                raise self._protocol_error("CONTINUATION without its HEADERS")
            self.block += frame.data
            if len(self.block) > MAX_HEADER_LIST_BYTES:
                raise self._protocol_error("header block too large")
            if frame.flags & _END_HEADERS:
                self._header_block()
        elif kind == _SETTINGS:
            if not frame.flags & _ACK:
                self._apply_settings(frame.settings())
                self._send(frame_bytes(_SETTINGS, _ACK, 0))
        elif kind == _PING:
            if not frame.flags & _ACK:
                self._send(frame_bytes(_PING, _ACK, 0, frame.data))
        elif kind == _WINDOW_UPDATE:
            if frame.stream_id == 0:
                self.conn_window += frame.u31()
            elif frame.stream_id == STREAM_ID:
                self.stream_window += frame.u31()
        elif kind == _RST_STREAM:
            if frame.stream_id == STREAM_ID:
                self._reset(frame.u32())
        elif kind == _GOAWAY:
            last_stream = frame.u31()
            self.goaway_last_stream = last_stream
            if last_stream < STREAM_ID:
                raise RpcError(
                    UNAVAILABLE,
                    f"{self.where} closed the connection before taking the call (GOAWAY "
                    f"{_h2_error(frame.u32(4))}{_debug(frame.data[8:])})",
                    transport=True,
                )
        elif kind == _PUSH_PROMISE:
            raise self._protocol_error("PUSH_PROMISE although SETTINGS_ENABLE_PUSH is 0")
        # PRIORITY, ALTSVC and extension frames are ignored (RFC 9113 §5.5).

    def _apply_settings(self, settings: dict[int, int]) -> None:
        for key, value in settings.items():
            if key == _SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise self._protocol_error("SETTINGS_INITIAL_WINDOW_SIZE above 2^31-1")
                self.stream_window += value - self.peer_initial_window  # §6.9.2
                self.peer_initial_window = value
            elif key == _SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_MAX_FRAME_SIZE <= value <= 2**24 - 1:
                    raise self._protocol_error(f"SETTINGS_MAX_FRAME_SIZE {value} out of range")
                self.max_frame = value
            # SETTINGS_HEADER_TABLE_SIZE needs nothing: our header block never indexes
            # (cilia_cni.hpack.encode), so the peer's dynamic table is never used.

    def _header_block(self) -> None:
        """Decode a complete header block; the first on stream 1 is the response headers
        (or Trailers-Only with END_STREAM), the second the Trailers."""
        stream, block, end = self.block_stream, bytes(self.block), self.block_end_stream
        self.block_stream = 0
        self.block = bytearray()
        try:
            fields = self.decoder.decode(block)  # always: keeps the HPACK state
        except HPACKError as exc:
            raise self._protocol_error(f"header block cannot be decoded: {exc}") from None
        if stream != STREAM_ID:
            return
        decoded = {bytes(k): bytes(v) for k, v in fields}
        if self.headers is None:
            if decoded.get(b":status", b"").startswith(b"1"):
                return  # 1xx informational (RFC 9113 §8.1)
            self.headers = decoded
            if end:
                self.trailers = decoded  # Trailers-Only
        elif not end:
            raise self._protocol_error("a second header block without END_STREAM")
        else:
            self.trailers = decoded
        if end:
            self.ended = True

    def _reset(self, error_code: int) -> None:
        code = _RST_TO_STATUS.get(error_code, INTERNAL)
        if code == CANCELLED and time.monotonic() >= self.deadline:
            code = DEADLINE_EXCEEDED  # PROTOCOL-HTTP2.md "Client Cancellation"
        raise RpcError(
            code,
            f"{self.where} reset the stream (RST_STREAM {_h2_error(error_code)})",
            transport=error_code == _REFUSED_STREAM,
        )

    # -- outcome --------------------------------------------------------------------------

    def _result(self) -> bytes:
        headers = self.headers or {}
        trailers = self.trailers or {}
        http_status = headers.get(b":status", b"")
        if http_status != b"200":
            code = _HTTP_TO_STATUS.get(int(http_status) if http_status.isdigit() else 0, UNKNOWN)
            raise RpcError(
                code, f"{self.where} answered HTTP status {http_status.decode('ascii', 'replace')}"
            )
        if not headers.get(b"content-type", b"").startswith(b"application/grpc"):
            raise RpcError(UNKNOWN, f"{self.where} answered a non-gRPC content-type")
        raw_status = trailers.get(b"grpc-status")
        if raw_status is None:
            raise RpcError(INTERNAL, f"{self.where} ended the call without grpc-status")
        code = int(raw_status) if raw_status.isdigit() else UNKNOWN
        if code != OK:
            message = trailers.get(b"grpc-message", b"")
            raise RpcError(
                code if code < len(STATUS_NAMES) else UNKNOWN,
                percent_decode(message),
                status_details=_binary_header(trailers.get(b"grpc-status-details-bin", b"")),
            )
        return self._message()

    def _message(self) -> bytes:
        """The one Length-Prefixed-Message of a unary response."""
        data = self.data
        if len(data) < _MESSAGE_PREFIX.size:
            raise RpcError(INTERNAL, f"{self.where} returned status OK without a message")
        compressed, length = _MESSAGE_PREFIX.unpack_from(data)
        if compressed:
            raise RpcError(INTERNAL, f"{self.where} sent a compressed message unasked")
        if len(data) != _MESSAGE_PREFIX.size + length:
            raise RpcError(
                INTERNAL, f"{self.where} sent {len(data)} bytes for one message of {length}"
            )
        return bytes(data[_MESSAGE_PREFIX.size :])

    def _deadline_error(self) -> RpcError:
        try:  # a client cancellation (PROTOCOL-HTTP2.md): best effort, never blocks
            self.sock.settimeout(0)
            self.sock.send(_rst_stream(_CANCEL))
        except OSError:
            pass
        return RpcError(DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _closed_error(self, why: str) -> RpcError:
        return RpcError(
            UNAVAILABLE, f"{self.where}: socket closed before the call ended ({why})", True
        )

    def _protocol_error(self, why: str) -> RpcError:
        try:  # RFC 9113 §5.4.1: a connection error is GOAWAY + close; best effort
            self.sock.settimeout(0)
            self.sock.send(
                frame_bytes(_GOAWAY, 0, 0, bytes(4) + _PROTOCOL_ERROR.to_bytes(4, "big"))
            )
        except OSError:
            pass
        return RpcError(INTERNAL, f"HTTP/2 protocol error from {self.where}: {why}")


def _binary_header(value: bytes) -> bytes:
    """A ``-bin`` header's value: base64, padded or not (PROTOCOL-HTTP2.md "Binary-Header");
    b"" when empty or not base64."""
    if not value:
        return b""
    import binascii  # C module, imported only when an error carries details

    try:
        return binascii.a2b_base64(value + b"=" * (-len(value) % 4), strict_mode=True)
    except binascii.Error:
        return b""


def _h2_error(code: int) -> str:
    return _H2_ERRORS[code] if 0 <= code < len(_H2_ERRORS) else f"0x{code:x}"


def _debug(data: bytes) -> str:
    return f": {data.decode('utf-8', 'replace')}" if data else ""
