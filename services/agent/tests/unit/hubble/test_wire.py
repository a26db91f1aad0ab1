"""Wire-first flows: the bytes :meth:`Parser.encode` builds are the responses the object path
builds, the flow store serves them to every reader as before, and the reader's blocks."""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2
from cilia_agent.hubble import events
from cilia_agent.hubble.enrich import MemoryResolver
from cilia_agent.hubble.flowstore import FlowStore
from cilia_agent.hubble.metrics import HubbleMetrics, parse_metrics
from cilia_agent.hubble.parser import Parser, random_uuid
from cilia_agent.hubble.reader import EventReader
from cilia_agent.hubble.ring import Ring

from . import helpers as h

ADDRESSES = (h.FRONTEND_IP, h.BACKEND_IP, h.OTHER_IP, h.REMOTE_IP, h.WORLD_IP, "10.9.9.9")
IDENTITIES = (h.FRONTEND_ID, h.BACKEND_ID, h.OTHER_ID, h.REMOTE_ID, 1, 2, 0, 77777)


@st.composite
def flow_events(draw: st.DrawFn) -> events.FlowEvent:
    """Any event the datapath may write, over the addresses and identities the resolver
    knows (and some it does not)."""
    dropped = draw(st.booleans())
    return events.FlowEvent(
        ts_ns=draw(st.integers(0, 2**63 - 1 - h.BOOT_OFFSET_NS)),
        saddr=draw(st.sampled_from(ADDRESSES)),
        daddr=draw(st.sampled_from(ADDRESSES)),
        sport=draw(st.integers(0, 65535)),
        dport=draw(st.integers(0, 65535)),
        proto=draw(st.sampled_from((events.IPPROTO_TCP, events.IPPROTO_UDP, 1, 47))),
        event_type=events.EVENT_DROP if dropped else events.EVENT_TRACE,
        verdict=events.VERDICT_DROPPED if dropped else events.VERDICT_FORWARDED,
        drop_reason=draw(st.sampled_from((133, 181, 0))) if dropped else 0,
        src_identity=draw(st.sampled_from(IDENTITIES)),
        dst_identity=draw(st.sampled_from(IDENTITIES)),
        ep_id=draw(st.sampled_from((h.FRONTEND_EP, h.BACKEND_EP, h.OTHER_EP, 0, 99))),
        ifindex=draw(st.sampled_from((100 + h.FRONTEND_EP, 100 + h.BACKEND_EP, 0))),
        length=draw(st.integers(0, 2**32 - 1)),
        direction=draw(st.sampled_from((events.DIR_INGRESS, events.DIR_EGRESS))),
        is_reply=draw(st.booleans()),
        tcp_flags=draw(st.integers(0, 255)),
    )


def object_path_response(
    p: Parser, ev: events.FlowEvent, uuid_: str
) -> observer_pb2.GetFlowsResponse:
    flow = p.parse(ev)
    flow.uuid = uuid_
    return observer_pb2.GetFlowsResponse(flow=flow, node_name=p.node_name, time=flow.time)


@settings(max_examples=150, deadline=None)
@given(evs=st.lists(flow_events(), min_size=1, max_size=8), ttl=st.sampled_from((1.0, 0.0)))
def test_encoded_bytes_parse_to_exactly_the_response_of_the_object_path(
    evs: list[events.FlowEvent], ttl: float
) -> None:
    """Repeating events (so shapes are reused with other ports and times) with and without
    templates: every encoding equals the object path's response but for its own uuid."""
    p = Parser(h.resolver(), h.NODE, h.parser().clock, template_ttl_s=ttl)
    for ev in evs + evs:
        wall, _shape, wire = p.encode(events.RECORD.unpack(ev.pack()))
        got = observer_pb2.GetFlowsResponse.FromString(wire)
        assert got == object_path_response(p, ev, got.flow.uuid)
        assert wall == got.time.ToNanoseconds()
        uuid_ = uuid.UUID(got.flow.uuid)
        assert (uuid_.version, uuid_.variant) == (4, uuid.RFC_4122)


@settings(max_examples=60, deadline=None)
@given(evs=st.lists(flow_events(), min_size=1, max_size=6))
def test_a_stored_shape_is_serialized_on_first_read_only_as_the_object_path_builds_it(
    evs: list[events.FlowEvent],
) -> None:
    """The reader stores shape, time and ports (:meth:`FlowStore.add_shape`); an entry
    nobody reads is never serialized, one that is read gives the object path's response
    (its enrichment as of the event: the resolver changing afterwards changes nothing)."""
    p = Parser(h.resolver(), h.NODE, h.parser().clock)
    store = FlowStore(63, node_name=h.NODE)
    entries = []
    for ev in evs:
        wall, shape = p.shape_of(events.RECORD.unpack(ev.pack()))
        entries.append((ev, store.add_shape(wall, shape, ev.sport, ev.dport)))
    assert all(entry._wire is None for _, entry in entries)
    expected = [object_path_response(p, ev, "") for ev, _ in entries]
    p.resolver = MemoryResolver(kernel_interface_names=False)  # every pod gone
    for (_, entry), want in zip(entries, expected, strict=True):
        got = observer_pb2.GetFlowsResponse.FromString(entry.wire)
        want.flow.uuid = got.flow.uuid
        assert got == want
        assert entry.wire is entry.wire  # made once, then kept


@settings(max_examples=100, deadline=None)
@given(
    evs=st.lists(flow_events(), min_size=1, max_size=8),
    ttl=st.sampled_from((1.0, 0.0)),
    blocks=st.booleans(),
)
def test_the_readers_keyed_records_give_exactly_the_object_paths_flows(
    evs: list[events.FlowEvent], ttl: float, blocks: bool
) -> None:
    """The reader unpacks records as keyed tuples (:data:`events.KEYED`, its template key six
    integers) and keeps ports in network order: each repeated event (shapes reused with
    other ports, lengths and times; ICMP echo or not) read back from the store equals the
    object path's response but for its uuid, from a block or record by record."""
    p = Parser(h.resolver(), h.NODE, h.parser().clock, template_ttl_s=ttl)
    store = FlowStore(63, node_name=h.NODE)
    reader = EventReader(BlockSource(), p, store)
    batch = (
        deque([(_block(evs + evs), 2 * len(evs))])
        if blocks
        else deque((ev.pack(), 0) for ev in evs + evs)
    )
    asyncio.run(reader._process(batch, 0))
    entries = list(store.ring.iter_range(0))
    assert len(entries) == 2 * len(evs) and reader.parse_errors == 0
    for ev, entry in zip(evs + evs, entries, strict=True):
        got = observer_pb2.GetFlowsResponse.FromString(entry.wire)
        assert got == object_path_response(p, ev, got.flow.uuid)


def test_icmp_echo_and_other_icmp_of_one_pair_get_their_own_shapes() -> None:
    """ICMP records that differ only in their id field (0: not an echo) are different
    flows to the reader, as to the object path."""
    evs = [h.event(proto=1, sport=s, dport=s) for s in (9, 0, 9, 0)]
    p = h.parser()
    store = FlowStore(63, node_name=h.NODE)
    asyncio.run(EventReader(BlockSource(), p, store)._process(deque([(_block(evs), 4)]), 0))
    for ev, entry in zip(evs, store.ring.iter_range(0), strict=True):
        got = observer_pb2.GetFlowsResponse.FromString(entry.wire)
        assert got == object_path_response(p, ev, got.flow.uuid)


def test_a_keyed_tuple_is_the_record_read_the_other_way() -> None:
    ev = h.event(proto=1, sport=9, dport=77, tcp_flags=0x12)
    keyed = events.KEYED.unpack(ev.pack())
    assert events.record_of_keyed(keyed) == events.RECORD.unpack(ev.pack())
    assert (keyed[4] >> events.KEYED_PROTO_SHIFT) & 0xFF == 1
    assert (keyed[2], keyed[3]) == events.RECORD.unpack(ev.pack())[3:5]  # network order


def test_every_event_gets_its_own_uuid_in_upstreams_text_form() -> None:
    many = [random_uuid() for _ in range(5000)]
    assert len(set(many)) == len(many)
    for text in many:
        parsed = uuid.UUID(text)
        assert str(parsed) == text and parsed.version == 4 and parsed.variant == uuid.RFC_4122


def _store_both_ways(evs: list[events.FlowEvent]) -> tuple[FlowStore, FlowStore]:
    wire_store = FlowStore(63, node_name=h.NODE)
    object_store = FlowStore(63, node_name=h.NODE)
    p = h.parser()
    for ev in evs:
        wall, shape = p.shape_of(events.RECORD.unpack(ev.pack()))
        entry = wire_store.add_shape(wall, shape, ev.sport, ev.dport)
        flow = p.parse(ev)
        flow.uuid = observer_pb2.GetFlowsResponse.FromString(entry.wire).flow.uuid
        object_store.add_flow(flow)
    return wire_store, object_store


async def _collect(store: FlowStore, batches: bool, **request: Any) -> list[Any]:
    from google.protobuf import json_format

    req = json_format.ParseDict(request, observer_pb2.GetFlowsRequest())
    if not batches:
        return [r async for r in store.get_flows(req)]
    out = []
    async for batch in store.get_flow_batches(req, 3):
        out.extend(observer_pb2.GetFlowsResponse.FromString(raw) for raw in batch.responses)
    return out


FILTERS: list[dict[str, Any]] = [
    {},
    {"whitelist": [{"source_pod": ["demo/frontend"]}]},
    {"whitelist": [{"destination_port": ["8080", "53"]}]},
    {"whitelist": [{"verdict": ["DROPPED"]}], "blacklist": [{"source_port": ["3"]}]},
    {"blacklist": [{"destination_label": ["k8s:app=backend"]}]},
    {"whitelist": [{"protocol": ["udp"]}, {"source_ip": ["10.200.0.30"]}], "number": 4},
    {"number": 3},
]


def test_filters_see_the_same_flows_in_both_stores() -> None:
    """Shape-level filter verdicts (pods, labels, verdicts, protocols, addresses) and per-event
    ones (ports) select the same flows from encoded entries as from flow objects, through
    GetFlows and through batches."""
    evs = [
        h.event(sport=1, dport=8080),
        h.dropped(sport=2, dport=8080),
        h.event(sport=3, dport=53, proto=events.IPPROTO_UDP),
        h.event(sport=3, dport=9999),
        h.dropped(sport=5, dport=53, proto=events.IPPROTO_UDP),
        h.event(
            saddr=h.BACKEND_IP,
            daddr=h.FRONTEND_IP,
            src_identity=h.BACKEND_ID,
            dst_identity=h.FRONTEND_ID,
            direction=events.DIR_INGRESS,
            sport=8080,
            dport=6,
            is_reply=True,
        ),
        h.event(proto=1, sport=7, dport=7),
    ]
    wire_store, object_store = _store_both_ways(evs)

    async def main() -> None:
        for request in FILTERS:
            for batches in (False, True):
                got = await _collect(wire_store, batches, **request)
                want = await _collect(object_store, batches, **request)
                assert got == want, request
                assert got, request

    asyncio.run(main())


def test_entries_decode_their_flow_once_and_feed_namespaces() -> None:
    store, _ = _store_both_ways([h.event(sport=1), h.event(sport=2, daddr=h.REMOTE_IP)])
    entry = store.ring.get(0)
    assert entry.flow is not None and entry.flow is entry.flow  # decoded once, kept
    assert entry.flow.l4.TCP.source_port == 1
    names = [n.namespace for n in store.namespaces.namespaces()]
    assert names == ["demo", "prod"]
    store.add_lost(flow_pb2.OBSERVER_EVENTS_QUEUE, 3)
    lost = store.ring.get(2)
    assert lost.flow is None
    assert observer_pb2.GetFlowsResponse.FromString(lost.wire).lost_events.num_events_lost == 3


def test_ring_items_are_the_range_across_the_wrap() -> None:
    ring: Ring[int] = Ring(7)
    for i in range(12):
        ring.write(i)
    assert ring.items(5, 12) == [5, 6, 7, 8, 9, 10, 11]
    assert ring.items(9, 9) == []
    for start, stop in ((4, 6), (10, 13)):
        try:
            ring.items(start, stop)
        except IndexError:
            continue
        raise AssertionError(f"[{start}, {stop}) accepted")


class BlockSource:
    """A source offering blocks, as the direct ring-buffer reader does."""

    def __init__(self) -> None:
        self.on_block: Any = None

    def open(self, on_record: Any) -> None:
        raise AssertionError("a block source is opened with open_blocks")

    def open_blocks(self, on_block: Any, on_record: Any) -> bool:
        self.on_block = on_block
        return True

    def poll(self, timeout_ms: int) -> None:
        pass


def _block(evs: list[events.FlowEvent]) -> bytes:
    header = (events.FLOW_EVENT_SIZE).to_bytes(4, "little") + bytes(4)
    return b"".join(header + ev.pack() for ev in evs)


def test_blocks_become_flows_and_what_the_queue_cannot_hold_is_lost_in_order() -> None:
    """A block of 5 records with room for 3 queues the first 3 and reports 2 lost after
    them (OBSERVER_EVENTS_QUEUE); metrics see decoded flows."""
    store = FlowStore(63, node_name=h.NODE)
    metrics = HubbleMetrics(CollectorRegistry(), handlers=parse_metrics("flow"))
    source = BlockSource()
    reader = EventReader(source, h.parser(), store, metrics, queue_size=3)

    async def main() -> None:
        reader._loop = asyncio.get_running_loop()
        reader._wake = asyncio.Event()
        reader.source.open_blocks(reader._on_block, reader._on_record)  # type: ignore[attr-defined]
        reader._on_block(_block([h.event(sport=k) for k in range(5)]), 5)
        reader._on_record(h.event(sport=9).pack())  # the queue is full: lost too
        await reader._process(*reader._take())
        reader._on_block(_block([h.dropped(sport=k) for k in (10, 11)]), 2)
        reader._on_record(b"\x00" * 12)  # not a flow_event: a decode error
        await reader._process(*reader._take())

    asyncio.run(main())
    entries = list(store.ring.iter_range(0))
    assert [e.flow.l4.TCP.source_port if e.flow else None for e in entries] == [
        0, 1, 2, None, 10, 11,
    ]  # fmt: skip
    assert entries[3].lost is not None
    assert (entries[3].lost.source, entries[3].lost.num_events_lost) == (
        flow_pb2.OBSERVER_EVENTS_QUEUE,
        3,
    )
    assert (reader.received, reader.processed, reader.lost, reader.decode_errors) == (9, 5, 3, 1)
    flows = metrics.flow_registry.get_sample_value(
        "hubble_flows_processed_total",
        {"protocol": "TCP", "type": "Drop", "subtype": "", "verdict": "DROPPED"},
    )
    assert flows == 2
    metrics.close()


def test_the_hand_off_queue_counts_records_not_blocks() -> None:
    reader = EventReader(BlockSource(), h.parser(), FlowStore(63, node_name=h.NODE), queue_size=4)
    reader._on_block(_block([h.event()] * 2), 2)
    reader._on_block(_block([h.event()] * 2), 2)
    reader._on_block(_block([h.event()]), 1)
    batch, lost, _ = reader._take()
    assert [count for _, count in batch] == [2, 2] and lost == 1
    assert isinstance(batch, deque)


def test_metrics_count_the_same_from_shapes_as_from_decoded_flows() -> None:
    """The reader hands handlers a shape's template with each event's ports: the counts
    (ports included) equal those of the decoded flows, many events sharing one shape."""
    spec = "flow,drop,tcp,port-distribution,flows-to-world:port;any-drop,icmp"
    evs = [h.event(sport=s, dport=d) for s in (1, 2) for d in (80, 443, 8080)]
    evs += [h.dropped(dport=d) for d in (22, 23)] + [h.event(proto=1, sport=9)]
    evs += [h.event(daddr=h.WORLD_IP, dst_identity=2, dport=d, tcp_flags=0x12) for d in (1, 2)]
    shaped = HubbleMetrics(CollectorRegistry(), handlers=parse_metrics(spec))
    reader = EventReader(BlockSource(), h.parser(), FlowStore(63, node_name=h.NODE), shaped)
    asyncio.run(reader._process(deque([(_block(evs), len(evs))]), 0))
    decoded = HubbleMetrics(CollectorRegistry(), handlers=parse_metrics(spec))
    p = h.parser()
    for ev in evs:
        decoded.flow_processed(p.parse(ev))
    counts = [dict(handler.counts) for handler in shaped.handlers]
    assert counts == [dict(handler.counts) for handler in decoded.handlers]
    assert (counts[3][("TCP", "443")], counts[3][("TCP", "1")]) == (2, 1)  # ports per event
    assert sum(counts[0].values()) == len(evs)
    shaped.close()
    decoded.close()
