"""Packet tests of bpf_lxc.c through BPF_PROG_TEST_RUN: verdict and emitted event per case.

The programs see the packet on the loopback device (ifindex 1) under test
run, so the endpoint under test is registered for ifindex 1.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cilia_agent.datapath import libbpf as lb
from cilia_agent.datapath.layout import MetricsKey, policy_key
from cilia_agent.testing import bpf as harness
from cilia_agent.testing.bpf import (
    DIR_EGRESS,
    DIR_INGRESS,
    IDENTITY_WORLD,
    TC_ACT_OK,
    TC_ACT_SHOT,
    TCP_ACK,
    TCP_SYN,
    TRACE_FROM_LXC,
    TRACE_TO_LXC,
    TRACE_TO_STACK,
    IpcacheKey,
    IpcacheValue,
    ip_to_map,
    packet,
)
from cilia_testkit import skips

pytestmark = pytest.mark.privileged

POD = "10.251.0.10"
PEER = "10.251.0.20"
OUTSIDE = "198.51.100.7"
EP_ID, POD_ID, PEER_ID = 42, 1000, 1001
FROM, TO = "cil_from_container", "cil_to_container"


def setup_endpoint(dp: harness.Datapath, ingress: bool = False, egress: bool = False) -> None:
    harness.endpoint(dp, EP_ID, POD_ID, POD, ingress=ingress, egress=egress)
    dp.agent.ipcache_map[IpcacheKey(32, ip_to_map(PEER))] = IpcacheValue(PEER_ID, 0)


def rule(
    dp: harness.Datapath,
    peer: int,
    direction: int,
    proto: int = 0,
    port: int = 0,
    deny: bool = False,
) -> None:
    harness.rule(dp, EP_ID, peer, direction, proto, port, deny=deny)


def test_allowed_flow_is_forwarded_with_both_identities(dp: harness.Datapath) -> None:
    setup_endpoint(dp, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)

    assert dp.run(FROM, packet(POD, PEER, dport=8080)) == TC_ACT_OK

    (ev,) = dp.events
    assert (ev.verdict, ev.drop_reason, ev.direction) == (1, 0, DIR_EGRESS)
    assert (ev.src_identity, ev.dst_identity, ev.ep_id) == (POD_ID, PEER_ID, EP_ID)
    assert (ev.saddr, ev.daddr, ev.proto) == (POD, PEER, 6)
    assert ev.dport == 8080


def test_default_deny_drops_unlisted_port_as_policy_denied(dp: harness.Datapath) -> None:
    setup_endpoint(dp, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)

    assert dp.run(FROM, packet(POD, PEER, dport=9090)) == TC_ACT_SHOT

    (ev,) = dp.events
    assert (ev.verdict, ev.drop_reason, ev.event_type) == (2, 133, 1)


def test_unenforced_direction_forwards_without_rules(dp: harness.Datapath) -> None:
    setup_endpoint(dp, ingress=True)  # egress not enforced

    assert dp.run(FROM, packet(POD, PEER, dport=9090)) == TC_ACT_OK


def test_deny_rule_beats_allow_for_same_port(dp: harness.Datapath) -> None:
    setup_endpoint(dp, ingress=True)
    rule(dp, 0, DIR_INGRESS)  # allow every peer, any port
    rule(dp, PEER_ID, DIR_INGRESS, proto=6, port=8080, deny=True)

    assert dp.run(TO, packet(PEER, POD, dport=8080)) == TC_ACT_SHOT
    assert dp.run(TO, packet(PEER, POD, dport=8081)) == TC_ACT_OK

    drop, forward = dp.events
    assert (drop.drop_reason, drop.direction, drop.src_identity) == (181, DIR_INGRESS, PEER_ID)
    assert (forward.verdict, forward.drop_reason) == (1, 0)


def test_wildcard_deny_for_any_peer_beats_exact_allow(dp: harness.Datapath) -> None:
    setup_endpoint(dp, ingress=True)
    rule(dp, PEER_ID, DIR_INGRESS, proto=6, port=8080)
    rule(dp, 0, DIR_INGRESS, proto=6, deny=True)

    assert dp.run(TO, packet(PEER, POD, dport=8080)) == TC_ACT_SHOT
    assert dp.events[0].drop_reason == 181


def test_reply_is_allowed_by_conntrack_while_ingress_is_default_deny(
    dp: harness.Datapath,
) -> None:
    setup_endpoint(dp, ingress=True, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)

    assert dp.run(FROM, packet(POD, PEER, sport=40000, dport=8080)) == TC_ACT_OK
    reply = packet(PEER, POD, sport=8080, dport=40000, flags=TCP_SYN | TCP_ACK)
    assert dp.run(TO, reply) == TC_ACT_OK
    # A new connection from the peer to the same pod is not a reply: dropped.
    assert dp.run(TO, packet(PEER, POD, sport=40001, dport=40000)) == TC_ACT_SHOT

    request, answer, refused = dp.events
    assert request.is_reply == 0
    assert (answer.is_reply, answer.verdict, answer.direction) == (1, 1, DIR_INGRESS)
    assert (refused.verdict, refused.drop_reason) == (2, 133)


def test_icmp_echo_reply_passes_through_conntrack(dp: harness.Datapath) -> None:
    setup_endpoint(dp, ingress=True, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS)  # L3-only allow: any protocol, any port

    assert dp.run(FROM, packet(POD, PEER, proto="icmp", icmp_type=8, icmp_id=99)) == TC_ACT_OK
    assert dp.run(TO, packet(PEER, POD, proto="icmp", icmp_type=0, icmp_id=99)) == TC_ACT_OK
    assert dp.events[1].is_reply == 1


def test_unknown_source_is_world_and_matches_world_rule(dp: harness.Datapath) -> None:
    setup_endpoint(dp, ingress=True)
    rule(dp, IDENTITY_WORLD, DIR_INGRESS, proto=17, port=53)

    assert dp.run(TO, packet(OUTSIDE, POD, proto="udp", dport=53)) == TC_ACT_OK
    assert dp.run(TO, packet(OUTSIDE, POD, proto="udp", dport=54)) == TC_ACT_SHOT

    forwarded, dropped = dp.events
    assert (forwarded.src_identity, forwarded.dst_identity) == (IDENTITY_WORLD, POD_ID)
    assert (dropped.src_identity, dropped.drop_reason) == (IDENTITY_WORLD, 133)


def test_established_flow_emits_no_event_per_packet(dp: harness.Datapath) -> None:
    setup_endpoint(dp, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)

    dp.run(FROM, packet(POD, PEER, flags=TCP_SYN))
    for _ in range(5):
        assert dp.run(FROM, packet(POD, PEER, flags=TCP_ACK)) == TC_ACT_OK

    assert len(dp.events) == 1


def test_metrics_count_drops_by_reason_and_direction(dp: harness.Datapath) -> None:
    setup_endpoint(dp, egress=True)
    frame = packet(POD, PEER, dport=9090)
    for _ in range(3):
        dp.run(FROM, frame)

    per_cpu = dp.agent.metrics_map.lookup(MetricsKey(133, DIR_EGRESS, 0))
    assert per_cpu is not None
    assert sum(v.packets for v in per_cpu) == 3
    assert sum(v.bytes for v in per_cpu) == 3 * len(frame)


def test_policy_entry_counts_matched_packets(dp: harness.Datapath) -> None:
    setup_endpoint(dp, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)
    dp.run(FROM, packet(POD, PEER, sport=1, dport=8080))
    dp.run(FROM, packet(POD, PEER, sport=2, dport=8080))

    key = policy_key(EP_ID, PEER_ID, DIR_EGRESS, 6, 8080)
    assert dp.agent.policy_map[key].packets == 2


def test_non_ip_frames_pass_untouched(dp: harness.Datapath) -> None:
    setup_endpoint(dp, ingress=True, egress=True)
    arp = b"\xff" * 6 + b"\x02" * 6 + b"\x08\x06" + b"\x00" * 28

    assert dp.run(FROM, arp) == TC_ACT_OK
    assert dp.events == []


TCP_FIN, TCP_RST = 0x01, 0x04


@pytest.fixture
def loaded() -> Iterator[Callable[..., harness.Datapath]]:
    """Load the datapath with DatapathConfig options of the test's choosing."""
    skips.require_bpf("BPF_PROG_TEST_RUN")
    made: list[harness.Datapath] = []

    def load(**options: Any) -> harness.Datapath:
        made.append(harness.load(**options))
        return made[-1]

    yield load
    for datapath in made:
        harness.unload(datapath)


def connection(dp: harness.Datapath, acks: int, pause: float = 0.0) -> list[tuple[int, int]]:
    """SYN, SYN-ACK, ``acks`` ACKs each way (``pause`` s apart), FIN each way, RST from the
    pod; returns (direction, tcp_flags) of every event emitted."""
    out = dict(sport=40000, dport=8080)
    back = dict(sport=8080, dport=40000)
    dp.run(FROM, packet(POD, PEER, flags=TCP_SYN, **out))
    dp.run(TO, packet(PEER, POD, flags=TCP_SYN | TCP_ACK, **back))
    for _ in range(acks):
        time.sleep(pause)
        dp.run(FROM, packet(POD, PEER, flags=TCP_ACK, **out))
        dp.run(TO, packet(PEER, POD, flags=TCP_ACK, **back))
    dp.run(FROM, packet(POD, PEER, flags=TCP_FIN | TCP_ACK, **out))
    dp.run(TO, packet(PEER, POD, flags=TCP_FIN | TCP_ACK, **back))
    dp.run(FROM, packet(POD, PEER, flags=TCP_RST, **out))
    return [(ev.direction, ev.tcp_flags) for ev in dp.events]


def test_medium_aggregation_reports_first_packet_and_new_flags_per_direction(
    loaded: Callable[..., harness.Datapath],
) -> None:
    dp = loaded()  # the default: medium, SYN/FIN/RST, 5 s interval
    setup_endpoint(dp, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)

    assert connection(dp, acks=5) == [
        (DIR_EGRESS, TCP_SYN),
        (DIR_INGRESS, TCP_SYN | TCP_ACK),
        (DIR_EGRESS, TCP_FIN | TCP_ACK),
        (DIR_INGRESS, TCP_FIN | TCP_ACK),
        (DIR_EGRESS, TCP_RST),
    ]


def test_aggregation_none_reports_every_packet_at_every_point_and_low_not_from_the_pod(
    loaded: Callable[..., harness.Datapath],
) -> None:
    # The connection of connection(): 6 packets from the pod (SYN, 3 ACKs, FIN, RST) to
    # PEER, which is not a pod of this node, and 5 into it (SYN-ACK, 3 ACKs, FIN).
    none = loaded(monitor_aggregation=0)
    setup_endpoint(none, egress=True)
    rule(none, PEER_ID, DIR_EGRESS, proto=6, port=8080)
    connection(none, acks=3)
    points = Counter(ev.obs_point for ev in none.events)
    assert points == {TRACE_FROM_LXC: 6, TRACE_TO_STACK: 6, TRACE_TO_LXC: 5}

    low = loaded(monitor_aggregation=2)
    setup_endpoint(low, egress=True)
    rule(low, PEER_ID, DIR_EGRESS, proto=6, port=8080)
    connection(low, acks=3)
    points = Counter(ev.obs_point for ev in low.events)
    assert points == {TRACE_TO_STACK: 6, TRACE_TO_LXC: 5}


def test_a_packet_to_a_local_pod_is_reported_at_its_to_container_only(
    loaded: Callable[..., harness.Datapath],
) -> None:
    # PEER becomes a pod of this node (behind ifindex 2): what POD sends it is reported
    # where it arrives (PEER's to-container, another run of the program), not as it leaves;
    # with aggregation none it is still reported as it leaves, as from-container only.
    for aggregation, leaving in ((3, []), (2, []), (0, [TRACE_FROM_LXC])):
        dp = loaded(monitor_aggregation=aggregation)
        setup_endpoint(dp, egress=True)
        harness.endpoint(dp, EP_ID + 1, PEER_ID, PEER, ifindex=2)
        rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)
        assert dp.run(FROM, packet(POD, PEER, flags=TCP_SYN, dport=8080)) == TC_ACT_OK
        assert [ev.obs_point for ev in dp.events] == leaving, aggregation
        # a drop is reported where it happens, local destination or not
        assert dp.run(FROM, packet(POD, PEER, dport=9)) == TC_ACT_SHOT
        assert [(ev.verdict, ev.obs_point) for ev in dp.events[len(leaving) :]] == [(2, 0)]
        # once PEER is gone from the node, its address is no local pod's
        dp.agent.delete_endpoint(2)
        assert dp.run(FROM, packet(POD, PEER, flags=TCP_SYN, sport=40001, dport=8080)) == 0
        assert dp.events[-1].obs_point == TRACE_TO_STACK


def test_aggregation_flags_and_interval_are_options(
    loaded: Callable[..., harness.Datapath],
) -> None:
    # Only RST is a reported flag; every packet after one interval (1 unit, ~67 ms) is.
    dp = loaded(monitor_aggregation_flags=TCP_RST, monitor_aggregation_interval_ns=1)
    setup_endpoint(dp, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)

    events = connection(dp, acks=2, pause=0.2)
    # SYN (new), SYN-ACK (first reply), the paused ACKs each way; FINs follow their ACKs
    # within the interval so they are not reported; the RST is a flag of the mask.
    assert events == [
        (DIR_EGRESS, TCP_SYN),
        (DIR_INGRESS, TCP_SYN | TCP_ACK),
        (DIR_EGRESS, TCP_ACK),
        (DIR_INGRESS, TCP_ACK),
        (DIR_EGRESS, TCP_ACK),
        (DIR_INGRESS, TCP_ACK),
        (DIR_EGRESS, TCP_RST),
    ]


def test_events_the_ring_refuses_go_to_the_rescue_ring_then_are_counted_lost(
    loaded: Callable[..., harness.Datapath],
) -> None:
    # A main ring of one page (4096 bytes) holds 73 records of 48 + 8 header bytes; what it
    # refuses goes to the rescue ring (4 pages: 292 records); what neither takes is lost. A
    # late wakeup (every 64th event) loses none.
    dp = loaded(events_pages=1, events_wakeup_events=64)
    setup_endpoint(dp, egress=True)

    assert dp.run(FROM, packet(POD, OUTSIDE, dport=9), repeat=50) == TC_ACT_SHOT
    assert len(dp.events) == 50
    assert (dp.agent.events_lost(), dp.agent.events_rescued()) == (0, 0)

    assert dp.run(FROM, packet(POD, OUTSIDE, dport=9), repeat=400) == TC_ACT_SHOT
    assert len(dp.events) == 50 + 73 + 292
    assert dp.agent.events_rescued() == 292
    assert dp.agent.events_lost() == 400 - 73 - 292
    assert {e.dport for e in dp.events} == {9}  # rescued records decode like the others


def test_a_half_full_ring_buffer_wakes_the_reader_before_the_event_count(
    loaded: Callable[..., harness.Datapath],
) -> None:
    # One page: 4096 bytes, 56 per record; half of it is 2048 bytes, passed by the 37th
    # unread record. The count alone (2^20) would not wake the reader for a long time.
    dp = loaded(events_pages=1, events_wakeup_events=1 << 20)
    setup_endpoint(dp, egress=True)
    drop = packet(POD, OUTSIDE, dport=9)
    assert not dp.ring.wait(0)  # the reader's epoll, registered before any event

    assert dp.run(FROM, drop, repeat=30, consume=False) == TC_ACT_SHOT
    assert not dp.ring.wait(0)  # 1,680 bytes unread: no wakeup
    assert dp.run(FROM, drop, repeat=20, consume=False) == TC_ACT_SHOT
    assert dp.ring.wait(0)  # past half: woken
    dp.ring.consume()
    assert len(dp.events) == 50 and dp.agent.events_lost() == 0


@pytest.mark.parametrize("close", [TCP_RST, TCP_FIN | TCP_ACK], ids=["rst", "fin"])
def test_syn_on_the_tuple_of_a_closed_connection_is_a_new_flow(
    dp: harness.Datapath, close: int
) -> None:
    # A connection closed (RST, or FIN), then a new one on the same 5-tuple (a client
    # reusing its source port): its SYN is reported as a new flow and decided by policy
    # again, so a rule removed in between drops it instead of the closed connection's
    # conntrack entry letting it through.
    setup_endpoint(dp, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)
    out = dict(sport=40000, dport=8080)
    back = dict(sport=8080, dport=40000)
    assert dp.run(FROM, packet(POD, PEER, flags=TCP_SYN, **out)) == TC_ACT_OK
    assert dp.run(TO, packet(PEER, POD, flags=TCP_SYN | TCP_ACK, **back)) == TC_ACT_OK
    assert dp.run(FROM, packet(POD, PEER, flags=close, **out)) == TC_ACT_OK
    # A retransmitted SYN of a connection that is not closed stays a conntrack hit.
    assert dp.run(FROM, packet(POD, PEER, sport=40001, dport=8080, flags=TCP_SYN)) == TC_ACT_OK
    assert dp.run(FROM, packet(POD, PEER, sport=40001, dport=8080, flags=TCP_SYN)) == TC_ACT_OK
    before = len(dp.events)

    assert dp.run(FROM, packet(POD, PEER, flags=TCP_SYN, **out)) == TC_ACT_OK
    (reopened,) = dp.events[before:]
    assert (reopened.verdict, reopened.direction, reopened.tcp_flags) == (1, DIR_EGRESS, TCP_SYN)
    assert reopened.is_reply == 0

    assert dp.run(FROM, packet(POD, PEER, flags=close, **out)) == TC_ACT_OK
    del dp.agent.policy_map[policy_key(EP_ID, PEER_ID, DIR_EGRESS, 6, 8080)]
    assert dp.run(FROM, packet(POD, PEER, flags=TCP_SYN, **out)) == TC_ACT_SHOT
    assert (dp.events[-1].verdict, dp.events[-1].drop_reason) == (2, 133)
    # The open connection on port 40001 keeps passing: only closed entries are reopened.
    assert dp.run(FROM, packet(POD, PEER, sport=40001, dport=8080, flags=TCP_ACK)) == TC_ACT_OK


CLOCK_MONOTONIC_COARSE = 6  # linux/time.h; Python's time module does not name it


def test_conntrack_clock_is_the_coarse_one_and_events_carry_the_precise_one(
    dp: harness.Datapath,
) -> None:
    # The agent probed bpf_ktime_get_coarse_ns (5.11; this kernel has it): a packet of an
    # established flow stamps its conntrack entry with the coarse clock, which in one
    # tick reads the same value before and after the packet; the event of a new flow
    # carries the precise clock, between two precise readings.
    if not lb.helper_available(lb.PROG_TYPE_SCHED_CLS, lb.FUNC_KTIME_GET_COARSE_NS):
        pytest.skip("the kernel lacks bpf_ktime_get_coarse_ns (5.11): conntrack uses the other")
    setup_endpoint(dp, egress=True)
    rule(dp, PEER_ID, DIR_EGRESS, proto=6, port=8080)
    start = time.monotonic_ns()
    assert dp.run(FROM, packet(POD, PEER, sport=40000, dport=8080, flags=TCP_SYN)) == TC_ACT_OK
    (event,) = dp.events
    assert start <= event.ts_ns <= time.monotonic_ns()
    ack = packet(POD, PEER, sport=40000, dport=8080, flags=TCP_ACK)
    for _ in range(100):
        before = time.clock_gettime_ns(CLOCK_MONOTONIC_COARSE)
        assert dp.run(FROM, ack, consume=False) == TC_ACT_OK
        if time.clock_gettime_ns(CLOCK_MONOTONIC_COARSE) == before:
            break
    else:
        pytest.fail("no packet ran within one tick of CLOCK_MONOTONIC_COARSE in 100 tries")
    ((_, entry),) = dp.agent.ct_map.items()
    assert entry.last_seen_ns == before, (entry.last_seen_ns, before)
    assert entry.created_ns <= before
