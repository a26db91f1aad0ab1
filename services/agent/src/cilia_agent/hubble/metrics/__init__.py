"""Hubble's metrics (upstream ``pkg/hubble/metrics``) and the datapath's packet counters.

Two registries, two endpoints, as upstream:

- the Hubble metrics registry (:attr:`HubbleMetrics.flow_registry`), served on
  ``--hubble-metrics-server`` (upstream's port 9965): the ``hubble_*`` counters of the
  handlers enabled with ``--hubble-metrics`` (:mod:`.handlers`, grammar in :mod:`.api`).
  Nothing is counted and nothing served when no handler is enabled (upstream's default:
  ``--hubble-metrics`` empty). Beside the handlers' counters, and whatever handlers are
  enabled, the registry holds ``hubble_lost_events_total{source}`` (upstream
  ``pkg/hubble/metrics.LostEvents``; exported from the first loss on): events lost on the
  way to Hubble, ``source`` the
  lower-cased ``flow.LostEventSource`` name — ``perf_event_ring_buffer`` (the datapath
  could not write the event) and ``observer_events_queue`` (the agent's hand-off queue
  was full) add the events lost; ``hubble_ring_buffer`` adds 1 per LostEvent a follower
  overtaken by the flow ring receives, as upstream counts it.
- the agent's registry (``--prometheus-serve-addr``, 9962): ``cilium_drop_count_total``
  and friends read from the datapath's per-CPU map (:mod:`.datapath`).

Order of operations per flow: the Hubble reader decodes a record into a ``flow.Flow``,
puts it in the ring, then calls :meth:`HubbleMetrics.flow_processed`, which hands the flow
to each enabled handler in the order they were given. A handler that raises (a bug) is
logged once and skipped for that flow; the others still count it (as upstream's
``Handlers.ProcessFlow``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from cilia.hubble.flow import flow_pb2
from cilia_agent.hubble.metrics.api import (
    HANDLER_NAMES,
    HandlerSpec,
    MetricsConfigError,
    parse_metrics,
)
from cilia_agent.hubble.metrics.datapath import (
    DROP_REASON_TEXT,
    CounterReading,
    DatapathCounters,
    direction_text,
    drop_reason_text,
    read_counters,
)
from cilia_agent.hubble.metrics.handlers import HANDLERS, Handler

__all__ = [
    "DROP_REASON_TEXT",
    "HANDLER_NAMES",
    "CounterReading",
    "HandlerSpec",
    "HubbleMetrics",
    "MetricsConfigError",
    "direction_text",
    "drop_reason_text",
    "parse_metrics",
    "read_counters",
]

log = logging.getLogger(__name__)


class _LostEventsCollector(Collector):
    """``hubble_lost_events_total{source}`` from a plain dict (no ``*_created`` series, as
    the handlers' counters). A source appears at its first loss (upstream creates the
    ``perf_event_ring_buffer`` and ``observer_events_queue`` series at 0 up front); with no
    loss at all the family is not exported."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        if not self.counts:
            return
        family = CounterMetricFamily(
            "hubble_lost_events", "Number of lost events", labels=["source"]
        )
        for source, count in sorted(self.counts.items()):
            try:
                name = flow_pb2.LostEventSource.Name(source).lower()
            except ValueError:
                name = str(source)
            family.add_metric([name], count)
        yield family


class HubbleMetrics:
    """The enabled Hubble metric handlers and the datapath counters.

    Args:
        registry: the agent's registry, for the datapath counters (default:
            prometheus_client's global REGISTRY; tests pass a fresh one).
        handlers: the handlers to enable (:func:`parse_metrics` of ``--hubble-metrics``).
        flow_registry: where the handlers' counters go (default: a fresh registry, served
            by the caller on ``--hubble-metrics-server``).

    Raises:
        MetricsConfigError: a handler spec names an unknown handler or bad option (specs
            from :func:`parse_metrics` are already checked).
    """

    def __init__(
        self,
        registry: CollectorRegistry = REGISTRY,
        *,
        handlers: Sequence[HandlerSpec] = (),
        flow_registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = registry
        self.flow_registry = flow_registry if flow_registry is not None else CollectorRegistry()
        built: list[Handler] = []
        contexts: dict[Any, Any] = {}
        for spec in handlers:
            cls = HANDLERS.get(spec.name)
            if cls is None:
                raise MetricsConfigError(f"unknown handler {spec.name!r}")
            built.append(cls(spec, self.flow_registry, contexts))
        self.handlers: tuple[Handler, ...] = tuple(built)
        self._process = tuple(h.process for h in built)
        self._failed: set[str] = set()
        self._datapath = DatapathCounters(registry)
        self._lost = _LostEventsCollector()
        self.flow_registry.register(self._lost)

    def events_lost(self, source: int, count: int) -> None:
        """Add ``count`` (>= 0) to ``hubble_lost_events_total`` of a ``flow.LostEventSource``
        (an unknown number is labelled with the number)."""
        counts = self._lost.counts
        counts[source] = counts.get(source, 0) + count

    @property
    def enabled(self) -> bool:
        """True when at least one handler counts flows (then the server is worth starting)."""
        return bool(self.handlers)

    def flow_processed(self, flow: flow_pb2.Flow) -> None:
        """Hand one decoded flow to every enabled handler (no-op with none).

        Handlers must not read ``time`` or ``uuid``: the reader passes the flow shape's
        template with the event's ports (:meth:`~cilia_agent.hubble.parser.FlowShape.with_ports`),
        one object for every event of a shape."""
        if not self._process:
            return
        # read once here what most handlers need (each protobuf field read costs)
        etype = flow.event_type.type
        verdict = flow.verdict
        l4 = flow.l4.WhichOneof("protocol")
        for process in self._process:
            try:
                process(flow, etype, verdict, l4)
            except Exception:  # a handler bug must not stop the reader or the others
                name = getattr(process, "__qualname__", repr(process))
                if name not in self._failed:
                    self._failed.add(name)
                    log.exception("Hubble metric handler %s failed; flow not counted", name)

    def update_datapath_counters(self, readings: Iterable[CounterReading]) -> None:
        """Replace the exported datapath counters with a fresh read of ``cilia_metrics``
        (see :meth:`.datapath.DatapathCounters.update`)."""
        self._datapath.update(readings)

    def close(self) -> None:
        """Unregister everything (agent shutdown, tests)."""
        for handler in self.handlers:
            handler.close()
        self._datapath.close()
        with contextlib.suppress(KeyError):  # already closed
            self.flow_registry.unregister(self._lost)
