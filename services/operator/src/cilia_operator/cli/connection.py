"""Reaching the operator from a client command: the server address, the channel (plaintext
or mutual TLS), the stubs, and the one-line error every command fails with."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_common.tls import (
    ClientTLS,
    TLSFileError,
    channel_credentials,
    channel_options,
)

EXIT_ERROR = 2


class CommandError(Exception):
    """A client command failed; the message is the one line shown to the user."""


SERVER_FORM = "HOST:PORT, [IPV6]:PORT, dns:[//AUTHORITY/]HOST:PORT or unix:PATH"
_HOSTNAME = re.compile(
    r"^[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.?$"
)


def check_server(server: str) -> str:
    """Return ``server`` when it is a gRPC target the operator can be reached at:
    ``HOST:PORT`` (hostname or IPv4), ``[IPV6]:PORT``, ``dns:[//AUTHORITY/]HOST:PORT``,
    ``unix:PATH`` / ``unix:///PATH`` or ``unix-abstract:NAME``; the port is 1..65535.

    Raises:
        CommandError: anything else (``--server garbage::``), so a typo is a usage error
            rather than an "operator unreachable".
    """
    problem = ""
    if server.startswith(("unix:", "unix-abstract:")):
        if not server.partition(":")[2].strip("/"):
            problem = "no socket path"
    else:
        target = server.removeprefix("dns:")
        if target != server and target.startswith("//"):
            target = target[2:].partition("/")[2]  # dns://AUTHORITY/HOST:PORT
        if target.startswith("["):
            host, _, rest = target[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                problem = f"{host!r} is not an IPv6 address"
        else:
            host, sep, port = target.rpartition(":")
            if not sep:
                host, port = target, ""
            if not host or not _HOSTNAME.match(host):
                problem = f"{host!r} is not a host name or IPv4 address" if host else "no host"
        if not problem and not (port.isdigit() and 1 <= int(port) <= 65535):
            problem = f"port {port!r} is not in 1..65535" if port else "no port"
    if problem:
        raise CommandError(f"--server: {server!r} is not an operator address ({problem}); "
                           f"expected {SERVER_FORM}")  # fmt: skip
    return server


def channel(server: str, tls: ClientTLS | None = None) -> grpc.Channel:
    """A channel to the operator at ``server``: mutual TLS with ``tls``'s files, else
    plaintext (an operator with TLS refuses it at the handshake).

    Raises:
        CommandError: a malformed address or an unusable TLS file.
    """
    target = check_server(server)
    if tls is None:
        return grpc.insecure_channel(target)
    try:
        credentials = channel_credentials(tls)
    except TLSFileError as exc:
        raise CommandError(f"TLS: {exc}") from None
    return grpc.secure_channel(target, credentials, options=channel_options(tls))


def resource_stub(server: str, tls: ClientTLS | None = None) -> Any:
    return pb_grpc.ResourceServiceStub(channel(server, tls))  # type: ignore[no-untyped-call]


def rpc_error(exc: Any, server: str) -> CommandError:
    """The one-line CommandError for a failed RPC."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CommandError(f"cannot reach operator at {server}: {exc.details()}")
    return CommandError(f"{code.name}: {exc.details()}")


def call(method: Any, request: Any, server: str, timeout: float) -> Any:
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as exc:
        raise rpc_error(exc, server) from None


def ipam_stub(server: str, tls: ClientTLS | None = None) -> Any:
    return pb_grpc.IPAMServiceStub(channel(server, tls))  # type: ignore[no-untyped-call]
