"""The gRPC-over-HTTP/2 wire rules of the relay's HTTP/2 server: its limits, the
``grpc-timeout`` and ``grpc-message`` encodings, metadata headers and the error a handler
raises to end a call with a status (the gRPC project's PROTOCOL-HTTP2 document)."""

from __future__ import annotations

import base64
import re

import grpc

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

PREFIX_LEN = 5
CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP1_REQUEST = re.compile(rb"^[A-Z]{3,10} ")
HTTP1_BODY = b"cilia: this port serves gRPC (HTTP/2 only); use a gRPC client such as hubble\n"
HTTP1_ANSWER = (
    b"HTTP/1.1 505 HTTP Version Not Supported\r\nContent-Type: text/plain\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(HTTP1_BODY) + HTTP1_BODY
)
_TIMEOUT = re.compile(r"^(\d{1,8})([HMSmun])$")
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
# Headers that are the transport's, never metadata (the gRPC HTTP/2 spec's reserved names).
RESERVED_HEADERS = frozenset(
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


def metadata_value(key: str, value: bytes) -> str | bytes:
    if key.endswith("-bin"):
        return base64.b64decode(value + b"=" * (-len(value) % 4))
    return value.decode("latin-1")


def header_value(key: str, value: str | bytes) -> bytes:
    if key.endswith("-bin"):
        raw = value if isinstance(value, bytes) else value.encode()
        return base64.b64encode(raw).rstrip(b"=")
    return value if isinstance(value, bytes) else value.encode("latin-1")
