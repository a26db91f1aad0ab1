"""The HTTP side: the page, its static files and its API (aiohttp).

Routes:

* ``GET /`` — the service map page. Its filters are the URL's query (:mod:`.filters`); a
  malformed one is answered ``400`` with the reason (an HTML page naming the parameter).
* ``GET /static/...`` — the page's script, style and the vendored graph library
  (cytoscape.js, copied into the package by ``scripts/setup.sh``): the page needs no network.
* ``GET /api/events?<filters>`` — server-sent events of one :class:`LiveView`: ``graph``
  (nodes, edges, namespaces, the flow table), ``status`` (the relay link), ``refused`` (the
  relay refused the filters; the stream ends). ``400`` on malformed filters, ``503`` when
  ``--max-clients`` pages are open.
* ``GET /api/graph?<filters>`` — one snapshot as JSON (the last ``--flows-buffer`` flows,
  no follow), ``400`` on malformed filters or when the relay refuses them, ``502`` when the
  relay cannot be reached.
* ``GET /healthz`` — ``200 {"status": "ok"}`` while serving.

Errors are JSON ``{"error": "..."}`` on ``/api/*``. A bad request never affects other
pages: each page has its own stream and view.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import pathlib
from typing import Any

from aiohttp import web

from cilia_hubble_ui import __version__
from cilia_hubble_ui.filters import FilterError, PageFilter, parse_filters
from cilia_hubble_ui.graph import FlowGraph, summarize
from cilia_hubble_ui.live import LiveOptions, LiveView
from cilia_hubble_ui.metrics import Metrics
from cilia_hubble_ui.relay import RelayClient, RelayRefused, RelayUnavailable

log = logging.getLogger("cilia_hubble_ui")

STATIC_DIR = pathlib.Path(__file__).with_name("static")
VENDOR_FILES = ("vendor/cytoscape.min.js",)
"""Files ``scripts/setup.sh`` vendors from npm into ``static/``; the page needs them."""

_CLIENT = web.AppKey("client", RelayClient)
_OPTIONS = web.AppKey("options", LiveOptions)
_METRICS = web.AppKey("metrics", Metrics)
_MAX_CLIENTS = web.AppKey("max_clients", int)
_STREAMS: web.AppKey[set[asyncio.Task[Any]]] = web.AppKey("streams")


class MissingAsset(RuntimeError):
    """A vendored static file is missing (``scripts/setup.sh`` writes it)."""


def check_static(static_dir: pathlib.Path = STATIC_DIR) -> None:
    """Raise :class:`MissingAsset` naming the first missing page file."""
    for name in ("index.html", "app.js", "style.css", *VENDOR_FILES):
        if not (static_dir / name).is_file():
            raise MissingAsset(
                f"{static_dir / name} is missing (scripts/setup.sh vendors the page's "
                "libraries from npm; a wheel built before that lacks them)"
            )


def _page_filter(request: web.Request) -> PageFilter:
    return parse_filters(request.query.items())


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def index(request: web.Request) -> web.StreamResponse:
    """``GET /``: the page, or ``400`` naming the malformed filter."""
    try:
        _page_filter(request)
    except FilterError as exc:
        body = (
            "<!doctype html><meta charset=utf-8><title>Bad filter</title>"
            f"<h1>400 Bad filter</h1><p id=error>{html.escape(str(exc))}</p>"
            '<p><a href="/">Clear the filters</a></p>'
        )
        return web.Response(status=400, text=body, content_type="text/html")
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``."""
    return web.json_response({"status": "ok", "version": __version__})


async def graph(request: web.Request) -> web.Response:
    """``GET /api/graph``: one snapshot of the last ``--flows-buffer`` flows."""
    try:
        page_filter = _page_filter(request)
    except FilterError as exc:
        return _json_error(400, str(exc))
    options = request.app[_OPTIONS]
    view = FlowGraph(options.flows_buffer)
    try:
        async for response in request.app[_CLIENT].flows(
            page_filter.whitelist,
            number=options.flows_buffer,
            follow=False,
            timeout=options.snapshot_timeout,
        ):
            if response.WhichOneof("response_types") == "flow":
                view.add(summarize(response.flow))
    except RelayRefused as exc:
        return _json_error(400, str(exc))
    except RelayUnavailable as exc:
        return _json_error(502, str(exc))
    return web.json_response(view.snapshot(options.table_rows))


def _sse(event: str, data: dict[str, Any]) -> bytes:
    if event == "ping":
        return b": ping\n\n"
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def events(request: web.Request) -> web.StreamResponse:
    """``GET /api/events``: the page's live stream (see the module docstring)."""
    try:
        page_filter = _page_filter(request)
    except FilterError as exc:
        return _json_error(400, str(exc))
    app = request.app
    metrics = app[_METRICS]
    streams: set[asyncio.Task[Any]] = app[_STREAMS]
    if len(streams) >= app[_MAX_CLIENTS]:
        metrics.clients_refused.inc()
        return _json_error(
            503, f"{app[_MAX_CLIENTS]} pages are open (--max-clients); try again later"
        )
    task = asyncio.current_task()
    assert task is not None
    streams.add(task)
    metrics.clients.inc()
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-store",
            "X-Accel-Buffering": "no",
        }
    )
    try:
        await response.prepare(request)
        view = LiveView(app[_CLIENT], page_filter, app[_OPTIONS], metrics)
        transport = request.transport

        def alive() -> bool:
            return transport is not None and not transport.is_closing()

        async for event, data in view.events(alive):
            await response.write(_sse(event, data))
    except (ConnectionResetError, asyncio.CancelledError):
        pass  # the page went away, or the server is stopping
    finally:
        streams.discard(task)
        metrics.clients.dec()
    return response


async def _close_streams(app: web.Application) -> None:
    streams = app[_STREAMS]
    for task in [*streams]:
        task.cancel()


def make_app(
    client: RelayClient, options: LiveOptions, *, max_clients: int, metrics: Metrics
) -> web.Application:
    """The aiohttp application.

    Args:
        client: the relay client every page uses.
        options: per-page limits.
        max_clients: pages followed at once (``/api/events`` beyond: 503).
        metrics: the metric families.
    """
    app = web.Application()
    app[_CLIENT] = client
    app[_OPTIONS] = options
    app[_METRICS] = metrics
    app[_MAX_CLIENTS] = max_clients
    app[_STREAMS] = set[asyncio.Task[Any]]()
    app.router.add_get("/", index)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/api/graph", graph)
    app.router.add_get("/api/events", events)
    app.router.add_static("/static", STATIC_DIR)
    app.on_shutdown.append(_close_streams)
    return app
