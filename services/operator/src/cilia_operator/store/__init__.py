"""Cluster state behind one interface (DESIGN.md §3): :class:`Store` and its backends."""

from .base import (
    AlreadyExists,
    Conflict,
    Contention,
    EventType,
    Expired,
    ListResult,
    NotFound,
    Resource,
    Store,
    StoreError,
    StoreUnavailable,
    WatchEvent,
    object_key,
    resource_version,
    with_resource_version,
)

__all__ = [
    "AlreadyExists",
    "Conflict",
    "Contention",
    "EventType",
    "Expired",
    "ListResult",
    "NotFound",
    "Resource",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "WatchEvent",
    "object_key",
    "resource_version",
    "with_resource_version",
]
