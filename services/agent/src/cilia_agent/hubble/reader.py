"""The ring-buffer consumer: kernel events → Flow → flow ring.

A poll thread waits on the datapath's ``cilia_events`` ring buffer, then drains it: the
datapath wakes the reader only for every ``--bpf-events-wakeup-events``-th event of a CPU (or
when half the ring buffer is unread), so each poll timeout also drains what was written
without a wakeup (many records per wakeup; at most ``poll_timeout_ms`` late). On x86-64 the records are read from the mapped ring directly
(:meth:`~cilia_agent.datapath.objects.RingBuffer.drain`): a run of records is copied as one
block, with no Python call per record; elsewhere libbpf's ``ring_buffer__poll`` and
``ring_buffer__consume`` hand over one record per callback. Blocks and records go into a
bounded hand-off queue (its size counts records). The agent's event loop drains the queue,
unpacks the records as keyed tuples (:data:`.events.KEYED`: ten integers, the template key
among them), finds each flow's shape (:meth:`.parser.Parser.shaper`: the enrichment, decided
at the time of the event) and writes shape, time and ports (network byte order) into the
:class:`~.flowstore.FlowStore`, whose entries are serialized
when first read (no Flow object unless Hubble metrics need one), counting flows in
``hubble_flows_processed_total``.

Every loss becomes one ``LostEvent`` in the ring, with its source:

- the datapath could write an event to neither ring buffer (``cilia_events``, then the
  small ``cilia_events_rescue`` the reader also drains): the programs count it in
  ``cilia_events_counters``; the poll thread reads the count after each drain and the
  increase is reported with source PERF_EVENT_RING_BUFFER (upstream's source for the
  kernel's event buffer);
- the hand-off queue was full (the loop does not keep up): new records are dropped and
  counted, reported with source OBSERVER_EVENTS_QUEUE, as upstream does for its observer
  events queue;
- a follower overtaken by the flow ring gets HUBBLE_RING_BUFFER from the observer.

Limits (the agent exposes them as flags):
  ``queue_size``       records waiting for the loop, default 1000
                       (suggested flag ``--hubble-event-queue-size``)
  ``poll_timeout_ms``  ring_buffer__poll timeout, i.e. the stop latency, default 100

Upstream: ``pkg/hubble/monitor`` consumer + ``pkg/hubble/observer`` events queue.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from cilia.hubble.flow import flow_pb2
from cilia_agent.datapath.objects import DIRECT_READ_SUPPORTED
from cilia_agent.hubble import events
from cilia_agent.hubble.errors import EventDecodeError
from cilia_agent.hubble.flowstore import FlowStore
from cilia_agent.hubble.metrics import HubbleMetrics
from cilia_agent.hubble.parser import Parser

if TYPE_CHECKING:
    from cilia_agent.datapath.objects import RingBuffer

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 1000
DEFAULT_POLL_TIMEOUT_MS = 100
_YIELD_EVERY = 256

RecordCallback = Callable[[bytes], None]
BlockCallback = Callable[[bytes, int], None]
"""``(block, count)``: ``count`` records of ``struct flow_event``, each after its 8-byte
ring-buffer header (stride :data:`events.BLOCK_RECORD` ``.size``)."""


class RecordSource(Protocol):
    """Where records come from: a BPF ring buffer, or a fake in tests."""

    def open(self, on_record: RecordCallback) -> None:
        """Register ``on_record``; it is called from :meth:`poll` for each record."""

    def poll(self, timeout_ms: int) -> None:
        """Wait up to ``timeout_ms`` for records and deliver them (runs in the poll thread).

        A source may also have ``kernel_lost() -> int``: events its producer could not
        write so far (cumulative); the reader reports the increase as a LostEvent; and
        ``open_blocks(on_block, on_record) -> bool``: like :meth:`open`, delivering runs of
        records as blocks (:data:`BlockCallback`) when it returns True.
        """


class EventsMap(Protocol):
    """What :class:`LibbpfRingBuffer` needs of the datapath
    (:class:`cilia_agent.datapath.loader.Datapath`)."""

    def ring_buffer(self, callback: RecordCallback, rescue: bool = False) -> RingBuffer:
        """A libbpf consumer of the events ring buffer (``rescue``: of the ring taking what
        the main one refused) calling ``callback`` per record."""

    def events_lost(self) -> int:
        """Events the programs could not write (cumulative, summed over CPUs)."""


class LibbpfRingBuffer:
    """:class:`RecordSource` over the datapath's ``cilia_events`` ring buffer (libbpf
    ``ring_buffer__poll``/``__consume`` through :class:`~cilia_agent.datapath.objects.RingBuffer`).

    Args:
        datapath: the loaded datapath (owned by the agent; this class only opens a consumer
            of its ring buffer, polls it and frees it in :meth:`close`).
    """

    def __init__(self, datapath: EventsMap) -> None:
        self._datapath = datapath
        self._rb: RingBuffer | None = None
        self._rescue: RingBuffer | None = None
        self._blocks: tuple[BlockCallback, RecordCallback] | None = None

    def open(self, on_record: RecordCallback) -> None:
        """Open consumers of both rings whose callback gets a copy of each record."""
        self._rb = self._datapath.ring_buffer(on_record)
        self._rescue = self._datapath.ring_buffer(on_record, rescue=True)

    def open_blocks(self, on_block: BlockCallback, on_record: RecordCallback) -> bool:
        """Open a consumer that reads the mapped ring itself (x86-64 only; False elsewhere,
        then call :meth:`open`): runs of ``struct flow_event`` records go to ``on_block``,
        any other record to ``on_record``."""
        if not DIRECT_READ_SUPPORTED:
            return False
        self.open(on_record)
        self._blocks = (on_block, on_record)
        return True

    def poll(self, timeout_ms: int) -> None:
        """Wait for data (the GIL is released while waiting) up to ``timeout_ms``, then read
        everything there: records written without a wakeup are read too. Blocks:
        :meth:`RingBuffer.wait` (edge-triggered, for the producer's next wakeup) +
        :meth:`RingBuffer.drain`; records: ``ring_buffer__poll`` + ``__consume``. Then
        the rescue ring is read (its records, rare, come after the main ring's of the
        same pass: out of order by at most one pass)."""
        if self._rb is None or self._rescue is None:
            raise RuntimeError("ring buffer not opened")
        if self._blocks is not None:
            self._rb.wait(timeout_ms)
            self._rb.drain(events.FLOW_EVENT_SIZE, *self._blocks)
            self._rescue.drain(events.FLOW_EVENT_SIZE, *self._blocks)
            return
        self._rb.poll(timeout_ms)
        self._rb.consume()
        self._rescue.consume()

    def kernel_lost(self) -> int:
        """Sum over CPUs of ``cilia_events_counters[0]``: events ``bpf_ringbuf_output``
        could write to neither ring."""
        return self._datapath.events_lost()

    def close(self) -> None:
        """Free the consumers (idempotent; the reader calls it after its poll thread ends)."""
        for rb in (self._rb, self._rescue):
            if rb is not None:
                rb.close()
        self._rb = self._rescue = None


class EventReader:
    """Moves datapath events into the flow ring (poll thread + event-loop consumer).

    Args:
        source: a :class:`RecordSource` (``LibbpfRingBuffer(datapath)`` in the agent).
        parser: event → Flow with enrichment.
        store: the flow ring the observer serves.
        metrics: where flows are counted (``None`` = not counted).
        queue_size: records allowed to wait for the event loop (>= 1, default 1000).
        poll_timeout_ms: poll timeout, bounds how long :meth:`stop` waits (>= 1).

    Raises:
        ValueError: ``queue_size`` or ``poll_timeout_ms`` < 1.
    """

    def __init__(
        self,
        source: RecordSource,
        parser: Parser,
        store: FlowStore,
        metrics: HubbleMetrics | None = None,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        poll_timeout_ms: int = DEFAULT_POLL_TIMEOUT_MS,
    ) -> None:
        if queue_size < 1:
            raise ValueError(f"hubble event queue size must be >= 1, got {queue_size}")
        if poll_timeout_ms < 1:
            raise ValueError(f"poll timeout must be >= 1 ms, got {poll_timeout_ms}")
        self.source = source
        self.parser = parser
        self.store = store
        self.metrics = metrics
        self.queue_size = queue_size
        self.poll_timeout_ms = poll_timeout_ms
        # Counters (read them from the loop; written under the lock by the poll thread).
        self.received = 0
        self.lost = 0
        self.kernel_lost = 0
        self.decode_errors = 0
        self.parse_errors = 0
        self.processed = 0
        self._lock = threading.Lock()
        # Hand-off items: (record, 0) for one record, (block, count) for a block.
        self._pending: deque[tuple[bytes, int]] = deque()
        self._pending_records = 0
        self._pending_lost = 0
        self._kernel_lost_seen = 0
        self._pending_kernel_lost = 0
        self._notified = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False

    # -- poll thread ---------------------------------------------------------------

    def _on_record(self, record: bytes) -> None:
        with self._lock:
            self.received += 1
            if self._pending_records >= self.queue_size:
                self._pending_lost += 1
                self.lost += 1
            else:
                self._pending.append((record, 0))
                self._pending_records += 1

    def _on_block(self, block: bytes, count: int) -> None:
        """A block of ``count`` records: as many as the queue has room for are queued, in
        order; the rest are dropped and counted."""
        with self._lock:
            self.received += count
            room = self.queue_size - self._pending_records
            if room < count:
                dropped = count - max(room, 0)
                self._pending_lost += dropped
                self.lost += dropped
                if room <= 0:
                    return
                block = block[: room * events.BLOCK_RECORD.size]
                count = room
            self._pending.append((block, count))
            self._pending_records += count

    def _poll_loop(self) -> None:
        assert self._loop is not None and self._wake is not None
        wake = self._wake
        while not self._stop.is_set():
            try:
                self.source.poll(self.poll_timeout_ms)
            except Exception:  # the thread must not die silently; the loop sees the log
                log.exception("hubble: ring buffer poll failed; retrying")
                self._stop.wait(self.poll_timeout_ms / 1000)
            kernel_lost = self._kernel_lost()
            with self._lock:
                self._pending_kernel_lost += kernel_lost
                notify = (
                    bool(self._pending) or self._pending_lost > 0 or self._pending_kernel_lost > 0
                ) and not self._notified
                if notify:
                    self._notified = True
            if notify:
                try:
                    self._loop.call_soon_threadsafe(wake.set)
                except RuntimeError:  # loop closed during shutdown
                    return

    def _kernel_lost(self) -> int:
        """Increase of the producer's lost-event count since the last call (poll thread)."""
        counter = getattr(self.source, "kernel_lost", None)
        if counter is None:
            return 0
        try:
            total = int(counter())
        except Exception:  # a map read failing must not stop the poll thread
            log.exception("hubble: reading the ring buffer's lost-event count failed")
            return 0
        delta = max(0, total - self._kernel_lost_seen)
        self._kernel_lost_seen = total
        return delta

    # -- event loop ----------------------------------------------------------------

    def _take(self) -> tuple[deque[tuple[bytes, int]], int, int]:
        with self._lock:
            batch, self._pending = self._pending, deque()
            self._pending_records = 0
            lost, self._pending_lost = self._pending_lost, 0
            kernel_lost, self._pending_kernel_lost = self._pending_kernel_lost, 0
            self._notified = False
        return batch, lost, kernel_lost

    async def _process(
        self, batch: deque[tuple[bytes, int]], lost: int, kernel_lost: int = 0
    ) -> None:
        if kernel_lost:  # written before the records of this batch could be
            self.kernel_lost += kernel_lost
            self.store.add_lost(flow_pb2.PERF_EVENT_RING_BUFFER, kernel_lost)
        shape_for = self.parser.shaper()
        offset = self.parser.clock.current_offset_ns()
        add = self.store.add_shape_net
        ntohs = socket.ntohs
        metrics = self.metrics if self.metrics is not None and self.metrics.enabled else None
        done = 0
        for data, count in batch:
            if count:
                records: Iterable[tuple[int, ...]] = events.BLOCK_KEYED.iter_unpack(data)
            elif len(data) == events.FLOW_EVENT_SIZE:
                records = (events.KEYED.unpack(data),)
            else:
                self.decode_errors += 1
                if self.decode_errors == 1 or self.decode_errors % 1000 == 0:
                    exc = EventDecodeError(len(data), events.FLOW_EVENT_SIZE)
                    log.error("hubble: %s (%d undecodable records so far)", exc, self.decode_errors)
                continue
            for record in records:
                try:
                    shape = shape_for(record)
                except Exception:  # a broken Resolver must not stop the reader
                    self.parse_errors += 1
                    if self.parse_errors == 1 or self.parse_errors % 1000 == 0:
                        log.exception(
                            "hubble: building a flow failed (%d so far)", self.parse_errors
                        )
                    continue
                # Keyed tuples (events.KEYED): ports in network byte order, swapped only
                # for a flow that is read or counted.
                add(record[0] + offset, shape, record[2], record[3])
                if metrics is not None:  # handlers read neither time nor uuid
                    metrics.flow_processed(shape.with_ports(ntohs(record[2]), ntohs(record[3])))
                done += 1
                if done == _YIELD_EVERY:
                    self.processed += done
                    done = 0
                    await asyncio.sleep(0)
        self.processed += done
        if lost:  # the dropped records came after the queued ones
            self.store.add_lost(flow_pb2.OBSERVER_EVENTS_QUEUE, lost)

    async def _consume(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._process(*self._take())
            if self._closing:
                return

    async def start(self) -> None:
        """Open the ring buffer, start the poll thread and the consumer task.

        Raises:
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("EventReader already started")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        open_blocks = getattr(self.source, "open_blocks", None)
        if open_blocks is None or not open_blocks(self._on_block, self._on_record):
            self.source.open(self._on_record)
        self._stop.clear()
        self._closing = False
        self._task = asyncio.create_task(self._consume(), name="hubble-event-consumer")
        self._thread = threading.Thread(target=self._poll_loop, name="hubble-ringbuf", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop polling (within ``poll_timeout_ms``), process what was queued, end the task."""
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
        if self._task is not None and self._wake is not None:
            self._closing = True
            self._wake.set()
            await self._task
            self._task = None
