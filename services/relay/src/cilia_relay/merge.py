"""Pure merge logic of the relay's GetFlows: the time-ordering buffer and error aggregation.

No I/O and no clock of its own: every time is passed in, so the behaviour is
testable with fake time. The asyncio driver lives in :mod:`cilia_relay.observer`.

Source: upstream relay behaviour (``pkg/hubble/relay/{observer,queue}``;
reference: cilium-upstream.md §6 item 4 and 5).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Generic, TypeVar

from google.protobuf.timestamp_pb2 import Timestamp

from cilia.hubble.observer import observer_pb2
from cilia.hubble.relay import relay_pb2

T = TypeVar("T")

NANOS_PER_SECOND = 1_000_000_000


def timestamp_ns(ts: Timestamp) -> int:
    """Nanoseconds since the Unix epoch of a protobuf ``Timestamp`` (seconds, then nanos)."""
    return int(ts.seconds) * NANOS_PER_SECOND + int(ts.nanos)


def response_time_ns(response: observer_pb2.GetFlowsResponse) -> int:
    """The ordering key of a ``GetFlowsResponse``: its ``time`` field in ns since the epoch.

    A response without ``time`` sorts first (key 0), as upstream's comparison of nil times.
    """
    return timestamp_ns(response.time)


class WireResponse:
    """A ``GetFlowsResponse`` kept serialized, as a peer's FlowBatchService sent it.

    Attributes:
        time_ns: its ``time`` in ns since the epoch (the merge key).
        data: its wire encoding.
    """

    __slots__ = ("data", "time_ns")

    def __init__(self, time_ns: int, data: bytes) -> None:
        self.time_ns = time_ns
        self.data = data


def item_time_ns(item: observer_pb2.GetFlowsResponse | WireResponse) -> int:
    """The ordering key of a response, decoded (:func:`response_time_ns`) or not."""
    if isinstance(item, WireResponse):
        return item.time_ns
    return response_time_ns(item)


def sort_buffer_len(sort_buffer_len_max: int, number: int, num_peers: int) -> int:
    """Capacity of the sort buffer for one GetFlows call.

    ``min(sort_buffer_len_max, number * num_peers)`` when that product is positive,
    else ``sort_buffer_len_max`` (follow without ``number``, or no peers yet).

    Raises:
        ValueError: ``sort_buffer_len_max`` < 1.
    """
    if sort_buffer_len_max < 1:
        raise ValueError(f"sort_buffer_len_max must be >= 1, got {sort_buffer_len_max}")
    wanted = number * num_peers
    if 0 < wanted < sort_buffer_len_max:
        return wanted
    return sort_buffer_len_max


class SortBuffer(Generic[T]):
    """A bounded min-heap ordered by a nanosecond time key (ties keep arrival order).

    Args:
        capacity: maximum number of items held (>= 1).
        key: item -> time in ns since the epoch (e.g. :func:`response_time_ns`).

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int, key: Callable[[T], int]) -> None:
        if capacity < 1:
            raise ValueError(f"sort buffer capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._key = key
        self._heap: list[tuple[int, int, T]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: T) -> list[T]:
        """Add ``item``; when the buffer is full, first pop and return the oldest item.

        Returns:
            ``[]`` or the one item that had to leave to make room (the oldest held,
            which is older than or as old as anything still in the buffer).
        """
        out: list[T] = []
        if len(self._heap) >= self.capacity:
            out.append(heapq.heappop(self._heap)[2])
        heapq.heappush(self._heap, (self._key(item), next(self._seq), item))
        return out

    def pop_older_than(self, cutoff_ns: int) -> list[T]:
        """Pop, oldest first, every item whose time is strictly before ``cutoff_ns``."""
        out: list[T] = []
        while self._heap and self._heap[0][0] < cutoff_ns:
            out.append(heapq.heappop(self._heap)[2])
        return out

    def drain(self) -> list[T]:
        """Pop every item, oldest first (the end of a stream)."""
        out = [entry[2] for entry in sorted(self._heap)]
        self._heap.clear()
        return out


def is_node_error(response: observer_pb2.GetFlowsResponse) -> bool:
    """True for a ``node_status`` response whose state is ``NODE_ERROR``."""
    return (
        response.WhichOneof("response_types") == "node_status"
        and response.node_status.state_change == relay_pb2.NODE_ERROR
    )


class ErrorAggregator:
    """Merges ``NODE_ERROR`` events with identical messages arriving within a window.

    The first error opens a window of ``window`` seconds; later errors with the same
    message append their node names to it; an error with another message sends the
    pending one at once and opens a new window. Everything else passes through.

    Args:
        window: seconds a pending error waits for identical ones (0 = no merging).
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self._pending: observer_pb2.GetFlowsResponse | None = None
        self._flush_at: float | None = None

    @property
    def flush_at(self) -> float | None:
        """Monotonic time (s) at which the pending error is due, or None."""
        return self._flush_at

    def offer(
        self, response: observer_pb2.GetFlowsResponse, now: float
    ) -> list[observer_pb2.GetFlowsResponse]:
        """Feed one response at monotonic time ``now`` (s); return what may go on now."""
        if not is_node_error(response):
            return [response, *self.due(now)]
        out = self.due(now)
        if self._pending is not None:
            pending = self._pending.node_status
            if pending.message == response.node_status.message:
                for name in response.node_status.node_names:
                    if name not in pending.node_names:
                        pending.node_names.append(name)
                return out
            out.append(self._pending)
        if self.window <= 0:
            out.append(response)
            self._pending, self._flush_at = None, None
            return out
        self._pending = response
        self._flush_at = now + self.window
        return out

    def due(self, now: float) -> list[observer_pb2.GetFlowsResponse]:
        """Return the pending error when its window has closed at ``now`` (s)."""
        if self._pending is not None and self._flush_at is not None and now >= self._flush_at:
            return self.flush()
        return []

    def flush(self) -> list[observer_pb2.GetFlowsResponse]:
        """Return the pending error (if any) regardless of its window."""
        out = [] if self._pending is None else [self._pending]
        self._pending, self._flush_at = None, None
        return out
