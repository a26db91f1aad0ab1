"""The IPAM controller's subscriptions (one job: subscriptions).

``WatchAllocations`` streams subscribe to one node's record (:class:`NodeSubscription`
holds its newest record, so a slow stream coalesces changes); a replica that does not lead
keeps them current with watches of its own (:meth:`SubscriptionsMixin.observe`). Part of
:class:`.controller.IPAMController`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from ..kinds import NODE, POOL
from ..store import (
    Resource,
    WatchEvent,
)
from ..tasks import cancel_all
from .state import ControllerState

log = logging.getLogger(__name__)


@dataclass(eq=False)
class NodeSubscription:
    """Newest record of one node, for a WatchAllocations stream.

    Attributes:
        node: node name.
        latest: newest record seen by the node watch (None until a change arrives).
        deleted: the node record was deleted.
        pools_generation: bumped on every pool change (draining CIDRs change what the
            stream reports without touching the node record).
        peer: IP address the agent's stream comes from ("" for unix sockets); a second
            agent registering the same node name from another address is refused.
    """

    node: str
    peer: str = ""
    latest: Resource | None = None
    deleted: bool = False
    pools_generation: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class SubscriptionsMixin(ControllerState):
    """Node subscriptions and follower watches of :class:`.controller.IPAMController`."""

    def _notify_node(self, name: str, record: Resource | None, *, deleted: bool) -> None:
        """Wake node ``name``'s WatchAllocations streams with its newest record."""
        for sub in self._subs.get(name, ()):
            sub.latest = record
            sub.deleted = deleted
            sub.changed.set()

    def _notify_pools(self) -> None:
        """Wake every WatchAllocations stream: a pool changed (draining CIDRs count)."""
        for subs in self._subs.values():
            for sub in subs:
                sub.pools_generation += 1
                sub.changed.set()

    def live_peers(self, name: str) -> set[str]:
        """IP addresses of the agents whose allocation stream for node ``name`` is open."""
        return {sub.peer for sub in self._subs.get(name, ()) if sub.peer}

    async def observe(self) -> None:
        """A replica that does not lead: keep the ``WatchAllocations`` subscriptions current
        (node and pool watches that only wake the streams; nothing is allocated or written),
        so every replica serves agents and reports ready (a rollout of two replicas can
        finish). :meth:`start` (on becoming leader) stops observing first.

        Raises:
            StoreError: the initial lists failed.
        """
        await self.stop_observing()
        nodes_rv = (await self.store.list(NODE.kind)).resource_version
        pools_rv = (await self.store.list(POOL.kind)).resource_version
        self._observers = [
            asyncio.create_task(
                self._watch(NODE.kind, nodes_rv, self._observe_node, self._relist_observed)
            ),
            asyncio.create_task(
                self._watch(POOL.kind, pools_rv, self._observe_pool, self._relist_observed_pools)
            ),
        ]

    async def stop_observing(self) -> None:
        """Cancel the follower's watches (no-op when not observing)."""
        await cancel_all(self._observers)
        self._observers = []

    async def _observe_node(self, event: WatchEvent) -> None:
        name = event.object["metadata"]["name"]
        self._notify_node(name, event.object, deleted=event.type == "DELETED")

    async def _observe_pool(self, event: WatchEvent) -> None:
        self._notify_pools()

    async def _relist_observed(self) -> str:
        listed = await self.store.list(NODE.kind)
        current = {o["metadata"]["name"]: o for o in listed.items}
        for name in list(self._subs):
            self._notify_node(name, current.get(name), deleted=name not in current)
        return listed.resource_version

    async def _relist_observed_pools(self) -> str:
        listed = await self.store.list(POOL.kind)
        self._notify_pools()
        return listed.resource_version

    def subscribe(self, name: str, peer: str = "") -> NodeSubscription:
        """Follow node ``name``'s record (``peer``: the agent's IP); call :meth:`unsubscribe`
        when done."""
        sub = NodeSubscription(name, peer)
        self._subs.setdefault(name, set()).add(sub)
        return sub

    def unsubscribe(self, sub: NodeSubscription) -> None:
        """Stop following."""
        subs = self._subs.get(sub.node)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.node]
