"""When this node last used each alias VIP: the report a ServiceCIDR migration waits for.

An alias is a Service's former ClusterIP kept after a ServiceCIDR migration
(``Service.alias_ips``); the socket load balancer serves it like the ClusterIP. To let
the operator release an alias nothing uses any more, ``bpf/bpf_sock.c`` stamps
``bpf_ktime_get_ns()`` (CLOCK_MONOTONIC) into the pinned hash map
:data:`ALIAS_USE_MAP` (key: the VIP, u32 in network order; value: u64 ns, 0 = not used
since the agent added it) on every ``connect()``/``sendmsg()`` to a VIP that has an entry.
Only aliases have entries, so other Services cost one failed lookup.

:class:`AliasUsage`:

* :meth:`set_service` (from the Service watcher, per Service event) keeps one entry per
  alias the node serves: new aliases get value 0, entries of aliases no Service has any
  more are deleted (a resync deletes those of Services its listing did not claim);
* :meth:`uses` reads the map: per alias, whether it was used and how many milliseconds
  ago, measured against CLOCK_MONOTONIC now (a duration: the operator turns it into a
  time on its own clock);
* :meth:`report_loop` calls ``report`` (a ``NodeService.ReportAliasUse`` carrying these
  uses; a ``Register`` with them to an older operator) every
  ``--alias-use-report-interval`` seconds while the node serves an alias, and once more
  after the last one went.

Not thread-safe: the watcher and the loop run on the agent's event loop.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import pathlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.layout import ip_from_map, ip_to_map
from cilia_agent.datapath.libbpf import LibbpfError, PinnedMap
from cilia_agent.loadbalancer.layout import ALIAS_USE_MAP

log = logging.getLogger(__name__)

DEFAULT_REPORT_INTERVAL = 5.0
"""``--alias-use-report-interval`` default (seconds)."""


class AliasUsage:
    """The alias entries of :data:`ALIAS_USE_MAP` and their report (module docstring).

    Args:
        pin_dir: ``--bpf-pin-dir``; map: an open map instead (tests).
        clock_ns: CLOCK_MONOTONIC in ns (the clock of ``bpf_ktime_get_ns``).

    Raises:
        LibbpfError: the map is not pinned (the socket-LB was built without it).
    """

    def __init__(
        self,
        pin_dir: pathlib.Path | None = None,
        *,
        map: Any = None,
        clock_ns: Callable[[], int] = lambda: time.clock_gettime_ns(time.CLOCK_MONOTONIC),
    ) -> None:
        if map is None:
            assert pin_dir is not None
            map = PinnedMap(pin_dir / ALIAS_USE_MAP, ctypes.c_uint32, ctypes.c_uint64)
        self.map = map
        self.clock_ns = clock_ns
        self.by_service: dict[str, set[str]] = {}
        self._claimed: set[str] | None = None
        self._reported_any = False

    def _serving(self) -> set[str]:
        return set().union(*self.by_service.values()) if self.by_service else set()

    def _sync(self, before: set[str]) -> None:
        after = self._serving()
        for ip in sorted(after - before):
            key = ctypes.c_uint32(ip_to_map(ip))
            if self.map.lookup(key) is None:
                self.map.update(key, ctypes.c_uint64(0))
        for ip in sorted(before - after):
            self.map.delete(ctypes.c_uint32(ip_to_map(ip)))

    def set_service(self, name: str, alias_ips: Iterable[str]) -> None:
        """Service ``name`` (``namespace/name``) now has ``alias_ips`` (empty: none or
        deleted). Map failures are logged (the report then lacks that alias)."""
        before = self._serving()
        ips = {ip for ip in alias_ips if ip}
        if ips:
            self.by_service[name] = ips
        else:
            self.by_service.pop(name, None)
        if self._claimed is not None:
            self._claimed.add(name)
        try:
            self._sync(before)
        except (LibbpfError, OSError) as exc:
            log.warning("alias-use map not updated", extra={"service": name, "error": str(exc)})

    def begin_resync(self) -> None:
        """A new Service listing starts: Services it does not claim lose their aliases at
        :meth:`end_resync`."""
        self._claimed = set()

    def end_resync(self) -> None:
        """The listing ended (``synced``): forget the aliases of Services it did not name,
        and map entries no served alias has (left by an agent that ran before)."""
        claimed, self._claimed = self._claimed or set(), None
        for name in [n for n in self.by_service if n not in claimed]:
            self.set_service(name, ())
        serving = {ip_to_map(ip) for ip in self._serving()}
        try:
            for key, _ in list(self.map.items()):
                if int(key.value) not in serving:
                    self.map.delete(key)
        except (LibbpfError, OSError) as exc:
            log.warning("alias-use map not pruned", extra={"error": str(exc)})

    def uses(self) -> list[cp.AliasUse]:
        """Every alias served, with its use as the programs recorded it (sorted by IP)."""
        now = self.clock_ns()
        seen: dict[str, int] = {}
        try:
            for key, value in self.map.items():
                seen[ip_from_map(int(key.value))] = int(value.value)
        except (LibbpfError, OSError) as exc:
            log.warning("alias-use map unreadable", extra={"error": str(exc)})
        out = []
        for ip in sorted(self._serving()):
            stamp = seen.get(ip, 0)
            if stamp:
                out.append(cp.AliasUse(ip=ip, used=True, idle_ms=max(0, now - stamp) // 1_000_000))
            else:
                out.append(cp.AliasUse(ip=ip, used=False))
        return out

    def report_due(self) -> bool:
        """Whether a report is due: aliases are served, or the last report named some."""
        return bool(self.by_service) or self._reported_any

    async def report_loop(
        self, report: Callable[[], Awaitable[None]], interval: float = DEFAULT_REPORT_INTERVAL
    ) -> None:
        """Call ``report`` every ``interval`` seconds while :meth:`report_due` (forever;
        a failed report is logged and tried at the next tick)."""
        while True:
            await asyncio.sleep(interval)
            if not self.report_due():
                continue
            serving = bool(self.by_service)
            try:
                await report()
            except Exception as exc:  # the operator may be away: try at the next tick
                log.warning("alias-use report failed", extra={"error": str(exc)})
                continue
            self._reported_any = serving
