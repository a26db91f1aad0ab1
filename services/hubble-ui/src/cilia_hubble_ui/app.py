"""Wires the UI: relay client → aiohttp app → HTTP listener (+ optional metrics).

Start order: check the page's static files (the vendored graph library), dial the relay
(lazily: a relay that is down is retried per page, the page shows it), bind the HTTP
listener on ``--listen-address`` and log it once as ``"listening"`` (listener ``http``) with
the bound address (port 0 allowed), then the metrics endpoint (listener ``metrics``). Stop
order is the reverse: open pages' streams are ended first, so shutdown does not wait for them.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from cilia_common.addresses import split_host_port
from cilia_common.metrics import MetricsServer, start_metrics_server
from cilia_common.runtime import announce_listening, run_until_signal
from cilia_hubble_ui.config import Config
from cilia_hubble_ui.live import LiveOptions
from cilia_hubble_ui.metrics import Metrics
from cilia_hubble_ui.relay import RelayClient
from cilia_hubble_ui.web import check_static, make_app

log = logging.getLogger("cilia_hubble_ui")


class BindError(RuntimeError):
    """``--listen-address`` cannot be bound (message names the flag and the reason)."""


class _RequestHandler(RequestHandler):
    """aiohttp's connection handler, answering a request line or header line longer than
    its limit with 414 URI Too Long / 431 Request Header Fields Too Large and one plain
    line (aiohttp answers 400 with the Python repr of the line's first bytes and logs a
    traceback). Methods only (``__slots__ = ()``), so a handler aiohttp made can take this
    class (:class:`_Server`)."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if not isinstance(exc, LineTooLong):
            return super().handle_error(request, status, exc, message)
        line, limit = exc.args[0], exc.args[1]
        # the exception carries the line's first bytes: a request target is "/…" (origin
        # form, what browsers send) or "http://…" (absolute form); else it is a header line
        head = bytes(line[:8]) if isinstance(line, bytes | bytearray) else b""
        if head.startswith((b"/", b"http://", b"https://")):
            code = HTTPStatus.REQUEST_URI_TOO_LONG
            text = (f"the request line is longer than {limit} bytes "
                    "(--max-request-line-bytes): use fewer or shorter filters")  # fmt: skip
        else:
            code = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
            text = f"a request header line is longer than {limit} bytes"
        log.info("request refused", extra={"status": int(code), "reason": text})
        response = web.Response(status=code, text=f"{int(code)} {code.phrase}: {text}\n")
        response.force_close()
        return response


class _Server(web.Server):
    """aiohttp's server whose connections use :class:`_RequestHandler` (a subclass of the
    handler it makes, with no state of its own, so the class is swapped on the instance)."""

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = _RequestHandler
        return handler


class _AppRunner(web.AppRunner):
    """``web.AppRunner`` serving through :class:`_Server`."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _Server
        return server


class HubbleUI:
    """The running UI.

    Attributes (after :meth:`start`):
        address: the bound ``host:port`` of the page.
        metrics_address: the bound metrics ``host:port`` ("" when disabled).
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.client: RelayClient | None = None
        self._runner: web.AppRunner | None = None
        self._metrics_server: MetricsServer | None = None
        self.address = ""
        self.metrics_address = ""

    async def start(self) -> None:
        """Bring the UI up.

        Raises:
            cilia_hubble_ui.web.MissingAsset: a vendored page file is missing.
            cilia_common.tls.TLSFileError: a TLS file is unusable.
            BindError: the listen address cannot be bound.
        """
        check_static()
        config = self.config
        self.client = RelayClient(config.hubble_relay_address, config.relay_tls)
        app = make_app(
            self.client,
            LiveOptions(
                flows_buffer=config.flows_buffer,
                table_rows=config.table_rows,
                update_interval=config.update_interval,
                retry_timeout=config.retry_timeout,
                snapshot_timeout=config.snapshot_timeout,
            ),
            max_clients=config.max_clients,
            metrics=self.metrics,
        )
        self._runner = _AppRunner(
            app,
            shutdown_timeout=config.shutdown_grace_period,
            access_log=None,
            max_line_size=config.max_request_line_bytes,
        )
        await self._runner.setup()
        host, port = split_host_port(config.listen_address, flag="--listen-address")
        site = web.TCPSite(self._runner, host or None, port)
        try:
            await site.start()
        except OSError as exc:
            raise BindError(
                f"--listen-address: cannot listen on {config.listen_address}: {exc.strerror or exc}"
            ) from None
        bound = self._runner.addresses[0]
        shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.address = f"{shown}:{bound[1]}"
        announce_listening(log, "http", self.address)
        if config.prometheus_serve_addr:
            self._metrics_server = start_metrics_server(
                config.prometheus_serve_addr, self.metrics.registry, flag="--prometheus-serve-addr"
            )
            self.metrics_address = self._metrics_server.address
            announce_listening(log, "metrics", self.metrics_address)
        log.info(
            "relay",
            extra={"address": config.hubble_relay_address, "tls": config.relay_tls is not None},
        )

    async def stop(self) -> None:
        """Stop serving (copes with a partial start)."""
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.client is not None:
            await self.client.close()
            self.client = None


def run(config: Config) -> None:
    """Run until SIGTERM or SIGINT.

    Raises:
        the errors of :meth:`HubbleUI.start`.
    """
    ui = HubbleUI(config)
    asyncio.run(run_until_signal(ui.start, ui.stop))
