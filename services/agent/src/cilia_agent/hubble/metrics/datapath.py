"""The datapath's packet counters, with upstream names (served on the agent's own metrics
endpoint, ``--prometheus-serve-addr``, not on Hubble's).

- ``cilium_drop_count_total{reason,direction}`` / ``cilium_drop_bytes_total{reason,direction}``
  and ``cilium_forward_count_total{direction}`` / ``cilium_forward_bytes_total{direction}``:
  the datapath's per-CPU counters (``cilia_metrics`` map), summed over CPUs, exported
  as-is at scrape time (upstream ``pkg/metrics`` datapath collector). ``reason`` is the
  upstream text ("Policy denied" for 133, "Policy denied by denylist" for 181),
  ``direction`` is "INGRESS"/"EGRESS".

The collector lives in the registry passed to :class:`DatapathCounters`, so tests and
several agents in one process do not clash.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from cilia_agent.datapath import layout

# Upstream drop reason texts (pkg/monitor/api/drop.go) for the codes Cilia emits.
DROP_REASON_TEXT: dict[int, str] = layout.DROP_REASON_TEXT

_DIRECTION_TEXT = {layout.DIR_INGRESS: "INGRESS", layout.DIR_EGRESS: "EGRESS"}


def drop_reason_text(reason: int) -> str:
    """Upstream text of a drop reason code; unknown codes as "Unknown reason (N)"."""
    return DROP_REASON_TEXT.get(reason, f"Unknown reason ({reason})")


def direction_text(direction: int) -> str:
    """ "INGRESS" for 0, "EGRESS" for 1, "UNKNOWN" otherwise (struct metrics_key.dir)."""
    return _DIRECTION_TEXT.get(direction, "UNKNOWN")


@dataclass(frozen=True, slots=True)
class CounterReading:
    """One entry of the ``cilia_metrics`` per-CPU map.

    Attributes:
        reason: ``metrics_key.reason`` (0 = forwarded, else a drop reason).
        direction: ``metrics_key.dir`` (0 ingress, 1 egress).
        packets: per-CPU packet counts (any iterable of ints; summed).
        bytes: per-CPU byte counts (summed).
    """

    reason: int
    direction: int
    packets: Iterable[int]
    bytes: Iterable[int]


class _DatapathCollector(Collector):
    def __init__(self) -> None:
        self.forward: dict[str, tuple[int, int]] = {}
        self.drop: dict[tuple[str, str], tuple[int, int]] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        drop_count = CounterMetricFamily(
            "cilium_drop_count", "Total dropped packets", labels=["reason", "direction"]
        )
        drop_bytes = CounterMetricFamily(
            "cilium_drop_bytes", "Total dropped bytes", labels=["reason", "direction"]
        )
        fwd_count = CounterMetricFamily(
            "cilium_forward_count", "Total forwarded packets", labels=["direction"]
        )
        fwd_bytes = CounterMetricFamily(
            "cilium_forward_bytes", "Total forwarded bytes", labels=["direction"]
        )
        for (reason, direction), (packets, nbytes) in sorted(self.drop.items()):
            drop_count.add_metric([reason, direction], packets)
            drop_bytes.add_metric([reason, direction], nbytes)
        for direction, (packets, nbytes) in sorted(self.forward.items()):
            fwd_count.add_metric([direction], packets)
            fwd_bytes.add_metric([direction], nbytes)
        yield drop_count
        yield drop_bytes
        yield fwd_count
        yield fwd_bytes


class DatapathCounters:
    """The ``cilium_drop_*`` / ``cilium_forward_*`` counters registered in ``registry``.

    Args:
        registry: the agent's registry (its ``--prometheus-serve-addr`` endpoint).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._collector = _DatapathCollector()
        registry.register(self._collector)

    def update(self, readings: Iterable[CounterReading]) -> None:
        """Replace the exported counters with a fresh read of ``cilia_metrics``.

        Call it with every entry of the map (e.g. on a timer or before a scrape). Values
        are the map's cumulative counters: they are exported as-is, not added.
        Readings with the same labels (e.g. reason codes sharing a text) are summed.
        """
        forward: dict[str, tuple[int, int]] = {}
        drop: dict[tuple[str, str], tuple[int, int]] = {}
        for r in readings:
            packets, nbytes = sum(r.packets), sum(r.bytes)
            direction = direction_text(r.direction)
            if r.reason == 0:
                p, b = forward.get(direction, (0, 0))
                forward[direction] = (p + packets, b + nbytes)
            else:
                key = (drop_reason_text(r.reason), direction)
                p, b = drop.get(key, (0, 0))
                drop[key] = (p + packets, b + nbytes)
        self._collector.forward = forward
        self._collector.drop = drop

    def close(self) -> None:
        """Unregister the collector (agent shutdown, tests)."""
        self.registry.unregister(self._collector)


class CountersMap(Protocol):
    """The per-CPU ``cilia_metrics`` map (``Datapath.metrics_map``): ``items()`` yields
    (key with ``reason``/``dir``, per-CPU values with ``packets``/``bytes``)."""

    def items(self) -> Iterable[tuple[Any, Iterable[Any]]]: ...


def read_counters(table: CountersMap) -> list[CounterReading]:
    """Read every entry of the per-CPU ``cilia_metrics`` map.

    Returns one :class:`CounterReading` per (reason, direction) key, with per-CPU
    values, ready for :meth:`DatapathCounters.update`.
    """
    readings: list[CounterReading] = []
    for key, per_cpu in table.items():
        values = list(per_cpu)
        readings.append(
            CounterReading(
                reason=int(key.reason),
                direction=int(key.dir),
                packets=[int(v.packets) for v in values],
                bytes=[int(v.bytes) for v in values],
            )
        )
    return readings
