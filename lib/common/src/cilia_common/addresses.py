"""One address grammar for every Cilia command line.

Listen and dial addresses are written as Go services write them: ``host:port``,
``[v6]:port``, ``:port`` (all interfaces, Go's ``net.Listen`` form) or ``unix:/path`` (gRPC's
name for a unix socket). Port 0 asks the kernel for a free port (the service then announces
the bound one, :func:`cilia_common.runtime.announce_listening`).

As pydantic field types: :data:`Address` (TCP or unix socket) and :data:`TCPAddress`
(TCP only, empty = disabled, e.g. a metrics endpoint).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

__all__ = [
    "UNIX_PREFIX",
    "Address",
    "TCPAddress",
    "dial_target",
    "grpc_listen_target",
    "is_address",
    "split_host_port",
]

UNIX_PREFIX = "unix:"


def split_host_port(address: str, *, flag: str = "") -> tuple[str, int]:
    """``"127.0.0.1:9963"`` / ``":9963"`` / ``"[::1]:9963"`` -> ``(host, port)``.

    An empty host (``":9963"``, Go's "all interfaces") is returned as ``""``.

    Raises:
        ValueError: ``"--flag: 'x' is not [HOST]:PORT"`` -- no colon, or the port is not
            0..65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        prefix = f"{flag}: " if flag else ""
        raise ValueError(f"{prefix}{address!r} is not [HOST]:PORT")
    return host.strip("[]"), int(port)


def is_address(value: str, *, unix: bool = True) -> bool:
    """Whether ``value`` is ``[host]:port`` (port 0..65535) or, with ``unix``,
    ``unix:/path`` with a non-empty path."""
    if value.startswith(UNIX_PREFIX):
        return unix and len(value) > len(UNIX_PREFIX)
    try:
        split_host_port(value)
    except ValueError:
        return False
    return True


def grpc_listen_target(address: str) -> str:
    """A listen address as grpc's ``add_insecure_port`` takes it: Go's ``:PORT`` (all
    interfaces) becomes ``[::]:PORT``; ``host:port`` and ``unix:/path`` are unchanged."""
    return f"[::]{address}" if address.startswith(":") else address


def dial_target(address: str) -> str:
    """An address as a gRPC dial target: ``:PORT`` becomes ``localhost:PORT``;
    ``host:port`` and ``unix:/path`` are unchanged."""
    return f"localhost{address}" if address.startswith(":") else address


def _address(value: str) -> str:
    if not is_address(value):
        raise ValueError(f"{value!r} is not host:port, :port or unix:/path")
    return value


def _tcp_or_empty(value: str) -> str:
    if value and not is_address(value, unix=False):
        raise ValueError(f"{value!r} is not [host]:port")
    return value


Address = Annotated[str, AfterValidator(_address)]
"""``host:port``, ``:port`` or ``unix:/path``."""

TCPAddress = Annotated[str, AfterValidator(_tcp_or_empty)]
"""``[host]:port`` or ``:port``; "" (disabled) is allowed."""
