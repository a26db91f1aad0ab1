"""The real datapath → Hubble: bpf_lxc.c compiled with bcc, packets through
BPF_PROG_TEST_RUN, ring-buffer events read by the Hubble reader into enriched flows.

Maps are pinned under a fresh ``/sys/fs/bpf/cilia-test-<rand>`` and removed afterwards.
Under test run the programs see the packet on the loopback device (ifindex 1), so the
endpoint under test is registered for ifindex 1 (cilia_bpf_testing.harness).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from cilia.hubble.flow import flow_pb2
from cilia_agent.hubble.enrich import MemoryResolver
from cilia_agent.hubble.metrics import parse_metrics, read_bcc_counters
from cilia_agent.hubble.service import Hubble, HubbleConfig
from cilia_bpf_testing import harness  # map layouts + packet builder
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

BPF_DIR = harness.BPF_DIR

POD, PEER, OUTSIDE = "10.251.0.10", "10.251.0.20", "198.51.100.7"
EP_ID, POD_ID, PEER_ID = 42, 1000, 1001
FROM, TO = "cil_from_container", "cil_to_container"


class Loaded:
    def __init__(self, bpf: Any, pin_dir: pathlib.Path, progs: dict[str, int]) -> None:
        self.bpf = bpf
        self.pin_dir = pin_dir
        self.progs = progs

    def run(self, prog: str, frame: bytes) -> int:
        """One BPF_PROG_TEST_RUN (no ring-buffer polling here: the Hubble reader polls)."""
        lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
        buf = ctypes.create_string_buffer(frame, len(frame))
        opts = harness._TestRunOpts(
            sz=ctypes.sizeof(harness._TestRunOpts),
            data_in=ctypes.cast(buf, ctypes.c_void_p),
            data_size_in=len(frame),
            repeat=1,
        )
        if lib.bpf_prog_test_run_opts(self.progs[prog], ctypes.byref(opts)) != 0:
            raise OSError(ctypes.get_errno(), f"BPF_PROG_TEST_RUN failed for {prog}")
        return int(opts.retval)


@pytest.fixture
def datapath() -> Iterator[Loaded]:
    skips.require_bpf("BPF_PROG_TEST_RUN")
    from bcc import BPF

    pin_dir = pathlib.Path("/sys/fs/bpf") / f"cilia-test-{uuid.uuid4().hex[:8]}"
    pin_dir.mkdir()
    bpf = None
    try:
        bpf = BPF(
            src_file=str(BPF_DIR / "bpf_lxc.c").encode(),
            cflags=[f"-I{BPF_DIR}", f'-DCILIA_PIN_DIR="{pin_dir}"', "-w"],
        )
        progs = {name: bpf.load_func(name.encode(), BPF.SCHED_CLS).fd for name in (FROM, TO)}
        yield Loaded(bpf, pin_dir, progs)
    finally:
        if bpf is not None:
            bpf.cleanup()
        for pinned in pin_dir.iterdir():
            os.unlink(pinned)
        shutil.rmtree(pin_dir, ignore_errors=True)


def program_datapath(dp: Loaded) -> None:
    endpoints = dp.bpf[b"cilia_endpoints"]
    endpoints[endpoints.Key(1)] = harness.EndpointInfo(
        ep_id=EP_ID, sec_identity=POD_ID, ipv4=harness.ip_to_map(POD), enforce_egress=1
    )
    ipcache = dp.bpf[b"cilia_ipcache"]
    ipcache[harness.IpcacheKey(32, harness.ip_to_map(POD))] = harness.IpcacheValue(POD_ID, 0)
    ipcache[harness.IpcacheKey(32, harness.ip_to_map(PEER))] = harness.IpcacheValue(PEER_ID, 0)
    key = harness.PolicyKey(96, EP_ID, PEER_ID, harness.DIR_EGRESS, 6, harness.port_to_map(8080))
    dp.bpf[b"cilia_policy"][key] = harness.PolicyValue(flags=0)


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
        await hubble.start_reader(datapath.bpf)
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
    assert allowed.trace_observation_point == flow_pb2.FROM_ENDPOINT
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

    hubble.metrics.update_datapath_counters(read_bcc_counters(datapath.bpf))
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
