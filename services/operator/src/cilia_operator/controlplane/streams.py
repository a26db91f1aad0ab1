"""List-then-watch of several kinds for the gRPC watch streams.

``follow(store, kinds)`` yields, per kind, a ``Listed`` snapshot and then every
``Changed`` event; when a kind's watch falls behind the store's history (``Expired``) it
lists that kind again and yields a new ``Listed``. ``Listed.ready`` is True once every
kind has been listed at least once: the point at which a stream sends ``synced``.

Every stream of a kind shares one list + watch of the store (:class:`Informer`): with the
Kubernetes store, 500 agents' streams were 500+ watches of the API server (and exhausted
the client's connection pool: requests timed out under ``python -m bench k8s_operator``).

Every message a stream sends is bounded by count (``--watch-list-chunk-size``) and by
bytes (``--watch-max-message-bytes``, default 4 MiB: grpcio's default receive limit, which
the agent keeps unless ``--operator-max-message-bytes`` raises it): a listing of 10,000
policies of 5 KB each is about a dozen messages, never one the peer refuses with
RESOURCE_EXHAUSTED (:func:`pages`).

``Sent`` remembers what a client was sent (key -> message) so a relist or a no-op change
produces only real differences.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..store import Expired, Resource, Store, WatchEvent

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


def _key(obj: Resource) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


class _Subscriber:
    """One ``follow`` call's view of the shared informers: a bounded queue of changes and
    the kinds to hand out as a fresh snapshot next (after a relist or an overflow)."""

    def __init__(self, queue_size: int) -> None:
        self.queue_size = max(1, queue_size)
        self.events: collections.deque[Changed] = collections.deque()
        self.relist: dict[str, None] = {}  # ordered set of kinds
        self.failure: BaseException | None = None
        self.wake = asyncio.Event()

    def push(self, item: Changed) -> None:
        if item.kind in self.relist:
            return  # the snapshot handed out next holds it
        if len(self.events) >= self.queue_size:
            # a slow reader never blocks the shared watch: it gets a snapshot instead
            self.mark(item.kind)
            return
        self.events.append(item)
        self.wake.set()

    def mark(self, kind: str) -> None:
        self.relist[kind] = None
        self.events = collections.deque(e for e in self.events if e.kind != kind)
        self.wake.set()

    def fail(self, error: BaseException) -> None:
        self.failure = error
        self.wake.set()


class Informer:
    """One list + watch of ``kind`` in ``store``, shared by every ``follow`` of it (as
    client-go's shared informers): the current objects are kept, each change is handed
    to every subscriber; a subscriber that falls ``queue_size`` changes behind, a watch
    that falls behind the store's history (``Expired``) and a new subscriber all get a
    snapshot of the kept objects. A store failure is handed to the subscribers (their
    streams end with its status, the agents reconnect) and the informer starts again
    after ``retry_interval`` seconds. It stops when its last subscriber leaves.

    One per (store, kind): :func:`informer`.
    """

    def __init__(self, store: Store, kind: str, retry_interval: float = 1.0) -> None:
        self.store = store
        self.kind = kind
        self.retry_interval = retry_interval
        self.items: dict[tuple[str, str], Resource] = {}
        self.ready = False
        self.subscribers: set[_Subscriber] = set()
        self._task: asyncio.Task[None] | None = None

    def subscribe(self, sub: _Subscriber) -> None:
        """Add ``sub``: it gets a snapshot once the informer has listed."""
        self.subscribers.add(sub)
        if self.ready:
            sub.mark(self.kind)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"informer-{self.kind}"
            )

    def unsubscribe(self, sub: _Subscriber) -> None:
        """Remove ``sub``; the last one leaving stops the informer."""
        self.subscribers.discard(sub)
        if not self.subscribers and self._task is not None:
            self._task.cancel()
            self._task = None
            self.ready = False
            self.items = {}

    def snapshot(self) -> list[Resource]:
        """The kept objects."""
        return list(self.items.values())

    async def _run(self) -> None:
        while True:
            try:
                listed = await self.store.list(self.kind)
                self.items = {_key(o): o for o in listed.items}
                self.ready = True
                for sub in list(self.subscribers):
                    sub.mark(self.kind)
                async for event in self.store.watch(self.kind, listed.resource_version):
                    key = _key(event.object)
                    if event.type == "DELETED":
                        self.items.pop(key, None)
                    else:
                        self.items[key] = event.object
                    item = Changed(self.kind, event)
                    for sub in list(self.subscribers):
                        sub.push(item)
            except Expired as exc:
                log.info("watch expired; relisting", extra={"kind": self.kind, "error": str(exc)})
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.ready = False
                for sub in list(self.subscribers):
                    sub.fail(exc)
                await asyncio.sleep(self.retry_interval)


_INFORMERS: weakref.WeakKeyDictionary[Store, dict[str, Informer]] = weakref.WeakKeyDictionary()


def informer(store: Store, kind: str) -> Informer:
    """The shared informer of ``kind`` in ``store`` (made on first use)."""
    per_store = _INFORMERS.setdefault(store, {})
    found = per_store.get(kind)
    if found is None:
        found = per_store[kind] = Informer(store, kind)
    return found


async def follow(
    store: Store, kinds: Sequence[str], queue_size: int = 1000
) -> AsyncIterator[Listed | Changed]:
    """Yield snapshots and changes of ``kinds`` (see the module docstring), forever, from
    the shared informers of ``store`` (one list + watch per kind however many streams
    follow it).

    A consumer that falls ``queue_size`` changes behind gets a fresh snapshot of that kind
    instead (it never blocks the shared watch, and never loses a change silently).

    Raises:
        StoreError: the store failed (e.g. ``StoreUnavailable``).
    """
    sub = _Subscriber(queue_size)
    informers = {kind: informer(store, kind) for kind in kinds}
    for inf in informers.values():
        inf.subscribe(sub)
    listed: set[str] = set()
    try:
        while True:
            if sub.failure is not None:
                raise sub.failure
            if sub.relist:
                kind = next(iter(sub.relist))
                del sub.relist[kind]
                listed.add(kind)
                yield Listed(kind, informers[kind].snapshot(), listed >= set(kinds))
            elif sub.events:
                yield sub.events.popleft()
            else:
                sub.wake.clear()
                await sub.wake.wait()
    finally:
        for inf in informers.values():
            inf.unsubscribe(sub)


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


WATCH_MESSAGE_MAX_BYTES = 4 * 1024 * 1024
"""Default of ``--watch-max-message-bytes``: grpcio's default receive limit (4 MiB), so a
client with default channel options (the agent's) takes every message."""

MESSAGE_OVERHEAD_BYTES = 64
"""Bytes of a response reserved for what is not an event (``synced``, framing slack)."""


def _varint_len(value: int) -> int:
    length = 1
    while value >= 0x80:
        value >>= 7
        length += 1
    return length


def event_bytes(event: Any) -> int:
    """Wire bytes ``event`` (a protobuf message) takes as one element of a repeated message
    field numbered below 16: tag (1) + length varint + body."""
    size = int(event.ByteSize())
    return 1 + _varint_len(size) + size


def pages(items: Sequence[M], max_count: int, max_bytes: int) -> list[Sequence[M]]:
    """``items`` (protobuf messages) in consecutive pages of at most ``max_count`` items whose
    encoded size, with :data:`MESSAGE_OVERHEAD_BYTES` for the rest of the response, stays
    within ``max_bytes``; one empty page when ``items`` is empty. An item too large for any
    page goes alone in its own page and is logged (the peer will refuse that message;
    ``--apply-max-record-bytes`` below ``--watch-max-message-bytes`` keeps it from
    happening)."""
    if not items:
        return [items]
    budget = max(1, max_bytes - MESSAGE_OVERHEAD_BYTES)
    out: list[Sequence[M]] = []
    start = used = 0
    for i, item in enumerate(items):
        size = event_bytes(item)
        if i > start and (used + size > budget or i - start >= max_count):
            out.append(items[start:i])
            start, used = i, 0
        if size > budget:
            log.error("stream event larger than --watch-max-message-bytes: sent alone, the "
                      "peer may refuse it", extra={"bytes": size, "max_bytes": max_bytes})  # fmt: skip
        used += size
    out.append(items[start:])
    return out


E = TypeVar("E")
R = TypeVar("R")

OFFLOAD_ITEMS = 500
"""Listings of at least this many objects (and pages of at least this many events) are
computed in a worker thread instead of on the event loop."""


async def _pages(items: Sequence[M], max_count: int, max_bytes: int) -> list[Sequence[M]]:
    """:func:`pages`, in a thread for :data:`OFFLOAD_ITEMS` items or more."""
    if len(items) >= OFFLOAD_ITEMS:
        return await asyncio.to_thread(pages, items, max_count, max_bytes)
    return pages(items, max_count, max_bytes)


async def watch_stream(
    store: Store,
    kinds: Sequence[str],
    apply: Callable[[Listed | Changed], list[E]],
    respond: Callable[[Sequence[E], bool], R],
    *,
    key: Callable[[E], Hashable],
    chunk_size: int,
    queue_size: int,
    max_bytes: int = WATCH_MESSAGE_MAX_BYTES,
) -> AsyncIterator[R]:
    """The body of a ``Watch*`` RPC: events from ``apply`` turned into responses.

    Until every kind is listed, events are held back, only the last one per ``key``
    kept; then they go out in messages of at most ``chunk_size`` events and ``max_bytes``
    bytes (:func:`pages`), the last one with ``synced`` True (also after every later
    relist). Afterwards the events of each change go out in as few such messages as fit.

    Raises:
        StoreError: the store failed; the caller aborts the RPC with its status.
    """
    pending: dict[Hashable, E] = {}
    ready = False
    async for item in follow(store, kinds, queue_size):
        if isinstance(item, Listed) and len(item.items) >= OFFLOAD_ITEMS:
            # a big listing (10,000 policies: seconds of encoding) is turned into events in
            # a thread, so the event loop keeps serving every other stream and call
            events = await asyncio.to_thread(apply, item)
        else:
            events = apply(item)
        for event in events:
            k = key(event)
            pending.pop(k, None)
            pending[k] = event
        if isinstance(item, Listed) and item.ready:
            ready = True
            parts = await _pages(list(pending.values()), chunk_size, max_bytes)
            pending = {}
            for i, part in enumerate(parts):
                yield respond(part, i == len(parts) - 1)
        elif ready and pending:
            parts = await _pages(list(pending.values()), chunk_size, max_bytes)
            pending = {}
            for part in parts:
                yield respond(part, False)
