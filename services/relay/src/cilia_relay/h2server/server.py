"""The relay's HTTP/2 gRPC server: listeners (TCP and unix), method registration, the
grpcio channel that forwarded calls go through, start and stop."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import grpc

from .call import Method, StreamHandler
from .connection import Connection
from .wire import (
    DEFAULT_MAX_CONCURRENT_STREAMS,
    DEFAULT_MAX_RECEIVE_MESSAGE_BYTES,
    DEFAULT_SEND_BUFFER_BYTES,
)


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
        self.methods: dict[str, Method] = {}
        self.connections: set[Connection] = set()
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
        self.methods[path] = Method(handler, request_deserializer, response_serializer)

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
                lambda: Connection(self), path, ssl=self.ssl_context
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
        server = await loop.create_server(lambda: Connection(self), sock=sock, ssl=self.ssl_context)
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
