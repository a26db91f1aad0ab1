"""The real datapath → Hubble: bpf_lxc.o loaded by the agent's loader, packets through
BPF_PROG_TEST_RUN, ring-buffer events read by the Hubble reader into enriched flows.

Maps are pinned under a fresh ``/sys/fs/bpf/cilia-test-<rand>`` and removed afterwards.
Under test run the programs see the packet on the loopback device (ifindex 1), so the
endpoint under test is registered for ifindex 1 (cilia_agent.testing.bpf).
"""

from __future__ import annotations

import asyncio
import ctypes
import pathlib
import time
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from cilia.hubble.flow import flow_pb2
from cilia_agent.datapath.loader import Datapath, DatapathConfig, remove_pins
from cilia_agent.hubble.enrich import MemoryResolver
from cilia_agent.hubble.metrics import parse_metrics, read_counters
from cilia_agent.hubble.service import Hubble, HubbleConfig
from cilia_agent.testing import bpf as harness  # map layouts + packet builder
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

BPF_DIR = harness.BPF_DIR

POD, PEER, OUTSIDE = "10.251.0.10", "10.251.0.20", "198.51.100.7"
EP_ID, POD_ID, PEER_ID = 42, 1000, 1001
FROM, TO = "cil_from_container", "cil_to_container"


class Loaded:
    def __init__(self, agent: Datapath, progs: dict[str, int]) -> None:
        self.agent = agent
        self.progs = progs

    def run(self, prog: str, frame: bytes, repeat: int = 1) -> int:
        """One BPF_PROG_TEST_RUN of ``repeat`` runs (no ring-buffer polling here: the Hubble
        reader polls)."""
        buf = ctypes.create_string_buffer(frame, len(frame))
        opts = harness._TestRunOpts(
            sz=ctypes.sizeof(harness._TestRunOpts),
            data_in=ctypes.cast(buf, ctypes.c_void_p),
            data_size_in=len(frame),
            repeat=repeat,
        )
        if harness._test_run(self.progs[prog], ctypes.byref(opts)) != 0:
            raise OSError(ctypes.get_errno(), f"BPF_PROG_TEST_RUN failed for {prog}")
        return int(opts.retval)


@pytest.fixture
def datapath() -> Iterator[Loaded]:
    skips.require_bpf("BPF_PROG_TEST_RUN")
    pin_dir = pathlib.Path("/sys/fs/bpf") / f"cilia-test-{uuid.uuid4().hex[:8]}"
    config = DatapathConfig(bpf_dir=BPF_DIR, pin_dir=pin_dir, ipcache_max=1024, ct_max=1024)
    try:
        agent = Datapath.load(config)
        try:
            yield Loaded(agent, {name: agent.prog_fd(name) for name in (FROM, TO)})
        finally:
            agent.close()
    finally:
        remove_pins(pin_dir)


def program_datapath(dp: Loaded) -> None:
    dp.agent.set_endpoint(
        1,
        harness.EndpointInfo(
            ep_id=EP_ID, sec_identity=POD_ID, ipv4=harness.ip_to_map(POD), enforce_egress=1
        ),
    )
    ipcache = dp.agent.ipcache_map
    ipcache[harness.IpcacheKey(32, harness.ip_to_map(POD))] = harness.IpcacheValue(POD_ID, 0)
    ipcache[harness.IpcacheKey(32, harness.ip_to_map(PEER))] = harness.IpcacheValue(PEER_ID, 0)
    key = harness.PolicyKey(96, EP_ID, PEER_ID, harness.DIR_EGRESS, 6, harness.port_to_map(8080))
    dp.agent.policy_map[key] = harness.PolicyValue(flags=0)


def resolver() -> MemoryResolver:
    r = MemoryResolver()
    labels = ["k8s:app=frontend", "k8s:io.kubernetes.pod.namespace=demo"]
    r.set_endpoint(
        EP_ID, ipv4=POD, identity=POD_ID, namespace="demo", pod_name="frontend", labels=labels
    )
    r.set_identity(POD_ID, labels)
    r.set_ipcache(f"{PEER}/32", PEER_ID, owner="demo/backend")
    r.set_identity(PEER_ID, ["k8s:app=backend", "k8s:io.kubernetes.pod.namespace=demo"])
    return r


def test_ring_buffer_events_become_enriched_flows_with_verdicts(datapath: Loaded) -> None:
    program_datapath(datapath)

    async def main() -> tuple[list[flow_pb2.Flow], Hubble]:
        hubble = Hubble(
            HubbleConfig(
                node_name="node-t",
                capacity=63,
                poll_timeout_ms=20,
                metrics=tuple(parse_metrics("flow")),
            ),
            resolver=resolver(),
            registry=CollectorRegistry(),
        )
        await hubble.start_reader(datapath.agent)
        try:
            assert datapath.run(FROM, harness.packet(POD, PEER, dport=8080)) == harness.TC_ACT_OK
            assert datapath.run(FROM, harness.packet(POD, PEER, dport=9090)) == harness.TC_ACT_SHOT
            frame = harness.packet(OUTSIDE, POD, proto="udp", sport=53, dport=5353)
            assert datapath.run(TO, frame) == harness.TC_ACT_OK
            deadline = time.monotonic() + 5
            while hubble.store.seen_flows < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            await hubble.stop()
        flows = [e.flow for e in hubble.store.ring.iter_range(0) if e.flow is not None]
        return flows, hubble

    before = time.time_ns()
    flows, hubble = asyncio.run(main())
    assert len(flows) == 3
    allowed, denied, inbound = flows

    assert allowed.verdict == flow_pb2.FORWARDED
    assert (allowed.source.pod_name, allowed.source.identity, allowed.source.ID) == (
        "frontend",
        POD_ID,
        EP_ID,
    )
    assert (allowed.destination.namespace, allowed.destination.pod_name) == ("demo", "backend")
    assert allowed.destination.identity == PEER_ID
    assert allowed.l4.TCP.destination_port == 8080 and allowed.l4.TCP.flags.SYN
    assert allowed.traffic_direction == flow_pb2.EGRESS
    assert allowed.trace_observation_point == flow_pb2.TO_STACK  # PEER is no pod of this node
    assert (allowed.interface.index, allowed.interface.name) == (1, "lo")
    # the monotonic kernel stamp became wall-clock time of this test run
    assert before - 1_000_000_000 < allowed.time.ToNanoseconds() < time.time_ns() + 1_000_000_000

    assert denied.verdict == flow_pb2.DROPPED
    assert (denied.drop_reason, denied.drop_reason_desc) == (133, flow_pb2.POLICY_DENIED)
    assert (denied.source.identity, denied.destination.identity) == (POD_ID, PEER_ID)
    assert denied.l4.TCP.destination_port == 9090

    assert inbound.verdict == flow_pb2.FORWARDED
    assert (inbound.source.identity, list(inbound.source.labels)) == (2, ["reserved:world"])
    assert inbound.destination.pod_name == "frontend"
    assert inbound.traffic_direction == flow_pb2.INGRESS
    assert inbound.l4.UDP.destination_port == 5353

    hubble.metrics.update_datapath_counters(read_counters(datapath.agent.metrics_map))
    sample = hubble.metrics.registry.get_sample_value
    drop_labels = {"reason": "Policy denied", "direction": "EGRESS"}
    assert sample("cilium_drop_count_total", drop_labels) == 1
    assert sample("cilium_forward_count_total", {"direction": "EGRESS"}) == 1
    assert sample("cilium_forward_count_total", {"direction": "INGRESS"}) == 1
    processed = {"protocol": "TCP", "type": "Drop", "subtype": "", "verdict": "DROPPED"}
    assert (
        hubble.metrics.flow_registry.get_sample_value("hubble_flows_processed_total", processed)
        == 1
    )


def test_the_reader_delivers_what_the_rescue_ring_took_and_reports_no_loss() -> None:
    """A one-page ring (73 records) and a burst of 100 drops before any reader runs: 73 land
    in the main ring, 27 in the rescue ring; Hubble's reader, started then, delivers all 100
    flows with no LostEvent."""
    skips.require_bpf("BPF_PROG_TEST_RUN")
    pin_dir = pathlib.Path("/sys/fs/bpf") / f"cilia-test-{uuid.uuid4().hex[:8]}"
    config = DatapathConfig(
        bpf_dir=BPF_DIR, pin_dir=pin_dir, ipcache_max=1024, ct_max=1024, events_pages=1,
        events_wakeup_events=1 << 20,
    )  # fmt: skip

    async def read_all(dp: Loaded) -> Hubble:
        hubble = Hubble(
            HubbleConfig(node_name="node-t", capacity=255, poll_timeout_ms=20),
            resolver=resolver(),
            registry=CollectorRegistry(),
        )
        await hubble.start_reader(dp.agent)
        try:
            deadline = time.monotonic() + 5
            while hubble.store.seen_flows < 100 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            await hubble.stop()
        return hubble

    try:
        agent = Datapath.load(config)
        try:
            dp = Loaded(agent, {name: agent.prog_fd(name) for name in (FROM, TO)})
            program_datapath(dp)
            drop = harness.packet(POD, PEER, dport=9090)
            assert dp.run(FROM, drop, repeat=100) == harness.TC_ACT_SHOT
            assert (agent.events_rescued(), agent.events_lost()) == (27, 0)
            hubble = asyncio.run(read_all(dp))
        finally:
            agent.close()
    finally:
        remove_pins(pin_dir)
    entries = list(hubble.store.ring.iter_range(0))
    assert [e.flow is not None for e in entries].count(True) == 100, entries[-3:]
    assert all(e.flow.verdict == flow_pb2.DROPPED for e in entries if e.flow is not None)
    assert all(e.lost is None for e in entries), [e for e in entries if e.flow is None]


def test_direct_ring_buffer_reads_keep_order_across_wraps_and_share_the_position_with_libbpf() -> (
    None
):
    """A one-page ring (73 records of 56 bytes): drops written in rounds of 50 are read by
    :meth:`RingBuffer.drain` in order while the ring wraps several times; a round of 100
    fills it (what did not fit is in the rescue ring, in order); libbpf's consume then
    reads on from the position the direct reads left, and they from its position."""
    from cilia_agent.datapath.objects import DIRECT_READ_SUPPORTED
    from cilia_agent.hubble import events

    skips.require_bpf("BPF_PROG_TEST_RUN")
    if not DIRECT_READ_SUPPORTED:
        pytest.skip("direct ring-buffer reads are implemented for x86-64 only")
    pin_dir = pathlib.Path("/sys/fs/bpf") / f"cilia-test-{uuid.uuid4().hex[:8]}"
    config = DatapathConfig(
        bpf_dir=BPF_DIR, pin_dir=pin_dir, ipcache_max=1024, ct_max=1024, events_pages=1
    )
    try:
        agent = Datapath.load(config)
        try:
            dp = Loaded(agent, {name: agent.prog_fd(name) for name in (FROM, TO)})
            program_datapath(dp)
            by_callback: list[bytes] = []
            rb = agent.ring_buffer(by_callback.append)
            got: list[int] = []

            def on_block(block: bytes, count: int) -> None:
                records = list(events.BLOCK_RECORD.iter_unpack(block))
                assert len(records) == count
                got.extend(events.from_tuple(r).dport for r in records)

            def drops(first: int, n: int) -> list[int]:
                for port in range(first, first + n):
                    frame = harness.packet(POD, PEER, dport=port)
                    assert dp.run(FROM, frame) == harness.TC_ACT_SHOT
                return list(range(first, first + n))

            want: list[int] = []
            for round_ in range(6):  # 300 records through a ring of 73
                want += drops(10000 + 50 * round_, 50)
                assert rb.drain(events.FLOW_EVENT_SIZE, on_block, by_callback.append) == 50
            assert got == want and by_callback == []

            lost_before, rescued_before = agent.events_lost(), agent.events_rescued()
            drops(20000, 100)
            assert rb.drain(events.FLOW_EVENT_SIZE, on_block, by_callback.append) == 73
            assert got[-73:] == list(range(20000, 20073))
            # what the full ring refused is in the rescue ring, none lost
            assert agent.events_rescued() - rescued_before == 27
            assert agent.events_lost() == lost_before
            rescue = agent.ring_buffer(by_callback.append, rescue=True)
            assert rescue.drain(events.FLOW_EVENT_SIZE, on_block, by_callback.append) == 27
            assert got[-27:] == list(range(20073, 20100))
            rescue.close()

            drops(30000, 5)
            assert rb.consume() == 5  # libbpf reads from where the direct reads stopped
            assert [events.decode(r).dport for r in by_callback] == list(range(30000, 30005))
            drops(31000, 5)
            assert rb.drain(events.FLOW_EVENT_SIZE, on_block, by_callback.append) == 5
            assert got[-5:] == list(range(31000, 31005))
            assert rb.drain(events.FLOW_EVENT_SIZE, on_block, by_callback.append) == 0
            assert not rb.wait(10)  # nothing written: no wakeup
            rb.close()
        finally:
            agent.close()
    finally:
        remove_pins(pin_dir)
