"""Follows one ``IdentityService.WatchIdentities`` stream into the identity cache.

A new stream resyncs the cache (``begin_resync``; its listing ends with ``synced``).
Identities of local endpoints missing from the initial listing (allocated while the
listing was being taken) are kept: they are added to the listing rather than removed and
re-added when the operator's event arrives. Every message is first shown to the
allocator (:meth:`IdentityAllocator.observe`), which allocates again a held identity the
operator deleted, relabelled or did not list. After every message ``on_change`` runs
(readiness of policy computation).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.identity.allocator import IdentityAllocator, IdentitySink


async def consume_identities(
    sink: IdentitySink,
    allocator: IdentityAllocator,
    stream: AsyncIterable[cp.WatchIdentitiesResponse],
    on_change: Callable[[], None],
) -> bool:
    """Apply every message of ``stream`` through ``sink``; True when it delivered anything."""
    delivered = False
    listed: set[int] | None = None
    async for response in stream:
        if not delivered:
            sink.identities.begin_resync()
            delivered = True
            listed = set()
        if listed is not None:
            listed.update(e.identity.id for e in response.events)
        listing = listed if listed is not None and response.synced else None
        allocator.observe(response, listing)
        if listing is not None:
            response = _with_local_identities(response, listing, allocator)
            listed = None
        try:
            sink.on_identities(response)
        finally:
            on_change()
    return delivered


def _with_local_identities(
    response: cp.WatchIdentitiesResponse, listed: set[int], allocator: IdentityAllocator
) -> cp.WatchIdentitiesResponse:
    extra = {i: labels for i, labels in allocator.local_identities().items() if i not in listed}
    if not extra:
        return response
    merged = cp.WatchIdentitiesResponse()
    merged.CopyFrom(response)
    for identity, labels in sorted(extra.items()):
        merged.events.append(
            cp.IdentityEvent(
                type=cp.EVENT_TYPE_UPSERT,
                identity=cp.Identity(id=identity, labels=list(labels)),
            )
        )
    return merged
