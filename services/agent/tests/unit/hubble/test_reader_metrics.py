"""Reader pipeline (records → flows → ring, lost accounting) and the metrics it feeds."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2
from cilia_agent.hubble import events
from cilia_agent.hubble.fake import FakeSource
from cilia_agent.hubble.flowstore import FlowStore
from cilia_agent.hubble.metrics import CounterReading, HubbleMetrics, parse_metrics
from cilia_agent.hubble.reader import EventReader

from . import helpers as h


async def wait_until(predicate: object, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


def pipeline(queue_size: int = 1000) -> tuple[FakeSource, FlowStore, HubbleMetrics, EventReader]:
    source = FakeSource()
    store = FlowStore(63, node_name=h.NODE)
    metrics = HubbleMetrics(CollectorRegistry(), handlers=parse_metrics("flow"))
    reader = EventReader(
        source, h.parser(), store, metrics, queue_size=queue_size, poll_timeout_ms=10
    )
    return source, store, metrics, reader


def test_records_become_flows_in_the_ring_and_are_counted() -> None:
    async def main() -> tuple[FlowStore, HubbleMetrics, EventReader]:
        source, store, metrics, reader = pipeline()
        await reader.start()
        source.batches.put([h.event(sport=1).pack(), h.dropped(sport=2).pack()])
        await wait_until(lambda: store.seen_flows == 2)
        source.batches.put([h.event(sport=3).pack()])
        await wait_until(lambda: store.seen_flows == 3)
        await reader.stop()
        return store, metrics, reader

    store, metrics, reader = h.run(main())
    flows = [e.flow for e in store.ring.iter_range(0)]
    assert [f.l4.TCP.source_port for f in flows if f] == [1, 2, 3]
    assert [f.verdict for f in flows if f] == [
        flow_pb2.FORWARDED,
        flow_pb2.DROPPED,
        flow_pb2.FORWARDED,
    ]
    assert (reader.received, reader.processed, reader.lost) == (3, 3, 0)
    # the `flow` handler counts them on Hubble's own registry, not the agent's
    sample = metrics.flow_registry.get_sample_value
    labels = {
        "protocol": "TCP",
        "type": "Trace",
        "subtype": "from-endpoint",
        "verdict": "FORWARDED",
    }
    assert sample("hubble_flows_processed_total", labels) == 2
    labels = {"protocol": "TCP", "type": "Drop", "subtype": "", "verdict": "DROPPED"}
    assert sample("hubble_flows_processed_total", labels) == 1
    assert metrics.registry.get_sample_value("hubble_flows_processed_total", labels) is None


def test_full_queue_drops_records_and_stores_one_lost_event() -> None:
    async def main() -> tuple[FlowStore, EventReader]:
        source, store, _metrics, reader = pipeline(queue_size=3)
        await reader.start()
        source.batches.put([h.event(sport=k).pack() for k in range(10)])  # one poll, 10 records
        await wait_until(lambda: len(store.ring) == 4)
        await reader.stop()
        return store, reader

    store, reader = h.run(main())
    entries = list(store.ring.iter_range(0))
    assert [e.flow.l4.TCP.source_port for e in entries[:3] if e.flow] == [0, 1, 2]
    lost = entries[3].lost
    assert lost is not None
    assert (lost.source, lost.num_events_lost) == (flow_pb2.OBSERVER_EVENTS_QUEUE, 7)
    assert (reader.received, reader.lost, reader.processed) == (10, 7, 3)


class CountingSource(FakeSource):
    """FakeSource whose producer also reports events it could not write (cumulative)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost_total = 0

    def kernel_lost(self) -> int:
        return self.lost_total


def test_ring_buffer_losses_are_stored_as_lost_events_with_their_source() -> None:
    async def main() -> tuple[FlowStore, EventReader]:
        source = CountingSource()
        store = FlowStore(63, node_name=h.NODE)
        reader = EventReader(source, h.parser(), store, poll_timeout_ms=10)
        await reader.start()
        source.lost_total = 5
        source.batches.put([h.event(sport=1).pack()])
        await wait_until(lambda: len(store.ring) == 2)
        source.lost_total = 12  # 7 more; the count is cumulative
        await wait_until(lambda: len(store.ring) == 3)
        await reader.stop()
        return store, reader

    store, reader = h.run(main())
    lost = [e.lost for e in store.ring.iter_range(0) if e.lost is not None]
    assert [(ev.source, ev.num_events_lost) for ev in lost] == [
        (flow_pb2.PERF_EVENT_RING_BUFFER, 5),
        (flow_pb2.PERF_EVENT_RING_BUFFER, 7),
    ]
    assert reader.kernel_lost == 12 and store.seen_flows == 1


def test_undecodable_records_are_counted_and_skipped() -> None:
    async def main() -> tuple[FlowStore, EventReader]:
        source, store, _metrics, reader = pipeline()
        await reader.start()
        source.batches.put([b"\x00" * 40, h.event().pack()])
        await wait_until(lambda: store.seen_flows == 1)
        await reader.stop()
        return store, reader

    store, reader = h.run(main())
    assert reader.decode_errors == 1 and store.seen_flows == 1


def test_stop_flushes_records_already_queued() -> None:
    async def main() -> FlowStore:
        source, store, _metrics, reader = pipeline()
        await reader.start()
        source.batches.put([h.event().pack()] * 5)
        await asyncio.to_thread(lambda: time.sleep(0.05))  # the loop is busy elsewhere
        await reader.stop()
        return store

    assert h.run(main()).seen_flows == 5


def test_reader_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="queue size"):
        EventReader(FakeSource(), h.parser(), FlowStore(7, node_name="n"), queue_size=0)


def test_datapath_counters_are_exported_with_upstream_names_and_reason_texts() -> None:
    metrics = HubbleMetrics(CollectorRegistry())
    metrics.update_datapath_counters(
        [
            CounterReading(0, events.DIR_EGRESS, packets=[3, 4], bytes=[300, 400]),
            CounterReading(0, events.DIR_INGRESS, packets=[1, 0], bytes=[60, 0]),
            CounterReading(133, events.DIR_INGRESS, packets=[2, 5], bytes=[120, 300]),
            CounterReading(181, events.DIR_EGRESS, packets=[1, 1], bytes=[60, 60]),
        ]
    )
    sample = metrics.registry.get_sample_value
    assert sample("cilium_forward_count_total", {"direction": "EGRESS"}) == 7
    assert sample("cilium_forward_bytes_total", {"direction": "EGRESS"}) == 700
    assert sample("cilium_forward_count_total", {"direction": "INGRESS"}) == 1
    assert (
        sample("cilium_drop_count_total", {"reason": "Policy denied", "direction": "INGRESS"}) == 7
    )
    denylist = {"reason": "Policy denied by denylist", "direction": "EGRESS"}
    assert sample("cilium_drop_count_total", denylist) == 2
    assert sample("cilium_drop_bytes_total", denylist) == 120

    # a later read replaces (does not add to) the exported values
    metrics.update_datapath_counters([CounterReading(0, events.DIR_EGRESS, [10], [1000])])
    assert sample("cilium_forward_count_total", {"direction": "EGRESS"}) == 10
    assert sample("cilium_drop_count_total", denylist) is None
    assert b"# TYPE cilium_drop_count_total counter" in generate_latest(metrics.registry)


def test_metrics_live_in_the_given_registry_and_can_be_unregistered() -> None:
    registry = CollectorRegistry()
    first = HubbleMetrics(registry)
    first.close()
    HubbleMetrics(registry)  # no duplicate-timeseries error after close()
    HubbleMetrics(CollectorRegistry())  # independent registries never clash


def test_lost_events_total_counts_every_source_as_upstream_labels_it() -> None:
    """Kernel ring buffer full (7), hand-off queue full (7), and one follower overtaken by
    the ring: ``hubble_lost_events_total{source}`` on Hubble's registry, with no handler
    enabled, read back through the Prometheus text-format parser."""

    async def main() -> HubbleMetrics:
        source = CountingSource()
        metrics = HubbleMetrics(CollectorRegistry())
        store = FlowStore(7, node_name=h.NODE, on_lost=metrics.events_lost)
        reader = EventReader(source, h.parser(), store, metrics, queue_size=3, poll_timeout_ms=10)
        follower = store.get_flows(observer_pb2.GetFlowsRequest(follow=True))
        first = asyncio.ensure_future(anext(follower))
        await asyncio.sleep(0)  # the follower waits at the ring's end
        await reader.start()
        source.lost_total = 7
        source.batches.put([h.event(sport=k).pack() for k in range(10)])
        await wait_until(lambda: store.ring.written == 5)  # 2 losses + 3 flows
        await reader.stop()
        for k in range(10):  # the ring (7) wraps past the waiting follower
            store.add_flow(h.parser().parse(h.event(sport=k)))
        # the follower got the first entry (the kernel's loss), then the losses inside
        # the entries it missed (the queue's, not counted again) and the ring's notice
        assert (await first).lost_events.source == flow_pb2.PERF_EVENT_RING_BUFFER
        missed = [(await anext(follower)).lost_events.source for _ in range(2)]
        assert missed == [flow_pb2.OBSERVER_EVENTS_QUEUE, flow_pb2.HUBBLE_RING_BUFFER]
        return metrics

    metrics = h.run(main())
    text = generate_latest(metrics.flow_registry).decode()
    samples = {
        s.labels["source"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "hubble_lost_events"
        for s in family.samples
        if s.name == "hubble_lost_events_total"
    }
    assert samples == {
        "perf_event_ring_buffer": 7,
        "observer_events_queue": 7,
        "hubble_ring_buffer": 1,
    }
    assert metrics.registry.get_sample_value("hubble_lost_events_total", {"source": "x"}) is None
