"""List-then-watch of several kinds for the gRPC watch streams.

``follow(store, kinds)`` yields, per kind, a ``Listed`` snapshot and then every
``Changed`` event; when a kind's watch falls behind the store's history (``Expired``) it
lists that kind again and yields a new ``Listed``. ``Listed.ready`` is True once every
kind has been listed at least once: the point at which a stream sends ``synced``.

``Sent`` remembers what a client was sent (key -> message) so a relist or a no-op change
produces only real differences.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..store import Expired, Resource, Store, WatchEvent
from ..tasks import cancel_all

log = logging.getLogger(__name__)

K = TypeVar("K")
M = TypeVar("M")


@dataclass(frozen=True)
class Listed:
    """A full snapshot of ``kind``; ``ready``: every kind has been listed once."""

    kind: str
    items: list[Resource]
    ready: bool


@dataclass(frozen=True)
class Changed:
    """One change of ``kind``."""

    kind: str
    event: WatchEvent


@dataclass(frozen=True)
class _Failed:
    error: BaseException


async def follow(
    store: Store, kinds: Sequence[str], queue_size: int = 1000
) -> AsyncIterator[Listed | Changed]:
    """Yield snapshots and changes of ``kinds`` (see the module docstring), forever.

    A slow consumer blocks the watches through a queue of ``queue_size`` items (they then
    fall behind and relist, never lose events silently).

    Raises:
        StoreError: the store failed (e.g. ``StoreUnavailable``).
    """
    queue: asyncio.Queue[Listed | Changed | _Failed] = asyncio.Queue(maxsize=queue_size)
    listed: set[str] = set()

    async def run(kind: str) -> None:
        try:
            while True:
                snapshot = await store.list(kind)
                await queue.put(Listed(kind, snapshot.items, False))
                try:
                    async for event in store.watch(kind, snapshot.resource_version):
                        await queue.put(Changed(kind, event))
                except Expired as exc:
                    log.info("watch expired; relisting", extra={"kind": kind, "error": str(exc)})
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            await queue.put(_Failed(exc))

    tasks = [asyncio.create_task(run(kind), name=f"follow-{kind}") for kind in kinds]
    try:
        while True:
            item = await queue.get()
            if isinstance(item, _Failed):
                raise item.error
            if isinstance(item, Listed):
                listed.add(item.kind)
                item = Listed(item.kind, item.items, listed >= set(kinds))
            yield item
    finally:
        await cancel_all(tasks)


class Sent(Generic[K, M]):
    """What one client was sent: key -> message. Methods return the events to send as
    ``(key, message)`` pairs, message None meaning delete."""

    def __init__(self) -> None:
        self.sent: dict[K, M] = {}

    def set(self, key: K, message: M | None) -> list[tuple[K, M | None]]:
        """Upsert (message) or delete (None) ``key``; [] when nothing changes."""
        if message is None:
            if key in self.sent:
                del self.sent[key]
                return [(key, None)]
            return []
        if self.sent.get(key) == message:
            return []
        self.sent[key] = message
        return [(key, message)]

    def replace(
        self, current: dict[K, M], scope: Callable[[K], bool] = lambda _: True
    ) -> list[tuple[K, M | None]]:
        """Make the keys within ``scope`` equal ``current`` (others are left alone)."""
        out: list[tuple[K, M | None]] = []
        for key in [k for k in self.sent if scope(k) and k not in current]:
            out += self.set(key, None)
        for key, message in current.items():
            out += self.set(key, message)
        return out


def chunked(items: Sequence[M], size: int) -> Iterable[Sequence[M]]:
    """``items`` in slices of at most ``size`` (one empty slice when ``items`` is empty)."""
    if not items:
        yield items
        return
    for start in range(0, len(items), size):
        yield items[start : start + size]


E = TypeVar("E")
R = TypeVar("R")


async def watch_stream(
    store: Store,
    kinds: Sequence[str],
    apply: Callable[[Listed | Changed], list[E]],
    respond: Callable[[Sequence[E], bool], R],
    *,
    key: Callable[[E], Hashable],
    chunk_size: int,
    queue_size: int,
) -> AsyncIterator[R]:
    """The body of a ``Watch*`` RPC: events from ``apply`` turned into responses.

    Until every kind is listed, events are held back, only the last one per ``key``
    kept; then they go out in messages of at most ``chunk_size`` events, the last one with
    ``synced`` True (also after every later relist). Afterwards each change that produced
    events is one message.

    Raises:
        StoreError: the store failed; the caller aborts the RPC with its status.
    """
    pending: dict[Hashable, E] = {}
    ready = False
    async for item in follow(store, kinds, queue_size):
        for event in apply(item):
            k = key(event)
            pending.pop(k, None)
            pending[k] = event
        if isinstance(item, Listed) and item.ready:
            ready = True
            parts = list(chunked(list(pending.values()), chunk_size))
            for i, part in enumerate(parts):
                yield respond(part, i == len(parts) - 1)
            pending = {}
        elif ready and pending:
            yield respond(list(pending.values()), False)
            pending = {}
