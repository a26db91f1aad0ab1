"""The flow ring: a fixed-capacity buffer of the most recent events.

Positions are sequence numbers: the n-th item ever written has sequence n
(0-based) and lives in slot ``n & mask``. The ring holds the last ``capacity``
items, i.e. sequences ``[oldest, next_seq)``; a reader that holds an older
sequence has lost ``oldest - seq`` items.

Capacity is 2^n-1 as upstream (``hubble-event-buffer-capacity``, default 4095,
``pkg/hubble/container/ring.go``), backed by 2^n slots so the slot of a
sequence is a mask, not a modulo.

The ring is confined to one asyncio event loop: write and read from that loop
only. Writes are O(1) and never block; followers are woken through futures,
never by polling.

Upstream: ``pkg/hubble/container/ring.go`` and ``ring_reader.go`` (not copied).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from cilia_agent.hubble.errors import InvalidCapacity

T = TypeVar("T")

DEFAULT_CAPACITY = 4095
MAX_CAPACITY = 65535


def validate_capacity(capacity: int) -> int:
    """Return ``capacity`` if it is 2^n-1 in 1..65535.

    Raises:
        InvalidCapacity: anything else (0, negatives, 4096, 65536 …).
    """
    if not 1 <= capacity <= MAX_CAPACITY or (capacity + 1) & capacity:
        raise InvalidCapacity(capacity)
    return capacity


@dataclass(frozen=True, slots=True)
class Lost:
    """A follower fell behind: ``count`` items were overwritten before it read them."""

    count: int


class Ring(Generic[T]):
    """Ring of the last ``capacity`` items with sequence-numbered readers.

    Args:
        capacity: 2^n-1 in 1..65535 (see :func:`validate_capacity`).
        time_of: wall-clock nanoseconds of an item (used by :meth:`read_time_range`);
            ``None`` when time ranges are not needed.

    Raises:
        InvalidCapacity: bad capacity.
    """

    def __init__(self, capacity: int, time_of: Callable[[T], int] | None = None) -> None:
        self._capacity = validate_capacity(capacity)
        self._mask = capacity  # 2^n slots, mask 2^n-1 == capacity
        self._slots: list[T | None] = [None] * (capacity + 1)
        self._next = 0
        self._time_of = time_of
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def capacity(self) -> int:
        """Maximum number of readable items."""
        return self._capacity

    @property
    def written(self) -> int:
        """Items ever written (also the sequence the next write gets)."""
        return self._next

    @property
    def next_seq(self) -> int:
        """Sequence of the next write; a follower starting here sees only new items."""
        return self._next

    @property
    def oldest(self) -> int:
        """Sequence of the oldest readable item (== next_seq when empty)."""
        return max(0, self._next - self._capacity)

    def __len__(self) -> int:
        return self._next - self.oldest

    def write(self, item: T) -> None:
        """Append ``item``, overwriting the oldest when full, and wake followers. O(1)."""
        self._slots[self._next & self._mask] = item
        self._next += 1
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def get(self, seq: int) -> T:
        """The item with sequence ``seq``.

        Raises:
            IndexError: ``seq`` was overwritten or not written yet.
        """
        if not self.oldest <= seq < self._next:
            raise IndexError(f"sequence {seq} outside [{self.oldest}, {self._next})")
        item = self._slots[seq & self._mask]
        assert item is not None
        return item

    def items(self, start: int, stop: int) -> list[T]:
        """Items with sequences in ``[start, stop)`` as a list (at most two slices of the
        slots: no Python work per item), oldest first.

        Raises:
            IndexError: part of the range was overwritten or not written yet.
        """
        if stop <= start:
            return []
        if not self.oldest <= start or stop > self._next:
            raise IndexError(f"sequences [{start}, {stop}) outside [{self.oldest}, {self._next})")
        first, last = start & self._mask, (stop - 1) & self._mask
        if first <= last:
            return self._slots[first : last + 1]  # type: ignore[return-value]  # written slots
        return self._slots[first:] + self._slots[: last + 1]  # type: ignore[return-value]

    def iter_range(self, start: int, stop: int | None = None) -> Iterator[T]:
        """Items with sequences in ``[max(start, oldest), min(stop, next_seq))``, oldest first."""
        end = self._next if stop is None else min(stop, self._next)
        for seq in range(max(start, self.oldest), end):
            yield self.get(seq)

    def iter_backward(self) -> Iterator[tuple[int, T]]:
        """``(seq, item)`` from the newest to the oldest readable item."""
        for seq in range(self._next - 1, self.oldest - 1, -1):
            yield seq, self.get(seq)

    def last(self, n: int) -> list[T]:
        """The newest ``n`` items (fewer when the ring holds fewer), oldest first."""
        if n <= 0:
            return []
        return list(self.iter_range(self._next - n))

    def first(self, n: int) -> list[T]:
        """The oldest ``n`` readable items, oldest first."""
        if n <= 0:
            return []
        return list(self.iter_range(self.oldest, self.oldest + n))

    def read_time_range(self, since_ns: int | None, until_ns: int | None) -> list[T]:
        """Items with ``since_ns <= time <= until_ns``, oldest first.

        As upstream, items are scanned oldest first; items before ``since_ns`` are
        skipped and the scan stops at the first item after ``until_ns``.

        Raises:
            ValueError: the ring was built without ``time_of``.
        """
        if self._time_of is None:
            raise ValueError("ring has no time_of function")
        out: list[T] = []
        for item in self.iter_range(self.oldest):
            ts = self._time_of(item)
            if until_ns is not None and ts > until_ns:
                break
            if since_ns is not None and ts < since_ns:
                continue
            out.append(item)
        return out

    async def wait_beyond(self, seq: int) -> None:
        """Return once an item with sequence >= ``seq`` has been written (no polling)."""
        while self._next <= seq:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            try:
                await fut
            finally:
                if not fut.done():
                    fut.cancel()

    async def follow(self, start: int | None = None) -> AsyncIterator[T | Lost]:
        """Yield items from sequence ``start`` (default: only new ones) forever.

        When the follower falls more than ``capacity`` items behind, it yields one
        :class:`Lost` with the number of overwritten items and continues at the
        oldest readable item.
        """
        seq = self._next if start is None else start
        while True:
            oldest = self.oldest
            if seq < oldest:
                yield Lost(oldest - seq)
                seq = oldest
                continue
            if seq < self._next:
                item = self.get(seq)
                seq += 1
                yield item
                continue
            await self.wait_beyond(seq)
