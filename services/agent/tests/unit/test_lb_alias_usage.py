"""The agent's alias last-use entries (``loadbalancer.usage``): kept per alias served,
reported as durations, pruned on resync -- on a dict standing in for the pinned map."""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any

from prometheus_client import CollectorRegistry

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.layout import ip_to_map
from cilia_agent.loadbalancer.usage import AliasUsage
from cilia_agent.loadbalancer.watcher import ServiceMetrics, ServiceWatcher


class DictMap:
    """The PinnedMap calls AliasUsage makes, on a dict of u32 -> u64."""

    def __init__(self) -> None:
        self.d: dict[int, int] = {}

    def lookup(self, key: Any) -> Any:
        return ctypes.c_uint64(self.d[key.value]) if key.value in self.d else None

    def update(self, key: Any, value: Any) -> None:
        self.d[key.value] = value.value

    def delete(self, key: Any) -> bool:
        return self.d.pop(key.value, None) is not None

    def items(self) -> Any:
        return [(ctypes.c_uint32(k), ctypes.c_uint64(v)) for k, v in self.d.items()]


class NoWriter:
    frontends: dict[str, Any] = {}

    def begin_resync(self) -> None: ...

    def end_resync(self) -> int:
        return 0

    def upsert_service(self, svc: cp.Service) -> list[str]:
        return []

    def delete_service(self, namespace: str, name: str) -> int:
        return 0


def upsert(name: str, *aliases: str) -> cp.ServiceEvent:
    return cp.ServiceEvent(type=cp.EVENT_TYPE_UPSERT, service=cp.Service(
        namespace="default", name=name, cluster_ips=["10.112.0.3"], alias_ips=list(aliases)))  # fmt: skip


def test_aliases_get_entries_uses_are_reported_as_idle_time_and_stale_ones_go() -> None:
    now = [10_000_000_000]
    fake = DictMap()
    usage = AliasUsage(map=fake, clock_ns=lambda: now[0])
    watcher = ServiceWatcher(NoWriter(), ServiceMetrics(CollectorRegistry()), usage)  # type: ignore[arg-type]

    async def stream(*responses: cp.WatchServicesResponse) -> Any:
        for r in responses:
            yield r

    fake.d[ip_to_map("10.96.0.99")] = 5  # left by an agent that ran before: pruned at synced
    first = cp.WatchServicesResponse(events=[upsert("web", "10.96.0.3"), upsert("dns", "10.96.0.10")],
                                     synced=True)  # fmt: skip
    asyncio.run(watcher.consume(stream(first)))
    assert set(fake.d) == {ip_to_map("10.96.0.3"), ip_to_map("10.96.0.10")}
    assert all(v == 0 for v in fake.d.values())  # not used yet
    fake.d[ip_to_map("10.96.0.10")] = now[0] - 2_500_000_000  # the program stamped a use
    assert usage.uses() == [
        cp.AliasUse(ip="10.96.0.10", used=True, idle_ms=2500),
        cp.AliasUse(ip="10.96.0.3", used=False),
    ]
    # a new stream's listing names only dns: web's alias entry goes at synced
    again = cp.WatchServicesResponse(events=[upsert("dns", "10.96.0.10")], synced=True)
    asyncio.run(watcher.consume(stream(again)))
    assert set(fake.d) == {ip_to_map("10.96.0.10")}
    assert fake.d[ip_to_map("10.96.0.10")] != 0  # a kept entry keeps its last use
    released = cp.WatchServicesResponse(events=[upsert("dns")])
    asyncio.run(watcher.consume(stream(released)))
    assert fake.d == {} and usage.uses() == []
    assert usage.report_due() is False
