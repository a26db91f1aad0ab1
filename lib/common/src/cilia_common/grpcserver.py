"""gRPC server bootstrap shared by every Cilia service.

Every server also serves ``grpc.health.v1.Health`` and server reflection
(DESIGN.md §2). Unix-socket listeners are made root-only (mode 0600 by
default) right after binding (DESIGN.md §7).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .grpcinput import MalformedRequestGuard

UNIX_PREFIX = "unix:"


class BindError(RuntimeError):
    """A listen address could not be bound (in use, bad path, no permission)."""


@dataclass(frozen=True)
class Service:
    """One servicer to register.

    Attributes:
        add: the generated ``add_XServicer_to_server`` function.
        servicer: the implementation instance.
        full_name: fully-qualified service name (``cilia.agent.v1.AttachmentService``),
            advertised through reflection and health.
    """

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    full_name: str


def _prepare_unix(address: str) -> pathlib.Path:
    path = pathlib.Path(address[len(UNIX_PREFIX) :])
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket() or path.exists():
        path.unlink()
    return path


async def start_server(
    services: Sequence[Service],
    addresses: Iterable[str],
    *,
    socket_mode: int = 0o600,
    options: Sequence[tuple[str, Any]] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """Start an asyncio gRPC server with health and reflection.

    Args:
        services: servicers to register.
        addresses: listen addresses, ``unix:/path`` or ``host:port`` (port 0 picks one).
        socket_mode: permissions applied to unix sockets after bind.
        options: extra grpc channel options.

    Returns:
        ``(server, health_servicer)``; every service starts NOT_SERVING in health
        until :func:`set_serving` is called, so probes see readiness honestly.
        Use :func:`start_server_with_ports` to learn the ports bound for port 0.

    Raises:
        BindError: an address could not be bound.
    """
    server, health_servicer, _ = await start_server_with_ports(
        services, addresses, socket_mode=socket_mode, options=options
    )
    return server, health_servicer


async def start_server_with_ports(
    services: Sequence[Service],
    addresses: Iterable[str],
    *,
    socket_mode: int = 0o600,
    options: Sequence[tuple[str, Any]] = (),
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, dict[str, int]]:
    """Like :func:`start_server`, and also report the TCP ports actually bound.

    ``credentials`` (e.g. :func:`cilia_common.tls.server_credentials`) make every address a
    TLS port (None: plaintext); ``interceptors`` run before every handler, health and
    reflection included, after :class:`~cilia_common.grpcinput.MalformedRequestGuard`
    (request bytes that do not parse answer INVALID_ARGUMENT).

    Returns:
        ``(server, health_servicer, ports)`` where ``ports`` maps every TCP listen address
        as given (``"127.0.0.1:0"``) to the port bound for it (``41234``); unix-socket
        addresses are not in it. :func:`bound_port` turns an entry into ``host:port``.

    Raises:
        BindError: an address could not be bound.
    """
    # gRPC turns SO_REUSEPORT on by default: a second server on the same port
    # would start silently and split the clients between the two. Refuse instead.
    # unparsable request bytes: INVALID_ARGUMENT before any other interceptor (grpcinput)
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), *options],
        interceptors=[MalformedRequestGuard(), *interceptors],
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.full_name for s in services]
    for svc in services:
        svc.add(svc.servicer, server)
    reflection.enable_server_reflection(
        [
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    unix_paths: list[pathlib.Path] = []
    ports: dict[str, int] = {}
    for address in addresses:
        if address.startswith(UNIX_PREFIX):
            unix_paths.append(_prepare_unix(address))
        try:
            if credentials is not None:
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise BindError(f"cannot listen on {address}: {exc}") from exc
        if not address.startswith(UNIX_PREFIX):
            if port == 0:
                raise BindError(f"cannot listen on {address}: address in use or invalid")
            ports[address] = port
    await server.start()
    for path in unix_paths:
        os.chmod(path, socket_mode)
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer, ports


async def set_serving(
    health_servicer: health.aio.HealthServicer, names: Iterable[str], serving: bool = True
) -> None:
    """Flip the overall ("") and per-service health status."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ["", *names]:
        await health_servicer.set(name, status)


def bound_port(server_address: str, port: int) -> str:
    """Return ``host:port`` for a TCP address that was bound with port 0."""
    host = server_address.rsplit(":", 1)[0]
    return f"{host}:{port}"
