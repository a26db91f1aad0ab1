"""What every part of the IPAM controller shares (one job: the shared state's types).

:class:`ControllerState` is the base of the mixins :class:`.controller.IPAMController` is
made of (:mod:`.reconcile`, :mod:`.pools`, :mod:`.sources`, :mod:`.subscriptions`,
:mod:`.migration`): it declares the attributes ``IPAMController.__init__`` sets and the
methods one part calls on another, so each part type-checks on its own. It holds nothing
at run time.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..metrics import Metrics
    from ..store import Resource, Store, WatchEvent
    from .allocator import MultiPoolAllocator
    from .migration import MigrationProgress
    from .subscriptions import NodeSubscription


class ControllerState:
    """Attributes (set by ``IPAMController.__init__``, documented there) and the methods
    the parts call on each other (defined by the part named beside each)."""

    store: Store
    metrics: Metrics
    allocator: MultiPoolAllocator
    mode: str
    default_pool: str
    cluster_cidrs: tuple[ipaddress.IPv4Network, ...]
    cluster_mask_size: int
    migrate: bool
    migration: MigrationProgress
    running: bool
    release_grace: float
    _deleted_at: dict[str, float]
    _gone: set[str]
    _deleted_hooks: list[Callable[[str], Awaitable[object]]]
    _hook_tasks: set[asyncio.Task[None]]
    _draining_warned: set[tuple[str, ipaddress.IPv4Network]]
    _node_nets: dict[str, dict[ipaddress.IPv4Network, str]]
    _service_nets: dict[ipaddress.IPv4Network, str]
    _conflicting: dict[str, str]
    _conflict_retries: int
    _retry_interval: float
    _queue: asyncio.Queue[tuple[str, str]]
    _queued: set[tuple[str, str]]
    _known: set[str]
    _subs: dict[str, set[NodeSubscription]]
    _tasks: list[asyncio.Task[None]]
    _observers: list[asyncio.Task[None]]
    _k8s_nodes: dict[str, Resource]
    _waiting: dict[str, dict[str, float]]
    _stats_pending: bool

    if TYPE_CHECKING:
        # controller
        def _recorded(self, record: Resource) -> dict[str, list[ipaddress.IPv4Network]]: ...

        # reconcile
        def enqueue(self, name: str) -> None: ...
        def enqueue_pool(self, name: str) -> None: ...
        def _publish_stats(self) -> None: ...
        def _publish_stats_soon(self) -> None: ...
        def _node_networks(self, name: str, record: Resource | None) -> None: ...
        def _retry_waiting(self, pool: str) -> None: ...

        # pools
        async def sync_draining(self, name: str) -> None: ...

        # sources
        async def _get_node(self, name: str) -> Resource | None: ...
        async def _learn_claims(self) -> None: ...
        async def _reconcile_from_k8s_node(self, name: str) -> None: ...
        async def _watch(
            self,
            kind: str,
            since: str,
            on_event: Callable[[WatchEvent], Awaitable[None]],
            relist: Callable[[], Awaitable[str]],
        ) -> None: ...

        # subscriptions
        def _notify_node(self, name: str, record: Resource | None, *, deleted: bool) -> None: ...
        def _notify_pools(self) -> None: ...

        # migration
        async def _migrate_node(self, name: str) -> None: ...
