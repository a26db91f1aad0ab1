"""FlowEvent → flow.Flow: every field the agent fills, from crafted event bytes."""

from __future__ import annotations

import time
import uuid

from google.protobuf import json_format

from cilia.hubble.flow import flow_pb2
from cilia_agent.hubble import events
from cilia_agent.hubble.enrich import MemoryResolver
from cilia_agent.hubble.parser import BootClock, Parser

from . import helpers as h


def parse_bytes(raw: bytes) -> flow_pb2.Flow:
    return h.parser().parse(events.decode(raw))


def as_dict(flow: flow_pb2.Flow) -> dict[str, object]:
    return json_format.MessageToDict(flow, preserving_proto_field_name=True)


def test_forwarded_egress_syn_becomes_a_fully_enriched_flow() -> None:
    raw = h.event(ts_ns=5_000_000_123).pack()
    flow = parse_bytes(raw)

    d = as_dict(flow)
    uuid.UUID(str(d.pop("uuid")))
    assert d == {
        "time": "2024-01-01T00:00:05.000000123Z",
        "verdict": "FORWARDED",
        "IP": {"source": h.FRONTEND_IP, "destination": h.BACKEND_IP, "ipVersion": "IPv4"},
        "l4": {"TCP": {"source_port": 40000, "destination_port": 8080, "flags": {"SYN": True}}},
        "source": {
            "ID": h.FRONTEND_EP,
            "identity": h.FRONTEND_ID,
            "namespace": "demo",
            "labels": ["k8s:app=frontend", "k8s:io.kubernetes.pod.namespace=demo"],
            "pod_name": "frontend-7d9f",
        },
        "destination": {
            "ID": h.BACKEND_EP,
            "identity": h.BACKEND_ID,
            "namespace": "demo",
            "labels": ["k8s:app=backend", "k8s:io.kubernetes.pod.namespace=demo"],
            "pod_name": "backend-5c4b",
        },
        "Type": "L3_L4",
        "node_name": h.NODE,
        "event_type": {"type": 4, "sub_type": 5},
        "traffic_direction": "EGRESS",
        "trace_observation_point": "FROM_ENDPOINT",
        "is_reply": False,
        "interface": {"index": 111, "name": "lxc00000000011"},
        "Summary": "TCP Flags: SYN",
    }


def test_policy_denied_drop_carries_reason_and_ingress_direction() -> None:
    flow = parse_bytes(h.dropped().pack())

    assert flow.verdict == flow_pb2.DROPPED
    assert flow.drop_reason == 133
    assert flow.drop_reason_desc == flow_pb2.POLICY_DENIED
    assert (flow.event_type.type, flow.event_type.sub_type) == (1, 133)
    assert flow.traffic_direction == flow_pb2.INGRESS
    assert flow.trace_observation_point == flow_pb2.UNKNOWN_POINT
    assert (flow.source.pod_name, flow.source.ID) == ("other-1", h.OTHER_EP)
    assert (flow.destination.pod_name, flow.destination.identity) == ("backend-5c4b", h.BACKEND_ID)
    assert flow.interface.name == "lxc00000000012"


def test_deny_rule_drop_is_policy_deny_181() -> None:
    flow = parse_bytes(h.dropped(drop_reason=events.DROP_POLICY_DENY).pack())
    assert (flow.drop_reason, flow.drop_reason_desc) == (181, flow_pb2.POLICY_DENY)


def test_audit_event_is_a_policy_verdict_flow_with_verdict_audit_and_no_drop_reason() -> None:
    """Audit mode (--policy-audit-mode): the datapath's policy-verdict event becomes
    upstream's AUDIT flow: type 5, the hook's direction, no drop reason, no point."""
    ev = h.dropped(event_type=events.EVENT_POLICY_VERDICT, verdict=events.VERDICT_AUDIT)
    flow = parse_bytes(ev.pack())
    assert flow.verdict == flow_pb2.AUDIT
    assert (flow.event_type.type, flow.event_type.sub_type) == (5, 0)
    assert flow.traffic_direction == flow_pb2.INGRESS
    assert (flow.drop_reason, flow.drop_reason_desc) == (0, 0)
    assert flow.trace_observation_point == flow_pb2.UNKNOWN_POINT
    assert (flow.source.pod_name, flow.destination.pod_name) == ("other-1", "backend-5c4b")


def test_reply_leaving_the_pod_belongs_to_an_ingress_connection() -> None:
    flow = parse_bytes(
        h.event(
            saddr=h.BACKEND_IP,
            daddr=h.FRONTEND_IP,
            sport=8080,
            dport=40000,
            src_identity=h.BACKEND_ID,
            dst_identity=h.FRONTEND_ID,
            ep_id=h.BACKEND_EP,
            is_reply=True,
            tcp_flags=events.TCP_SYN | events.TCP_ACK,
        ).pack()
    )
    assert flow.is_reply.value is True and flow.reply is True
    assert flow.traffic_direction == flow_pb2.INGRESS
    assert flow.trace_observation_point == flow_pb2.FROM_ENDPOINT
    assert flow.l4.TCP.flags.SYN and flow.l4.TCP.flags.ACK and not flow.l4.TCP.flags.FIN


def test_to_endpoint_trace_is_ingress_at_to_endpoint() -> None:
    flow = parse_bytes(h.event(ep_id=h.BACKEND_EP, direction=events.DIR_INGRESS).pack())
    assert flow.traffic_direction == flow_pb2.INGRESS
    assert flow.trace_observation_point == flow_pb2.TO_ENDPOINT
    assert flow.event_type.sub_type == 0
    assert flow.destination.ID == h.BACKEND_EP


def test_to_stack_trace_is_the_egress_of_a_packet_leaving_for_no_local_pod() -> None:
    ev = h.event(daddr=h.REMOTE_IP, dst_identity=h.REMOTE_ID, obs_point=events.TRACE_TO_STACK)
    flow = parse_bytes(ev.pack())
    assert flow.trace_observation_point == flow_pb2.TO_STACK
    assert (flow.event_type.type, flow.event_type.sub_type) == (events.EVENT_TRACE, 3)
    assert flow.traffic_direction == flow_pb2.EGRESS and flow.source.ID == h.FRONTEND_EP
    # the wire path keys its shapes on the point too: the same packet as from-endpoint
    # (aggregation none reports both) is a flow of its own
    parser = Parser(h.resolver(), h.NODE, BootClock(offset_ns=h.BOOT_OFFSET_NS))
    shape_for = parser.shaper()
    keyed = [
        events.KEYED.unpack(h.event(obs_point=point).pack())
        for point in (events.TRACE_TO_STACK, events.TRACE_FROM_LXC)
    ]
    points = [shape_for(k).template.trace_observation_point for k in keyed]
    assert points == [flow_pb2.TO_STACK, flow_pb2.FROM_ENDPOINT]


def test_remote_pod_is_named_from_the_ipcache_owner_and_world_gets_reserved_label() -> None:
    to_remote = parse_bytes(h.event(daddr=h.REMOTE_IP, dst_identity=h.REMOTE_ID).pack())
    assert to_remote.destination.namespace == "prod"
    assert to_remote.destination.pod_name == "db-0"
    assert to_remote.destination.ID == 0
    assert list(to_remote.destination.labels) == [
        "k8s:app=db",
        "k8s:io.kubernetes.pod.namespace=prod",
    ]

    to_world = parse_bytes(h.event(daddr=h.WORLD_IP, dst_identity=2).pack())
    assert to_world.destination.identity == 2
    assert list(to_world.destination.labels) == ["reserved:world"]
    assert (to_world.destination.namespace, to_world.destination.pod_name) == ("", "")


def test_udp_and_icmp_echo_layer4() -> None:
    udp = parse_bytes(h.event(proto=events.IPPROTO_UDP, dport=53, tcp_flags=0).pack())
    assert udp.l4.WhichOneof("protocol") == "UDP"
    assert (udp.l4.UDP.source_port, udp.l4.UDP.destination_port) == (40000, 53)

    request = parse_bytes(h.event(proto=events.IPPROTO_ICMP, sport=7, dport=7, tcp_flags=0).pack())
    reply = parse_bytes(
        h.event(proto=events.IPPROTO_ICMP, sport=7, dport=7, tcp_flags=0, is_reply=True).pack()
    )
    assert request.l4.WhichOneof("protocol") == "ICMPv4"
    assert (request.l4.ICMPv4.type, reply.l4.ICMPv4.type) == (8, 0)


def test_unknown_endpoint_still_gets_identity_and_ifindex_without_name() -> None:
    p = Parser(MemoryResolver(kernel_interface_names=False), "n1", BootClock(offset_ns=0))
    flow = p.parse(h.event(ifindex=999))
    assert flow.source.identity == h.FRONTEND_ID
    assert (flow.source.ID, flow.source.pod_name, list(flow.source.labels)) == (0, "", [])
    assert (flow.interface.index, flow.interface.name) == (999, "")


def test_boot_clock_measures_realtime_minus_monotonic() -> None:
    import time

    clock = BootClock()
    wall = clock.to_wall_ns(time.clock_gettime_ns(time.CLOCK_MONOTONIC))
    assert abs(wall - time.time_ns()) < 50_000_000


def test_summary_is_worded_as_upstream_for_the_cli() -> None:
    syn_ack = events.TCP_SYN | events.TCP_ACK
    cases = {
        "TCP Flags: SYN": h.event(),
        "TCP Flags: SYN, ACK": h.event(tcp_flags=syn_ack),
        "TCP Flags: ACK, FIN, PSH": h.event(
            tcp_flags=events.TCP_ACK | events.TCP_FIN | events.TCP_PSH
        ),
        "UDP": h.event(proto=events.IPPROTO_UDP, tcp_flags=0),
        "ICMPv4 EchoRequest": h.event(proto=events.IPPROTO_ICMP, sport=7, dport=7, tcp_flags=0),
        "ICMPv4 EchoReply": h.event(
            proto=events.IPPROTO_ICMP, sport=7, dport=7, tcp_flags=0, is_reply=True
        ),
        "ICMPv4": h.event(proto=events.IPPROTO_ICMP, sport=0, dport=0, tcp_flags=0),
        "IPv4": h.event(proto=47, sport=0, dport=0, tcp_flags=0),
    }
    for want, ev in cases.items():
        assert parse_bytes(ev.pack()).Summary == want


def test_flows_built_from_one_template_differ_in_time_uuid_and_ports_only() -> None:
    res = h.resolver()
    cached = Parser(res, h.NODE, BootClock(offset_ns=h.BOOT_OFFSET_NS), template_ttl_s=60)
    fresh = Parser(res, h.NODE, BootClock(offset_ns=h.BOOT_OFFSET_NS), template_ttl_s=0)
    evs = [h.dropped(sport=1000 + k, dport=2000 + k) for k in range(3)]
    flows = [cached.parse(ev) for ev in evs]

    for ev, flow in zip(evs, flows, strict=True):
        expected = fresh.parse(ev)
        expected.uuid = flow.uuid
        assert flow == expected
    assert len({f.uuid for f in flows}) == 3
    assert [f.l4.TCP.source_port for f in flows] == [1000, 1001, 1002]
    assert all(uuid.UUID(f.uuid).version == 4 for f in flows)


def test_template_is_rebuilt_after_its_ttl_so_enrichment_follows_changes() -> None:
    res = h.resolver()
    p = Parser(res, h.NODE, BootClock(offset_ns=h.BOOT_OFFSET_NS), template_ttl_s=0.05)
    assert p.parse(h.event()).source.pod_name == "frontend-7d9f"
    res.set_endpoint(
        h.FRONTEND_EP, ipv4=h.FRONTEND_IP, identity=h.FRONTEND_ID, namespace="demo",
        pod_name="frontend-new", labels=["k8s:app=frontend"],
    )  # fmt: skip
    time.sleep(0.06)
    assert p.parse(h.event()).source.pod_name == "frontend-new"
