"""IPCache: precedence of local endpoints, host addresses and the operator's stream, and what
its listeners (the BPF writer) are told."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.layout import IpcacheKey, IpcacheValue, ip_to_map
from cilia_agent.ipcache import Entry, IPCache
from cilia_agent.ipcache.bpf import read_prefixes
from cilia_agent.ipcache.watcher import consume_ipcache


class Recorder:
    """A listener keeping the effective table as the BPF map would hold it."""

    def __init__(self) -> None:
        self.table: dict[str, Entry] = {}
        self.calls: list[str] = []

    def upsert(self, prefix: str, entry: Entry) -> None:
        self.table[prefix] = entry
        self.calls.append(f"upsert {prefix} {entry.identity}")

    def delete(self, prefix: str) -> None:
        self.table.pop(prefix, None)
        self.calls.append(f"delete {prefix}")


def test_local_endpoint_beats_the_stream_and_the_stream_takes_over_when_it_goes() -> None:
    rec = Recorder()
    cache = IPCache([rec])
    cache.upsert_endpoint("10.0.0.2", 300, ep_id=1)
    cache.upsert_remote("10.0.0.2/32", Entry(999, "192.0.2.20", "default/elsewhere"))
    assert rec.table["10.0.0.2/32"] == Entry(300), "the stream never overrides a local endpoint"
    cache.delete_endpoint("10.0.0.2", ep_id=1)
    assert rec.table["10.0.0.2/32"] == Entry(999, "192.0.2.20", "default/elsewhere")
    cache.delete_remote("10.0.0.2/32")
    assert "10.0.0.2/32" not in rec.table


def test_deleting_another_endpoints_address_changes_nothing() -> None:
    rec = Recorder()
    cache = IPCache([rec])
    cache.upsert_endpoint("10.0.0.2", 300, ep_id=2)
    cache.delete_endpoint("10.0.0.2", ep_id=1)  # an older endpoint that held the address
    assert rec.table["10.0.0.2/32"] == Entry(300)


def test_host_addresses_are_identity_1_and_lookup_is_longest_prefix() -> None:
    rec = Recorder()
    cache = IPCache([rec])
    cache.set_host_addresses(["192.0.2.10", ""])
    cache.upsert_remote("10.1.0.0/16", Entry(400, "192.0.2.30", ""))
    cache.upsert_remote("10.1.2.0/24", Entry(401, "192.0.2.31", "ns/pod"))
    assert rec.table["192.0.2.10/32"] == Entry(1)
    assert cache.lookup("10.1.2.7") == Entry(401, "192.0.2.31", "ns/pod")
    assert cache.lookup("10.1.9.7") == Entry(400, "192.0.2.30", "")
    assert cache.lookup("192.0.2.10") == Entry(1)
    assert cache.lookup("203.0.113.1") is None
    assert cache.lookup("not-an-ip") is None


def test_purge_removes_a_stale_pinned_entry_unless_a_live_endpoint_holds_it() -> None:
    rec = Recorder()
    cache = IPCache([rec])
    cache.upsert_endpoint("10.0.0.3", 300, ep_id=1)
    rec.calls.clear()
    cache.purge("10.0.0.3")
    cache.purge("10.0.0.9")
    assert rec.calls == ["delete 10.0.0.9/32"]


async def _stream(*messages: cp.WatchIPCacheResponse) -> AsyncIterator[cp.WatchIPCacheResponse]:
    for message in messages:
        yield message


def _event(cidr: str, identity: int, kind: Any = cp.EVENT_TYPE_UPSERT) -> cp.IPCacheEvent:
    return cp.IPCacheEvent(type=kind, entry=cp.IPCacheEntry(cidr=cidr, identity=identity))


def test_a_new_stream_listing_drops_what_the_previous_stream_gave_and_skips_bad_cidrs() -> None:
    rec = Recorder()
    cache = IPCache([rec])
    first = cp.WatchIPCacheResponse(
        events=[_event("10.1.0.5/32", 300), _event("10.1.0.6", 301), _event("bogus", 5)],
        synced=True,
    )
    assert asyncio.run(consume_ipcache(cache, _stream(first)))
    assert set(rec.table) == {"10.1.0.5/32", "10.1.0.6/32"}
    second = cp.WatchIPCacheResponse(events=[_event("10.1.0.5/32", 300)], synced=True)
    asyncio.run(consume_ipcache(cache, _stream(second)))
    assert set(rec.table) == {"10.1.0.5/32"}
    later = cp.WatchIPCacheResponse(events=[_event("10.1.0.5/32", 0, cp.EVENT_TYPE_DELETE)])
    asyncio.run(consume_ipcache(cache, _stream(later)))
    assert rec.table == {}


def test_policy_cidrs_are_the_lowest_precedence_and_longest_match_still_wins() -> None:
    rec = Recorder()
    cache = IPCache([rec])
    cache.upsert_cidr("10.0.0.0/8", 16777217)
    cache.upsert_cidr("10.0.0.2/32", 16777218)  # a policy naming a pod's address exactly
    cache.upsert_endpoint("10.0.0.2", 300, ep_id=1)
    cache.upsert_remote("10.1.0.0/16", Entry(401, "192.0.2.31", ""))
    assert rec.table["10.0.0.2/32"] == Entry(300), "the pod keeps its identity"
    assert cache.lookup("10.0.0.2") == Entry(300)
    assert cache.lookup("10.1.0.9") == Entry(401, "192.0.2.31", "")
    assert cache.lookup("10.9.0.1") == Entry(16777217)
    cache.delete_endpoint("10.0.0.2", ep_id=1)
    assert rec.table["10.0.0.2/32"] == Entry(16777218), "the policy's entry takes over"
    cache.upsert_remote("10.0.0.0/8", Entry(402, "192.0.2.32", ""))
    cache.delete_cidr("10.0.0.0/8")
    assert rec.table["10.0.0.0/8"] == Entry(402, "192.0.2.32", ""), "the stream's entry stays"
    cache.delete_remote("10.0.0.0/8")
    cache.delete_cidr("10.0.0.2/32")
    assert sorted(rec.table) == ["10.1.0.0/16"]


def test_read_prefixes_turns_pinned_keys_into_prefixes() -> None:
    items = [
        (IpcacheKey(24, ip_to_map("192.0.2.0")), IpcacheValue(16777217, 0)),
        (IpcacheKey(32, ip_to_map("10.0.0.2")), IpcacheValue(300, 0)),
    ]
    assert read_prefixes(items) == {"192.0.2.0/24": 16777217, "10.0.0.2/32": 300}
