"""Follows one ``EndpointService.WatchIPCache`` stream into the :class:`IPCache`.

The first messages of a stream are a listing ending with ``synced``; entries the previous
stream gave that the new listing lacks are removed then (resync after a reconnect).
Locally owned prefixes are kept aside by the cache (see ``cache``). Bad CIDRs are logged
and skipped.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.ipcache.cache import Entry, IPCache, prefix_of

log = logging.getLogger(__name__)


async def consume_ipcache(cache: IPCache, stream: AsyncIterable[cp.WatchIPCacheResponse]) -> bool:
    """Apply every message of ``stream``; returns True when it delivered anything."""
    delivered = False
    seen: set[str] | None = set()
    async for response in stream:
        delivered = True
        for event in response.events:
            entry = event.entry
            try:
                prefix = prefix_of(entry.cidr)
            except ValueError:
                log.warning("ipcache: ignoring bad CIDR %r", entry.cidr)
                continue
            if seen is not None:
                seen.add(prefix)
            if event.type == cp.EVENT_TYPE_DELETE:
                cache.delete_remote(prefix)
            else:
                cache.upsert_remote(prefix, Entry(entry.identity, entry.host_ip, entry.owner))
        if response.synced and seen is not None:
            for prefix in [p for p in cache.remote_prefixes() if p not in seen]:
                cache.delete_remote(prefix)
            seen = None
    return delivered
