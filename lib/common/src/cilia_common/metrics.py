"""One way to serve Prometheus metrics over HTTP for every Cilia service.

``start_metrics_server("127.0.0.1:0", registry, flag="--prometheus-serve-addr")`` binds,
serves ``/metrics`` from a daemon thread (prometheus_client's own WSGI server) and reports
the address it bound, so a test or the test kit can use port 0 and read the port back.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

from .addresses import split_host_port
from .grpcserver import BindError

__all__ = ["MetricsServer", "split_host_port", "start_metrics_server"]


class MetricsServer:
    """A running metrics endpoint (``GET /metrics``); create with :func:`start_metrics_server`.

    Attributes:
        address: the bound ``host:port`` (``"127.0.0.1:41234"``; ``"0.0.0.0:9963"`` for
            ``":9963"``), the real port when 0 was asked for.
        port: the bound TCP port.
    """

    def __init__(self, httpd: Any, thread: threading.Thread, host: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.port: int = int(httpd.server_port)
        shown = f"[{host}]" if ":" in host else host
        self.address = f"{shown}:{self.port}"

    def close(self) -> None:
        """Stop serving and release the port; waits up to 5 s for the thread. Idempotent."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
        self._httpd = None


def start_metrics_server(address: str, registry: CollectorRegistry, *, flag: str) -> MetricsServer:
    """Serve ``registry`` on ``address`` (``host:port``, ``:port`` = all IPv4 interfaces,
    port 0 = any free port) from a daemon thread.

    Args:
        address: listen address, as the service's ``--prometheus-serve-addr`` flag.
        registry: what ``/metrics`` exposes.
        flag: the flag the address came from, named in errors.

    Returns:
        the running :class:`MetricsServer`; ``.address`` is the bound ``host:port``.

    Raises:
        BindError: ``"--flag: cannot listen on ADDR: <reason>"`` -- malformed address,
            address in use, no permission.
    """
    try:
        host, port = split_host_port(address)
    except ValueError as exc:
        raise BindError(f"{flag}: {exc}") from None
    host = host or "0.0.0.0"
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise BindError(f"{flag}: cannot listen on {address}: {exc}") from exc
    return MetricsServer(httpd, thread, host)
