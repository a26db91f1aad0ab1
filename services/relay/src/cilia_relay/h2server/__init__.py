"""The relay's observer listener: a small gRPC server on the ``h2`` HTTP/2 library for server-streaming methods that send
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

The package, a module a job: :mod:`.wire` (limits, timeout and message encodings,
metadata), :mod:`.call` (one call on one stream), :mod:`.connection` (one client
connection), :mod:`.server` (listeners, registration, forwarding channel), :mod:`.tls`
(the reloading ``ssl.SSLContext``). It lives in the relay, its one user, so ``h2`` is
installed only there.

Not implemented (not needed by its users): compression, server push, request streaming on
the fast path, per-message metadata beyond initial/trailing.
"""

from .call import H2Context, StreamHandler
from .server import GrpcH2Server
from .tls import ReloadingSSLContext, server_ssl_context
from .wire import (
    DEFAULT_MAX_CONCURRENT_STREAMS,
    DEFAULT_MAX_RECEIVE_MESSAGE_BYTES,
    DEFAULT_SEND_BUFFER_BYTES,
    MAX_FORWARD_TIMEOUT_S,
    WRITE_BUFFER_HIGH_BYTES,
    AbortError,
    encode_grpc_message,
    parse_timeout,
)

__all__ = [
    "DEFAULT_MAX_CONCURRENT_STREAMS",
    "DEFAULT_MAX_RECEIVE_MESSAGE_BYTES",
    "DEFAULT_SEND_BUFFER_BYTES",
    "MAX_FORWARD_TIMEOUT_S",
    "WRITE_BUFFER_HIGH_BYTES",
    "AbortError",
    "GrpcH2Server",
    "H2Context",
    "ReloadingSSLContext",
    "StreamHandler",
    "encode_grpc_message",
    "parse_timeout",
    "server_ssl_context",
]
