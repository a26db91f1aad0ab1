"""One open page's live map: a ``GetFlows --follow`` stream into a :class:`FlowGraph`, and
the events the page gets from it.

Order of operations (:meth:`LiveView.events`): start the pump (one GetFlows call with the
page's whitelist, ``number`` = the buffer size, ``follow``), send a first ``graph`` event at
once (possibly empty), then every ``update_interval``: a ``status`` event when the link's
state changed, a ``graph`` event when flows came, a ``ping`` comment after
:data:`KEEPALIVE_SECONDS` of silence. A lost or unreachable relay (:class:`RelayUnavailable`)
is retried after ``retry_timeout`` with a fresh graph (the relay re-sends the buffer, so
nothing is counted twice); a refused request (:class:`RelayRefused`, e.g. a filter the relay
cannot use) ends the events with one ``refused`` event.

Limits: the graph keeps ``flows_buffer`` flows; the table sends ``table_rows``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cilia_common.backoff import Backoff
from cilia_common.retry import run_watch
from cilia_hubble_ui.filters import PageFilter
from cilia_hubble_ui.graph import FlowGraph, summarize
from cilia_hubble_ui.metrics import Metrics
from cilia_hubble_ui.relay import RelayClient, RelayRefused, RelayUnavailable

log = logging.getLogger("cilia_hubble_ui")

KEEPALIVE_SECONDS = 15.0
"""Silence after which a ``ping`` is sent (keeps proxies from closing an idle stream)."""


@dataclass(frozen=True)
class LiveOptions:
    """Limits of one page (see :class:`cilia_hubble_ui.config.Config`).

    Attributes:
        flows_buffer: flows kept (and asked of the relay at start).
        table_rows: rows of the flow table sent.
        update_interval: seconds between updates.
        retry_timeout: seconds before a lost stream is reopened.
        snapshot_timeout: deadline in seconds of a one-off (non-follow) GetFlows.
    """

    flows_buffer: int
    table_rows: int
    update_interval: float
    retry_timeout: float
    snapshot_timeout: float = 10.0


class LiveView:
    """The live map of one page.

    Args:
        client: the relay client.
        page_filter: the page's validated filters.
        options: limits.
        metrics: counters to feed.
    """

    def __init__(
        self, client: RelayClient, page_filter: PageFilter, options: LiveOptions, metrics: Metrics
    ) -> None:
        self.client = client
        self.filter = page_filter
        self.options = options
        self.metrics = metrics
        self.graph = FlowGraph(options.flows_buffer)
        self.lost = 0
        self.status: dict[str, Any] = {"state": "connecting", "relay": client.address}
        self.error: RelayRefused | None = None
        self._dirty = True
        self._status_changed = True
        self._attempts = 0

    def _set_status(self, state: str, message: str = "") -> None:
        status = {"state": state, "relay": self.client.address}
        if message:
            status["message"] = message
        if status != self.status:
            self.status = status
            self._status_changed = True

    async def _pump(self) -> None:
        """Follow the relay's flows (:func:`cilia_common.retry.run_watch`): a lost stream is
        reopened after ``retry_timeout`` with a fresh graph; a refused request ends it."""
        try:
            await run_watch(
                "relay-flows",
                self._open,
                self._consume,
                Backoff.fixed(self.options.retry_timeout),
                logger=log,
                quiet=(RelayUnavailable,),
                fatal=(RelayRefused,),
            )
        except RelayRefused as exc:
            self.metrics.relay_errors.labels(exc.code).inc()
            self.error = exc
            self._set_status("error", str(exc))

    def _open(self) -> AsyncIterator[Any]:
        """One GetFlows attempt; after a loss, on a fresh graph (the relay re-sends the
        buffer, so nothing is counted twice)."""
        if self._attempts:
            self.graph = FlowGraph(self.options.flows_buffer)
            self.lost = 0
            self._dirty = True
        self._attempts += 1
        self._set_status("connecting")
        return self.client.flows(
            self.filter.whitelist, number=self.options.flows_buffer, follow=True
        )

    async def _consume(self, responses: AsyncIterable[Any]) -> bool:
        """Feed the graph until the stream ends or fails (both: RelayUnavailable)."""
        try:
            async for response in responses:
                self._set_status("live")
                kind = response.WhichOneof("response_types")
                if kind == "flow":
                    self.graph.add(summarize(response.flow))
                    self.metrics.flows_received.inc()
                    self._dirty = True
                elif kind == "lost_events":
                    self.lost += int(response.lost_events.num_events_lost)
                    self._dirty = True
            raise RelayUnavailable(self.client.address, "CANCELLED", "the relay ended the stream")
        except RelayUnavailable as exc:
            self.metrics.relay_errors.labels(exc.code).inc()
            self._set_status("unavailable", f"{exc}; retrying in {self.options.retry_timeout:g}s")
            raise

    def snapshot(self) -> dict[str, Any]:
        """The ``graph`` event's data: the graph's snapshot plus ``lost`` and ``filters``."""
        data = self.graph.snapshot(self.options.table_rows)
        data["lost"] = self.lost
        data["filters"] = {k: list(v) for k, v in self.filter.params.items()}
        return data

    async def events(
        self, alive: Callable[[], bool] = lambda: True
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield ``(event, data)`` pairs: ``graph``, ``status``, ``ping``, and a last
        ``refused`` (see the module docstring). Runs until the caller stops iterating or
        ``alive()`` turns false (checked every ``update_interval``: the page went away, so
        its relay stream is closed without waiting for a failed write)."""
        pump = asyncio.create_task(self._pump(), name="hubble-ui-pump")
        quiet_since = time.monotonic()
        try:
            while alive():
                sent = False
                if self._status_changed:
                    self._status_changed = False
                    yield "status", dict(self.status)
                    sent = True
                if self._dirty:
                    self._dirty = False
                    yield "graph", self.snapshot()
                    sent = True
                if self.error is not None:
                    yield "refused", {"code": self.error.code, "message": str(self.error)}
                    return
                now = time.monotonic()
                if sent:
                    quiet_since = now
                elif now - quiet_since >= KEEPALIVE_SECONDS:
                    quiet_since = now
                    yield "ping", {}
                await asyncio.sleep(self.options.update_interval)
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)
