"""The conntrack GC over the real ``cilia_ct`` the loaded programs fill (BPF_PROG_TEST_RUN).

Entries are made by packets through ``cil_from_container``/``cil_to_container``; the passes
run at chosen clock readings (now plus a timeout) instead of waiting hours.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cilia_agent.conntrack.gc import ConntrackGC, Timeouts, collect
from cilia_agent.datapath.layout import policy_key
from cilia_agent.metrics import Metrics
from cilia_agent.testing import bpf as harness
from cilia_agent.testing.bpf import (
    DIR_EGRESS,
    TC_ACT_OK,
    TCP_ACK,
    TCP_SYN,
    IpcacheKey,
    IpcacheValue,
    ip_to_map,
    packet,
)
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

POD, PEER = "10.251.0.10", "10.251.0.20"
EP_ID, POD_ID, PEER_ID = 42, 1000, 1001
FROM, TO = "cil_from_container", "cil_to_container"
TCP_FIN, TCP_RST = 0x01, 0x04
S = 1_000_000_000
BIN = pathlib.Path(sys.executable).parent / "cilia-agent"


@pytest.fixture
def dp() -> Iterator[harness.Datapath]:
    """The programs loaded, an endpoint on ifindex 1 whose egress is enforced, and a rule
    letting it reach PEER on TCP 8080 and UDP 53."""
    skips.require_bpf("BPF_PROG_TEST_RUN")
    loaded = harness.load()
    try:
        harness.endpoint(loaded, EP_ID, POD_ID, POD, egress=True)
        loaded.agent.ipcache_map[IpcacheKey(32, ip_to_map(PEER))] = IpcacheValue(PEER_ID, 0)
        for proto, port in ((6, 8080), (17, 53)):
            harness.rule(loaded, EP_ID, PEER_ID, DIR_EGRESS, proto, port)
        yield loaded
    finally:
        harness.unload(loaded)


def connection(dp: harness.Datapath, sport: int, *flags: int) -> None:
    """SYN from the pod, SYN-ACK back, then ``flags`` from the pod (each a packet)."""
    out = dict(sport=sport, dport=8080)
    assert dp.run(FROM, packet(POD, PEER, flags=TCP_SYN, **out)) == TC_ACT_OK
    back = packet(PEER, POD, sport=8080, dport=sport, flags=TCP_SYN | TCP_ACK)
    assert dp.run(TO, back) == TC_ACT_OK
    for f in flags:
        assert dp.run(FROM, packet(POD, PEER, flags=f, **out)) == TC_ACT_OK


def ports(dp: harness.Datapath) -> set[tuple[int, int]]:
    """(protocol, pod-side source port in host order) of every conntrack entry."""
    return {(k.proto, socket.ntohs(k.sport)) for k, _ in dp.agent.ct_map.items()}


def test_each_state_is_deleted_after_its_own_idle_timeout(dp: harness.Datapath) -> None:
    connection(dp, 40001, TCP_ACK)  # established
    connection(dp, 40002, TCP_ACK, TCP_FIN | TCP_ACK)  # closing once the peer's FIN comes
    fin_back = packet(PEER, POD, sport=8080, dport=40002, flags=TCP_FIN | TCP_ACK)
    assert dp.run(TO, fin_back) == TC_ACT_OK
    connection(dp, 40003, TCP_RST)  # reset
    assert dp.run(FROM, packet(POD, PEER, sport=40004, dport=8080, flags=TCP_SYN)) == TC_ACT_OK
    assert dp.run(FROM, packet(POD, PEER, proto="udp", sport=40005, dport=53)) == TC_ACT_OK
    everything = {(6, 40001), (6, 40002), (6, 40003), (6, 40004), (17, 40005)}
    assert ports(dp) == everything
    now = time.monotonic_ns()
    t = Timeouts()

    # Nothing idle long enough yet.
    first = collect(dp.agent.ct_map, now + 9 * S, t)
    assert (sum(first.deleted.values()), ports(dp)) == (0, everything)

    # Past the FIN timeout (10 s): the closed connections go.
    after_fin = collect(dp.agent.ct_map, now + 11 * S, t)
    assert after_fin.deleted == {"TCP": 2, "non-TCP": 0}
    assert ports(dp) == {(6, 40001), (6, 40004), (17, 40005)}

    # Past the SYN and any timeouts (60 s): the unanswered SYN and the UDP flow go.
    after_syn = collect(dp.agent.ct_map, now + 61 * S, t)
    assert after_syn.deleted == {"TCP": 1, "non-TCP": 1}
    assert after_syn.alive == {"TCP": 1, "non-TCP": 0}
    assert ports(dp) == {(6, 40001)}

    # The established connection stays for 6 h of silence, then goes too.
    assert sum(collect(dp.agent.ct_map, now + 21599 * S, t).deleted.values()) == 0
    assert sum(collect(dp.agent.ct_map, now + 21601 * S, t).deleted.values()) == 1
    assert ports(dp) == set()


def test_a_half_closed_connection_keeps_its_entry_and_its_replies_pass(
    dp: harness.Datapath,
) -> None:
    # The pod sends FIN, the peer goes on sending (half-close); the pod's ingress is
    # enforced with no rule for the peer, so only the entry lets the peer's packets in.
    ingress = dp.agent.endpoints()[1]
    ingress.enforce_ingress = 1
    dp.agent.set_endpoint(1, ingress)
    connection(dp, 40010, TCP_ACK, TCP_FIN | TCP_ACK)
    data = packet(PEER, POD, sport=8080, dport=40010, flags=TCP_ACK)
    assert dp.run(TO, data) == TC_ACT_OK
    t = Timeouts()
    assert sum(collect(dp.agent.ct_map, time.monotonic_ns() + 11 * S, t).deleted.values()) == 0
    assert dp.run(TO, data) == TC_ACT_OK  # 11 s of silence later: still the connection's
    # The peer's FIN closes the other way: now the close timeout applies.
    fin = packet(PEER, POD, sport=8080, dport=40010, flags=TCP_FIN | TCP_ACK)
    assert dp.run(TO, fin) == TC_ACT_OK
    assert collect(dp.agent.ct_map, time.monotonic_ns() + 11 * S, t).deleted["TCP"] == 1
    assert dp.run(TO, data) == harness.TC_ACT_SHOT  # no entry: ingress policy drops it


def test_a_packet_after_the_pass_is_a_new_flow_decided_by_policy_again(
    dp: harness.Datapath,
) -> None:
    connection(dp, 40001, TCP_ACK)
    before = len(dp.events)
    assert dp.run(FROM, packet(POD, PEER, sport=40001, dport=8080, flags=TCP_ACK)) == TC_ACT_OK
    assert len(dp.events) == before  # established: no event under medium aggregation

    now = time.monotonic_ns()
    assert collect(dp.agent.ct_map, now + 21601 * S, Timeouts()).deleted["TCP"] == 1
    # The next packet finds no entry: policy decides it (allowed: a new entry, reported).
    assert dp.run(FROM, packet(POD, PEER, sport=40001, dport=8080, flags=TCP_ACK)) == TC_ACT_OK
    assert len(dp.events) == before + 1
    assert ports(dp) == {(6, 40001)}
    # With the rule gone, the same packet after another pass is dropped.
    del dp.agent.policy_map[policy_key(EP_ID, PEER_ID, DIR_EGRESS, 6, 8080)]
    assert collect(dp.agent.ct_map, time.monotonic_ns() + 21601 * S, Timeouts()).deleted["TCP"] == 1
    frame = packet(POD, PEER, sport=40001, dport=8080, flags=TCP_ACK)
    assert dp.run(FROM, frame) == harness.TC_ACT_SHOT


def test_passes_are_counted_with_upstreams_metric_names_and_shorten_the_interval(
    dp: harness.Datapath,
) -> None:
    for sport in range(41000, 41004):
        connection(dp, sport, TCP_RST)
    connection(dp, 42000, TCP_ACK)
    offset = [0]
    metrics = Metrics()
    gc = ConntrackGC(
        dp.agent.ct_map,
        Timeouts(),
        max_entries=8,  # the ratio's denominator, as upstream: the map's size
        metrics=metrics,
        clock=lambda: time.monotonic_ns() + offset[0],
    )
    assert gc.next_wait == 300.0  # upstream's starting interval
    gc.run_once()  # nothing expired: 0 deleted keeps the interval
    assert gc.next_wait == 300.0
    offset[0] = 11 * S
    result = gc.run_once()  # 4 deleted of a map of 8: ratio 0.5 > 0.25, interval x 0.5
    assert (result.deleted["TCP"], result.alive["TCP"]) == (4, 1)
    assert gc.next_wait == 150.0

    samples = {
        (s.name, s.labels["protocol"], s.labels["status"]): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
        if s.name.startswith("cilium_datapath_conntrack_gc")
    }
    assert samples[("cilium_datapath_conntrack_gc_runs_total", "TCP", "completed")] == 2
    assert samples[("cilium_datapath_conntrack_gc_entries", "TCP", "deleted")] == 4
    assert samples[("cilium_datapath_conntrack_gc_entries", "TCP", "alive")] == 1
    assert samples[("cilium_datapath_conntrack_gc_entries", "non-TCP", "alive")] == 0
    assert samples[("cilium_datapath_conntrack_gc_duration_seconds_count", "TCP", "completed")] == 2


def test_batched_reads_give_what_one_by_one_reads_give(dp: harness.Datapath) -> None:
    for sport in range(43000, 43007):
        connection(dp, sport, TCP_ACK)
    ct = dp.agent.ct_map

    def entries(pairs: Iterator[tuple[Any, Any]]) -> list[tuple[bytes, bytes]]:
        return sorted((bytes(k), bytes(v)) for k, v in pairs)

    one_by_one = entries(ct.items())
    assert len(one_by_one) == 7
    assert entries(ct.batch_items(batch=2)) == one_by_one  # four batches, the last short
    assert entries(ct.batch_items()) == one_by_one
    # An LPM trie has no batch lookups: the one-by-one read answers instead.
    ipcache = dp.agent.ipcache_map
    assert entries(ipcache.batch_items()) == entries(ipcache.items()) != []


def test_cli_lists_and_flushes_the_conntrack_map(dp: harness.Datapath) -> None:
    connection(dp, 44001, TCP_ACK)
    connection(dp, 44002, TCP_RST)
    assert dp.run(FROM, packet(POD, PEER, proto="udp", sport=44003, dport=53)) == TC_ACT_OK
    pin = ["--bpf-pin-dir", str(dp.pin_dir)]

    def cli(*args: str) -> str:
        proc = subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    listed = json.loads(cli("bpf", "ct", "list", "-o", "json", *pin))
    got = {
        (e["direction"], e["protocol"], e["source"], e["destination"], e["state"]) for e in listed
    }
    assert got == {
        ("OUT", "TCP", f"{POD}:44001", f"{PEER}:8080", "established"),
        ("OUT", "TCP", f"{POD}:44002", f"{PEER}:8080", "closing"),
        ("OUT", "UDP", f"{POD}:44003", f"{PEER}:53", "other"),
    }
    assert all(e["idle_seconds"] < 60 and e["packets"] >= 1 for e in listed)
    assert "DESTINATION" in cli("bpf", "ct", "list", *pin)

    assert cli("bpf", "ct", "flush", *pin) == f"Flushed 3 entries from {dp.pin_dir}/cilia_ct\n"
    assert ports(dp) == set()
    assert json.loads(cli("bpf", "ct", "list", "-o", "json", *pin)) == []
    # A wrong pin directory is a clear error, exit 1.
    bad = subprocess.run(
        [str(BIN), "bpf", "ct", "flush", "--bpf-pin-dir", str(dp.pin_dir / "nowhere")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert bad.returncode == 1 and "cilia_ct" in bad.stderr, bad.stderr
