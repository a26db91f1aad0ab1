"""The kernel's conntrack failure counters as metrics: how a NAT port shortage shows up in
the iptables masquerade mode.

When ``MASQUERADE`` finds no free source port for a new connection (every port towards one
destination address:port taken), the kernel cannot confirm the connection's conntrack entry:
it counts ``insert_failed`` and ``drop`` in ``/proc/net/stat/nf_conntrack`` (one line of hex
counters per CPU, per network namespace) and drops the packet. :class:`NfConntrackStats` sums
the CPUs at every scrape and exposes:

- ``cilia_nf_conntrack_insert_failed_total``
- ``cilia_nf_conntrack_drop_total``
- ``cilia_nf_conntrack_early_drop_total`` (entries evicted because the table was full)

as counters (no upstream twin: upstream reports its BPF SNAT failures as drops with reason
``NO_MAPPING_FOR_NAT_MASQUERADE``, 167). They count every conntrack failure of the node's
namespace, not only masquerade's.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

STAT_PATH = pathlib.Path("/proc/net/stat/nf_conntrack")
#: column of /proc/net/stat/nf_conntrack -> (metric name without _total, help)
COLUMNS = {
    "insert_failed": (
        "cilia_nf_conntrack_insert_failed",
        "new conntrack entries the kernel could not insert (a NAT port clash among them), "
        "summed over CPUs, from /proc/net/stat/nf_conntrack",
    ),
    "drop": (
        "cilia_nf_conntrack_drop",
        "packets the kernel dropped because their conntrack entry failed, summed over CPUs",
    ),
    "early_drop": (
        "cilia_nf_conntrack_early_drop",
        "conntrack entries evicted early because the table was full, summed over CPUs",
    ),
}


def parse(text: str) -> dict[str, int]:
    """Sum the per-CPU hex columns of ``/proc/net/stat/nf_conntrack`` text by column name.

    Raises:
        ValueError: no header line, or a value that is not hex.
    """
    lines = [line.split() for line in text.splitlines() if line.strip()]
    if not lines or lines[0][0] != "entries":
        raise ValueError("not /proc/net/stat/nf_conntrack: no 'entries' header")
    header, rows = lines[0], lines[1:]
    totals = dict.fromkeys(header, 0)
    for row in rows:
        for name, value in zip(header, row, strict=False):
            totals[name] += int(value, 16)
    return totals


class NfConntrackStats(Collector):
    """Prometheus collector of :data:`COLUMNS` (read at every scrape; a missing file, no
    conntrack module loaded, yields nothing).

    Args:
        path: the stat file (tests give their own).
    """

    def __init__(self, path: pathlib.Path = STAT_PATH) -> None:
        self.path = path

    def collect(self) -> Iterator[CounterMetricFamily]:
        try:
            totals = parse(self.path.read_text())
        except (OSError, ValueError):
            return
        for column, (name, doc) in COLUMNS.items():
            if column in totals:
                yield CounterMetricFamily(name, doc, value=totals[column])
