"""Garbage collection of the conntrack map ``cilia_ct``, with upstream's timeouts and interval.

The datapath stamps every entry with the time of its last packet (``last_seen_ns``,
CLOCK_MONOTONIC) and records the TCP flags seen either way and whether a reply passed. It
never deletes the entry of a closed connection: the LRU map evicts only when full, and a SYN
on a closed tuple reopens the entry. The collector deletes entries idle for longer than
their state's timeout (upstream's flags and defaults):

==================================  =======  ====================================
state of the entry                  timeout  flag
==================================  =======  ====================================
TCP, FIN seen both ways, or an RST  10 s     ``--bpf-ct-timeout-regular-tcp-fin``
TCP, no reply yet                   60 s     ``--bpf-ct-timeout-regular-tcp-syn``
TCP, established (or half-closed)   6 h      ``--bpf-ct-timeout-regular-tcp``
any other protocol                  60 s     ``--bpf-ct-timeout-regular-any``
==================================  =======  ====================================

Upstream's datapath writes a lifetime into each entry on every packet; here the same rule is
applied by the collector from ``last_seen_ns`` and the flags the datapath keeps (the TCP
flags of both ways, whether a reply passed, which ways sent FIN), so the per-packet path
writes nothing more. A half-closed connection (FIN one way) keeps the established timeout:
deleting its entry would make the other side's next packet a new flow in the reverse
direction, which ingress policy may drop.

Interval (upstream's dynamic rule): ``--conntrack-gc-interval`` when > 0. Otherwise the first
pass runs at start and the interval starts at 5 min; after each pass, with ``ratio`` =
deleted / the map's size (``--bpf-ct-global-max``): above 0.25 the interval is multiplied by
``1 - ratio`` (ratio capped at 0.9), never below 10 s; above 0 and below 0.05 it is
multiplied by 1.5; otherwise (nothing deleted, or 5-25 %) it is kept. It never exceeds
``--conntrack-gc-max-interval`` (0 = 12 h, upstream's bound for LRU maps, also the most it
may be set to), the starting 5 min included.

Metrics (upstream's names and labels; ``family`` ``ipv4``, ``protocol`` ``TCP`` or
``non-TCP``): ``cilium_datapath_conntrack_gc_runs_total{status=completed|uncompleted}``,
``cilium_datapath_conntrack_gc_entries{status=alive|deleted}`` (of the last pass) and
``cilium_datapath_conntrack_gc_duration_seconds{status}``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Protocol

from cilia_agent.config import Config
from cilia_agent.datapath.layout import CT_REPLY_SEEN, CT_RX_FIN, CT_TX_FIN, CtKey, CtValue
from cilia_agent.datapath.libbpf import LibbpfError
from cilia_agent.metrics import Metrics

log = logging.getLogger(__name__)

IPPROTO_TCP = 6
TH_RST = 0x04  # TCP header byte 13 (bpf/lib/common.h TH_RST)
PROTOCOLS = ("TCP", "non-TCP")
#: Upstream's defaults for the dynamic interval (seconds).
STARTING_INTERVAL = 300.0
MIN_INTERVAL = 10.0
MAX_LRU_INTERVAL = 12 * 3600.0


class CtMap(Protocol):
    """What the collector needs of ``cilia_ct``
    (:class:`~cilia_agent.datapath.libbpf.PinnedMap`)."""

    def batch_items(self) -> Iterator[tuple[CtKey, CtValue]]:
        """Every (key, value), read in batches."""

    def lookup(self, key: CtKey) -> CtValue | None:
        """The value of ``key``, or None."""

    def delete(self, key: CtKey) -> bool:
        """Delete ``key``; False when it was absent."""


@dataclass(frozen=True)
class Timeouts:
    """Idle time after which an entry is deleted, per state (seconds, > 0; upstream's
    ``--bpf-ct-timeout-regular-*`` defaults)."""

    regular_tcp: float = 21600.0
    regular_tcp_fin: float = 10.0
    regular_tcp_syn: float = 60.0
    regular_any: float = 60.0

    def of(self, key: CtKey, value: CtValue) -> float:
        """The timeout (s) of the entry ``key``/``value`` in its present state."""
        now = state(key, value)
        if now == "established":
            return self.regular_tcp
        if now == "closing":
            return self.regular_tcp_fin
        if now == "opening":
            return self.regular_tcp_syn
        return self.regular_any


def state(key: CtKey, value: CtValue) -> str:
    """The entry's state as the timeouts see it: ``closing`` (TCP: FIN seen both ways, or an
    RST), ``opening`` (TCP, no reply yet), ``established`` (TCP, a half-closed connection
    included) or ``other`` (any other protocol)."""
    if key.proto != IPPROTO_TCP:
        return "other"
    both_fin = CT_TX_FIN | CT_RX_FIN
    if value.tcp_flags_seen & TH_RST or value.ct_flags & both_fin == both_fin:
        return "closing"
    if not value.ct_flags & CT_REPLY_SEEN:
        return "opening"
    return "established"


def protocol_label(key: CtKey) -> str:
    """``TCP`` or ``non-TCP`` (the ``protocol`` label of upstream's GC metrics)."""
    return "TCP" if key.proto == IPPROTO_TCP else "non-TCP"


@dataclass
class Pass:
    """What one pass found: entries kept and deleted by protocol label, its duration (s),
    and whether it went through the whole map."""

    alive: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROTOCOLS, 0))
    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PROTOCOLS, 0))
    seconds: float = 0.0
    completed: bool = True


def collect(ct_map: CtMap, now_ns: int, timeouts: Timeouts) -> Pass:
    """Delete the entries of ``ct_map`` idle for longer than their timeout at ``now_ns``
    (CLOCK_MONOTONIC ns, the datapath's clock). Expired keys are gathered first and deleted
    after (deleting while iterating a BPF hash map restarts its iteration); each is read
    again just before its deletion, so an entry a packet refreshed meanwhile is kept. The map
    is read in batches (``BPF_MAP_LOOKUP_BATCH``, 4096 entries per syscall).

    Raises:
        LibbpfError: reading the map failed (the pass is incomplete).
    """
    started = time.perf_counter()
    result = Pass()
    expired: list[CtKey] = []
    for key, value in ct_map.batch_items():
        if now_ns - value.last_seen_ns > timeouts.of(key, value) * 1e9:
            expired.append(key)
        else:
            result.alive[protocol_label(key)] += 1
    for key in expired:
        label = protocol_label(key)
        again = ct_map.lookup(key)
        if again is None:
            continue  # gone meanwhile (evicted, or reopened and deleted by the datapath)
        if now_ns - again.last_seen_ns <= timeouts.of(key, again) * 1e9:
            result.alive[label] += 1
        elif ct_map.delete(key):
            result.deleted[label] += 1
    result.seconds = time.perf_counter() - started
    return result


def ceiling(max_interval: float) -> float:
    """The longest interval (s): ``max_interval``, 12 h when it is <= 0 or longer."""
    return min(max_interval, MAX_LRU_INTERVAL) if max_interval > 0 else MAX_LRU_INTERVAL


def next_interval(previous: float, ratio: float, max_interval: float) -> float:
    """Upstream's dynamic rule (module docstring): the interval (s, whole seconds) after a
    pass that deleted ``ratio`` of the map's size, ``previous`` being the one before it;
    never above :func:`ceiling` of ``max_interval``."""
    if ratio > 0.25:
        result = max(MIN_INTERVAL, round(previous * (1.0 - min(ratio, 0.9))))
    elif 0.0 < ratio < 0.05:
        result = round(previous * 1.5)
    else:
        result = previous
    return float(min(ceiling(max_interval), result))


class ConntrackGC:
    """Runs :func:`collect` over the datapath's ``cilia_ct`` on upstream's schedule.

    Args:
        ct_map: the pinned map (``Datapath.ct_map``).
        timeouts: per-state timeouts.
        max_entries: the map's size (``--bpf-ct-global-max``), the ratio's denominator.
        interval: ``--conntrack-gc-interval`` (s; 0 = dynamic).
        max_interval: ``--conntrack-gc-max-interval`` (s; 0 = 12 h).
        metrics: where passes are counted (None = not counted).
        executor: runs the blocking pass off the event loop (None = the loop's default).
        clock: CLOCK_MONOTONIC in ns (the datapath's clock).
    """

    def __init__(
        self,
        ct_map: CtMap,
        timeouts: Timeouts,
        *,
        max_entries: int,
        interval: float = 0.0,
        max_interval: float = 0.0,
        metrics: Metrics | None = None,
        executor: Executor | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.ct_map = ct_map
        self.timeouts = timeouts
        self.max_entries = max(1, max_entries)
        self.interval = interval
        self.max_interval = max_interval
        self.metrics = metrics
        self.executor = executor
        self.clock = clock
        self.next_wait = interval if interval > 0 else min(STARTING_INTERVAL, ceiling(max_interval))
        self.passes = 0

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        ct_map: CtMap,
        metrics: Metrics | None = None,
        executor: Executor | None = None,
    ) -> ConntrackGC:
        """The collector the agent's flags describe (``--bpf-ct-timeout-regular-*``,
        ``--conntrack-gc-interval``, ``--conntrack-gc-max-interval``)."""
        timeouts = Timeouts(
            regular_tcp=cfg.bpf_ct_timeout_regular_tcp,
            regular_tcp_fin=cfg.bpf_ct_timeout_regular_tcp_fin,
            regular_tcp_syn=cfg.bpf_ct_timeout_regular_tcp_syn,
            regular_any=cfg.bpf_ct_timeout_regular_any,
        )
        return cls(
            ct_map,
            timeouts,
            max_entries=cfg.bpf_ct_global_max,
            interval=cfg.conntrack_gc_interval,
            max_interval=cfg.conntrack_gc_max_interval,
            metrics=metrics,
            executor=executor,
        )

    def run_once(self) -> Pass:
        """One pass now (blocking); counts it in the metrics and sets :attr:`next_wait`."""
        try:
            result = collect(self.ct_map, self.clock(), self.timeouts)
        except LibbpfError as exc:
            log.warning("conntrack GC pass failed", extra={"error": str(exc)})
            result = Pass(completed=False)
        self.passes += 1
        if result.completed and self.interval <= 0:
            ratio = sum(result.deleted.values()) / self.max_entries
            self.next_wait = next_interval(self.next_wait, ratio, self.max_interval)
        self._count(result)
        log.debug(
            "conntrack GC pass",
            extra={
                "alive": sum(result.alive.values()),
                "deleted": sum(result.deleted.values()),
                "seconds": round(result.seconds, 3),
                "next_s": self.next_wait,
            },
        )
        return result

    def _count(self, result: Pass) -> None:
        if self.metrics is None:
            return
        status = "completed" if result.completed else "uncompleted"
        for proto in PROTOCOLS:
            labels = {"family": "ipv4", "protocol": proto}
            self.metrics.ct_gc_runs.labels(status=status, **labels).inc()
            self.metrics.ct_gc_duration.labels(status=status, **labels).observe(result.seconds)
            if result.completed:
                self.metrics.ct_gc_entries.labels(status="alive", **labels).set(result.alive[proto])
                self.metrics.ct_gc_entries.labels(status="deleted", **labels).set(
                    result.deleted[proto]
                )

    async def run(self) -> None:
        """A pass at once, then one every :attr:`next_wait` seconds, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await loop.run_in_executor(self.executor, self.run_once)
            await asyncio.sleep(self.next_wait)
