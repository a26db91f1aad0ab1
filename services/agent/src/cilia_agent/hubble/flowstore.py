"""The flow store: the ring of serialized flows and lost events, its counters, and the reads
the Hubble APIs make of it (GetFlows windows and filters, flow batches, server status numbers).

GetFlows semantics follow upstream Hubble's local observer
(``pkg/hubble/observer/local_observer.go``, re-implemented):

- ``first`` and ``follow`` together, or ``number`` with ``since``/``until``: INVALID_ARGUMENT.
- Invalid or unsupported filters: INVALID_ARGUMENT (see :mod:`.filters`).
- ``first`` (without ``since``): start at the oldest flow; ``number`` caps the count
  (0 = all).
- ``follow`` with neither ``number`` nor ``since``: only flows written after the call.
- Otherwise the ring is scanned backwards from the newest flow counting flows that pass
  the filters until ``number`` of them were seen (or, with ``since``, until a flow
  older than ``since``); reading then proceeds forwards from there, oldest first.
  ``number`` = 0 without ``since`` returns the whole ring.
- ``until``: the stream ends at the first flow newer than ``until`` (also when following).
- Without ``follow`` the stream ends at the newest flow present when the call started.
- Lost events stored in the ring (reader queue overflow) are always sent; a reader that
  is overtaken by the writer receives a ``LostEvent`` with source HUBBLE_RING_BUFFER and
  the number of flows it missed, then continues with the oldest flow still held. When the
  entries it missed held lost events themselves, it first receives one ``LostEvent`` per
  source with their sum (each entry carries the store's running loss totals), so every
  loss reaches it with its source instead of counting as one missed entry.

The ring holds each flow as its serialized ``GetFlowsResponse``, built on the first read
(:attr:`RingEntry.wire`, :meth:`.parser.FlowShape.encode`) and kept: FlowBatchService sends
those bytes as they are; a Flow object is decoded from them only for a filter on ports or a
plain GetFlows response, and other filters are decided once per flow shape
(:func:`_entry_matcher`).

The gRPC servicers that serve these reads are in :mod:`.observer`.
"""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import AsyncIterator, Callable

from google.protobuf import timestamp_pb2, wrappers_pb2

from cilia.flowbatch.v1 import flowbatch_pb2
from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2
from cilia_agent.hubble.eventlog import NamespaceTracker, request_window
from cilia_agent.hubble.filters import FilterSet
from cilia_agent.hubble.parser import FlowShape, timestamp
from cilia_agent.hubble.ring import DEFAULT_CAPACITY, Ring

_ntohs, _htons = socket.ntohs, socket.htons

FLOWS_RATE_WINDOW_NS = 60 * 1_000_000_000

DEFAULT_MAX_BATCH = 256
"""Responses per ``FlowBatchService.GetFlowBatches`` message when the client asks for 0."""
MAX_BATCH_LIMIT = 4096
"""The most responses per batch a client may ask for (larger asks are capped)."""

# Keys of GetFlowsResponse's fields in the protobuf wire format: (number << 3) | 2
# (length-delimited), as varints: flow = 1, node_name = 1000, time = 1001.
_KEY_FLOW = b"\x0a"
_KEY_NODE_NAME = b"\xc2\x3e"
_KEY_TIME = b"\xca\x3e"


def _varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def node_name_wire(node_name: str) -> bytes:
    """The encoded ``node_name`` field (1000) of a GetFlowsResponse ("" encodes nothing)."""
    if not node_name:
        return b""
    raw = node_name.encode()
    return _KEY_NODE_NAME + _varint(len(raw)) + raw


def flow_response_wire(flow: flow_pb2.Flow, node_suffix: bytes) -> bytes:
    """``GetFlowsResponse(flow=flow, node_name=..., time=flow.time)`` in the protobuf wire
    format, from the flow's own serialization (about 2 µs instead of 12 µs for building the
    response message, which copies the flow). ``node_suffix``: :func:`node_name_wire`.
    Fields are written in field-number order, as protobuf serializers do."""
    body = flow.SerializeToString()
    out = _KEY_FLOW + _varint(len(body)) + body + node_suffix
    if flow.HasField("time"):
        ts = flow.time.SerializeToString()
        out += _KEY_TIME + _varint(len(ts)) + ts
    return out


LostTotals = tuple[tuple[int, int], ...]
"""Running totals of the lost events written to a store: ``((source, events), ...)``
sorted by source, plus ``(-1, entries)`` for the number of LostEvent entries."""

_ENTRIES = -1


def _add_lost(totals: LostTotals, source: int, count: int) -> LostTotals:
    merged = dict(totals)
    merged[source] = merged.get(source, 0) + count
    merged[_ENTRIES] = merged.get(_ENTRIES, 0) + 1
    return tuple(sorted(merged.items()))


class RingEntry:
    """One slot of the flow ring: a flow or a lost-events notice, with its wall time (ns),
    the store's lost-event totals before it was written (shared, not copied) and, for a
    flow, its serialized ``GetFlowsResponse`` (:attr:`wire`) and
    :class:`~.parser.FlowShape` (``None`` for flows added as objects). A flow added with its
    shape and ports (:meth:`FlowStore.add_shape`; ``ports`` are kept in network byte order)
    is serialized on the first read of
    :attr:`wire` (most flows of a busy node are overwritten unread, and never are); the
    Flow object is decoded from :attr:`wire` on first use of :attr:`flow`. Both are kept."""

    __slots__ = ("_flow", "_ports", "_wire", "lost", "lost_before", "shape", "time_ns")

    def __init__(
        self,
        time_ns: int,
        wire: bytes | None = b"",
        shape: FlowShape | None = None,
        lost: flow_pb2.LostEvent | None = None,
        lost_before: LostTotals = (),
        flow: flow_pb2.Flow | None = None,
        ports: tuple[int, int] = (0, 0),
    ) -> None:
        self.time_ns = time_ns
        self._wire = wire
        self._ports = ports
        self.shape = shape
        self.lost = lost
        self.lost_before = lost_before
        self._flow = flow

    @property
    def wire(self) -> bytes:
        """The serialized ``GetFlowsResponse`` (made on first read for a lazy entry)."""
        wire = self._wire
        if wire is None:
            assert self.shape is not None  # lazy entries have one
            sport, dport = self._ports
            wire = self._wire = self.shape.encode(self.time_ns, _ntohs(sport), _ntohs(dport))
        return wire

    @wire.setter
    def wire(self, value: bytes) -> None:
        self._wire = value

    @property
    def flow(self) -> flow_pb2.Flow | None:
        """The flow (None for a lost-events entry), decoded from :attr:`wire` once."""
        if self.lost is not None:
            return None
        flow = self._flow
        if flow is None:
            flow = self._flow = observer_pb2.GetFlowsResponse.FromString(self.wire).flow
        return flow

    def lost_after(self) -> LostTotals:
        """The store's lost-event totals once this entry was written."""
        if self.lost is None:
            return self.lost_before
        return _add_lost(self.lost_before, int(self.lost.source), int(self.lost.num_events_lost))


def _ts_ns(ts: timestamp_pb2.Timestamp) -> int:
    return int(ts.seconds) * 1_000_000_000 + int(ts.nanos)


class FlowStore:
    """The agent's flow ring plus the counters ServerStatus reports.

    Confined to one asyncio event loop (the reader writes, servicers read there).

    Args:
        capacity: ``--hubble-event-buffer-capacity`` (2^n-1 in 1..65535, default 4095).
        node_name: this node's name (stamped on every response).
        version: version string reported by ServerStatus/GetNodes.
        wall_clock_ns: wall clock (tests inject a fake one).
        on_lost: called with ``(LostEventSource, count)`` for every loss written to the
            store (:meth:`add_lost`) and with ``(HUBBLE_RING_BUFFER, 1)`` for every
            LostEvent sent to a follower the ring overtook (the agent counts them in
            ``hubble_lost_events_total``).

    Raises:
        InvalidCapacity: bad capacity.
    """

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        *,
        node_name: str,
        version: str = "",
        wall_clock_ns: Callable[[], int] = time.time_ns,
        on_lost: Callable[[int, int], None] | None = None,
    ) -> None:
        self.on_lost = on_lost
        self.ring: Ring[RingEntry] = Ring(capacity, time_of=lambda e: e.time_ns)
        self.node_name = node_name
        self.version = version
        self.seen_flows = 0
        self.namespaces = NamespaceTracker(wall_clock_ns=wall_clock_ns)
        self._wall = wall_clock_ns
        self._started = time.monotonic_ns()
        self.lost_totals: LostTotals = ()
        self._node_suffix = node_name_wire(node_name)

    def add_flow(self, flow: flow_pb2.Flow) -> None:
        """Append a flow object (O(1)); wakes every follower."""
        wire = flow_response_wire(flow, self._node_suffix)
        self.ring.write(RingEntry(_ts_ns(flow.time), wire, lost_before=self.lost_totals, flow=flow))
        self.seen_flows += 1
        self.namespaces.observe(flow)

    def add_shape(self, time_ns: int, shape: FlowShape, sport: int, dport: int) -> RingEntry:
        """Append a flow as :meth:`.parser.Parser.shape_of` returns it, with its L4 ports
        (host byte order), to be serialized when first read (:attr:`RingEntry.wire`); O(1),
        no Flow object, wakes every follower. The namespaces of a shape are recorded when
        the store first sees it (a shape lives at most the parser's template TTL, 1 s by
        default, plus one batch of records, so GetNamespaces' last-seen times are at most
        that old)."""
        return self.add_shape_net(time_ns, shape, _htons(sport), _htons(dport))

    def add_shape_net(
        self, time_ns: int, shape: FlowShape, sport_net: int, dport_net: int
    ) -> RingEntry:
        """:meth:`add_shape` with the ports in network byte order, as the datapath's records
        carry them (the reader's path: they are swapped only if the flow is ever read)."""
        entry = RingEntry(
            time_ns, None, shape, None, self.lost_totals, None, (sport_net, dport_net)
        )
        self.ring.write(entry)
        self.seen_flows += 1
        if not shape.stored:
            shape.stored = True
            self.namespaces.observe_names(shape.namespaces)
        return entry

    def add_lost(
        self, source: flow_pb2.LostEventSource, count: int, cpu: int | None = None
    ) -> None:
        """Append a LostEvent (e.g. reader queue overflow, source OBSERVER_EVENTS_QUEUE)."""
        lost = flow_pb2.LostEvent(source=source, num_events_lost=count)
        if cpu is not None:
            lost.cpu.CopyFrom(wrappers_pb2.Int32Value(value=cpu))
        entry = RingEntry(self._wall(), lost=lost, lost_before=self.lost_totals)
        entry.wire = self._lost_response(entry).SerializeToString()
        self.lost_totals = entry.lost_after()
        self.ring.write(entry)
        if self.on_lost is not None:
            self.on_lost(int(source), count)

    @property
    def uptime_ns(self) -> int:
        """Nanoseconds since the store was created."""
        return time.monotonic_ns() - self._started

    def flows_rate(self) -> float:
        """Flows per second over the last minute.

        When the ring no longer holds a full minute (it wrapped), the rate is taken over
        the time span it does hold, as upstream ``getFlowRate``.
        """
        now = self._wall()
        since = now - FLOWS_RATE_WINDOW_NS
        count = 0
        oldest_seen: int | None = None
        for _seq, entry in self.ring.iter_backward():
            if entry.lost is not None:
                continue
            if entry.time_ns < since:
                break
            count += 1
            oldest_seen = entry.time_ns
        else:
            if self.ring.written > self.ring.capacity and oldest_seen is not None:
                since = oldest_seen
        span = now - since
        return count / (span / 1e9) if span > 0 else 0.0

    def status(self) -> observer_pb2.ServerStatusResponse:
        """The ServerStatus answer for this node."""
        return observer_pb2.ServerStatusResponse(
            num_flows=len(self.ring),
            max_flows=self.ring.capacity,
            seen_flows=self.seen_flows,
            uptime_ns=self.uptime_ns,
            version=self.version,
            flows_rate=self.flows_rate(),
        )

    # -- GetFlows -------------------------------------------------------------

    def _start_seq(
        self, req: observer_pb2.GetFlowsRequest, filters: FilterSet, since_ns: int | None
    ) -> int:
        ring = self.ring
        if req.first and since_ns is None:
            return ring.oldest
        if req.follow and req.number == 0 and since_ns is None:
            return ring.next_seq
        if req.number == 0 and since_ns is None:
            return ring.oldest
        start = ring.next_seq
        count = 0
        match = _entry_matcher(filters)
        for seq, entry in ring.iter_backward():
            if entry.lost is not None:
                continue
            if since_ns is not None:
                if entry.time_ns < since_ns:
                    break
                start = seq
                continue
            if match is not None and not match(entry):
                continue
            start = seq
            count += 1
            if count == req.number:
                break
        return start

    def get_flows(
        self, req: observer_pb2.GetFlowsRequest
    ) -> AsyncIterator[observer_pb2.GetFlowsResponse]:
        """Stream the responses of one GetFlows request (see module docstring).

        Raises:
            InvalidRequest: incompatible options (first+follow, number+since/until),
                raised before anything is sent.
            InvalidFilter: a whitelist/blacklist filter is invalid or unsupported.
        """
        return _decoded(self.get_flows_wire(req))

    def get_flows_wire(self, req: observer_pb2.GetFlowsRequest) -> AsyncIterator[bytes]:
        """The :meth:`get_flows` stream of ``req`` as serialized responses: a flow's are the
        bytes the ring holds (nothing decoded, nothing encoded again).

        Raises:
            InvalidRequest, InvalidFilter: as :meth:`get_flows`, before anything is sent.
        """
        since_ns, until_ns = request_window(req)
        filters = FilterSet(req.whitelist, req.blacklist)
        return self._stream_wire(req, filters, since_ns, until_ns)

    async def _stream_wire(
        self,
        req: observer_pb2.GetFlowsRequest,
        filters: FilterSet,
        since_ns: int | None,
        until_ns: int | None,
    ) -> AsyncIterator[bytes]:
        # One item per chunk: the ring is read as the client takes responses, so a slow
        # client is overtaken by the writer (and told so) rather than served a snapshot.
        async for chunk in self._walk(req, filters, since_ns, until_ns, 1):
            for item in chunk:
                yield item.wire if isinstance(item, RingEntry) else item.SerializeToString()

    def get_flow_batches(
        self, req: observer_pb2.GetFlowsRequest, max_batch: int = DEFAULT_MAX_BATCH
    ) -> AsyncIterator[flowbatch_pb2.GetFlowBatchesResponse]:
        """The :meth:`get_flows` stream of ``req`` as batches of serialized responses.

        A batch holds every response ready when the stream would otherwise wait for new
        flows, or ``max_batch`` of them (>= 1), whichever comes first; an empty batch is
        never sent. A flow's response is the bytes the ring holds (:attr:`RingEntry.wire`:
        built on the first read and kept, whoever reads it).

        Raises:
            InvalidRequest, InvalidFilter: as :meth:`get_flows`, before anything is sent.
        """
        since_ns, until_ns = request_window(req)
        filters = FilterSet(req.whitelist, req.blacklist)
        return self._batches(req, filters, since_ns, until_ns, max(1, max_batch))

    async def _batches(
        self,
        req: observer_pb2.GetFlowsRequest,
        filters: FilterSet,
        since_ns: int | None,
        until_ns: int | None,
        max_batch: int,
    ) -> AsyncIterator[flowbatch_pb2.GetFlowBatchesResponse]:
        async for chunk in self._walk(req, filters, since_ns, until_ns, max_batch):
            responses: list[bytes] = []
            times: list[int] = []
            kinds: list[bool] = []
            for item in chunk:
                if isinstance(item, RingEntry):
                    responses.append(item.wire)
                    times.append(item.time_ns)
                    kinds.append(True)
                else:
                    responses.append(item.SerializeToString())
                    times.append(_ts_ns(item.time))
                    kinds.append(False)
            yield flowbatch_pb2.GetFlowBatchesResponse(
                responses=responses, times_ns=times, flows=kinds
            )

    def _lost_response(self, entry: RingEntry) -> observer_pb2.GetFlowsResponse:
        return observer_pb2.GetFlowsResponse(
            lost_events=entry.lost, node_name=self.node_name, time=timestamp(entry.time_ns)
        )

    async def _walk(
        self,
        req: observer_pb2.GetFlowsRequest,
        filters: FilterSet,
        since_ns: int | None,
        until_ns: int | None,
        chunk_max: int,
    ) -> AsyncIterator[list[RingEntry | observer_pb2.GetFlowsResponse]]:
        """The stream of one GetFlows request in chunks of at most ``chunk_max`` items (a
        flow entry that passes, or a lost-events response); a chunk also ends where the
        stream waits for new entries (a batch boundary). No chunk is empty."""
        ring = self.ring
        seq = self._start_seq(req, filters, since_ns)
        end = ring.next_seq
        limit = 0 if req.follow else req.number
        sent = 0
        match = _entry_matcher(filters)
        out: list[RingEntry | observer_pb2.GetFlowsResponse] = []
        # The store's lost-event totals up to the entry before ``seq``.
        seen = ring.get(seq).lost_before if ring.oldest <= seq < ring.next_seq else self.lost_totals
        while True:
            oldest = ring.oldest
            if seq < oldest:
                before = ring.get(oldest).lost_before
                missed = dict(before)
                for source, count in seen:
                    missed[source] = missed.get(source, 0) - count
                entries = missed.pop(_ENTRIES, 0)
                now = timestamp(self._wall())
                for source, count in missed.items():  # losses inside the missed entries
                    if count > 0:
                        out.append(
                            observer_pb2.GetFlowsResponse(
                                lost_events=flow_pb2.LostEvent(
                                    source=source,  # type: ignore[arg-type]  # a LostEventSource
                                    num_events_lost=count,
                                ),
                                node_name=self.node_name,
                                time=now,
                            )
                        )
                if oldest - seq - entries > 0:
                    if self.on_lost is not None:
                        self.on_lost(flow_pb2.HUBBLE_RING_BUFFER, 1)
                    out.append(
                        observer_pb2.GetFlowsResponse(
                            lost_events=flow_pb2.LostEvent(
                                source=flow_pb2.HUBBLE_RING_BUFFER,
                                num_events_lost=oldest - seq - entries,
                            ),
                            node_name=self.node_name,
                            time=now,
                        )
                    )
                seq, seen = oldest, before
                if len(out) >= chunk_max:
                    yield out
                    out = []
                continue
            stop = ring.next_seq if req.follow else end
            if seq >= stop:
                if out:
                    yield out
                    out = []
                if not req.follow:
                    return
                await ring.wait_beyond(seq)
                continue
            # Entries [seq, stop) are read without suspending, so none is overwritten
            # meanwhile; the chunk is handed over when full.
            for entry in ring.items(seq, min(stop, seq + chunk_max - len(out))):
                seq += 1
                if entry.lost is not None:
                    seen = entry.lost_after()
                    out.append(self._lost_response(entry))
                    continue
                if until_ns is not None and entry.time_ns > until_ns:
                    if out:
                        yield out
                    return
                if since_ns is not None and entry.time_ns < since_ns:
                    continue
                if match is not None and not match(entry):
                    continue
                out.append(entry)
                sent += 1
                if limit and sent >= limit:
                    yield out
                    return
            if len(out) >= chunk_max:
                yield out
                out = []


_matcher_ids = itertools.count(1)


def _entry_matcher(filters: FilterSet) -> Callable[[RingEntry], bool] | None:
    """A predicate on flow entries for ``filters`` (None: every flow passes). Filters that
    read no per-event field (see :attr:`FilterSet.reads_ports`) are decided once per
    :class:`~.parser.FlowShape` on its template, the verdict kept on the shape under this
    matcher's own number (so it goes away with the shape); others decode the entry's Flow."""
    if filters.empty:
        return None
    matches = filters.matches
    if filters.reads_ports:
        return lambda entry: matches(entry.flow)  # type: ignore[arg-type]  # a flow entry
    token = next(_matcher_ids)

    def match(entry: RingEntry) -> bool:
        shape = entry.shape
        if shape is None:
            return matches(entry.flow)  # type: ignore[arg-type]  # a flow entry
        verdict = shape.verdicts.get(token)
        if verdict is None:
            verdict = shape.verdicts[token] = matches(shape.template)
        return verdict

    return match


async def _decoded(wire: AsyncIterator[bytes]) -> AsyncIterator[observer_pb2.GetFlowsResponse]:
    """Each serialized response of ``wire`` as a message."""
    async for data in wire:
        yield observer_pb2.GetFlowsResponse.FromString(data)
