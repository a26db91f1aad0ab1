"""Compact and JSON rendering of flows, like ``hubble observe``."""

from __future__ import annotations

import datetime
import json

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2
from cilia.hubble.relay import relay_pb2
from cilia_relay.cli.printer import format_compact, format_json, format_node_status, format_time


def flow(**kwargs: object) -> flow_pb2.Flow:
    f = flow_pb2.Flow(
        verdict=flow_pb2.FORWARDED,
        IP=flow_pb2.IP(source="10.200.0.10", destination="10.200.0.20", ipVersion=flow_pb2.IPv4),
        l4=flow_pb2.Layer4(
            TCP=flow_pb2.TCP(
                source_port=40000, destination_port=8080, flags=flow_pb2.TCPFlags(SYN=True)
            )
        ),
        source=flow_pb2.Endpoint(identity=1001, namespace="default", pod_name="frontend"),
        destination=flow_pb2.Endpoint(identity=1002, namespace="default", pod_name="backend"),
        event_type=flow_pb2.CiliumEventType(type=4),
        trace_observation_point=flow_pb2.TO_ENDPOINT,
        node_name="node-a",
    )
    f.is_reply.value = False
    when = datetime.datetime(2026, 11, 29, 18, 40, 1, 123456)
    f.time.FromDatetime(when.astimezone(datetime.UTC))
    for key, value in kwargs.items():
        if isinstance(value, flow_pb2.Layer4 | flow_pb2.Endpoint):
            getattr(f, key).CopyFrom(value)
        else:
            setattr(f, key, value)
    return f


def test_forwarded_tcp_flow_compact_line() -> None:
    assert format_compact(flow()) == (
        "Nov 29 18:40:01.123: default/frontend:40000 (ID:1001) -> default/backend:8080 (ID:1002)"
        " to-endpoint FORWARDED (TCP Flags: SYN)"
    )


def test_dropped_flow_shows_the_drop_reason_text() -> None:
    f = flow(verdict=flow_pb2.DROPPED, drop_reason=133, drop_reason_desc=flow_pb2.POLICY_DENIED)
    f.event_type.type = 1
    assert "(ID:1002) Policy denied DROPPED (TCP Flags: SYN)" in format_compact(f)
    f.drop_reason_desc = flow_pb2.POLICY_DENY
    assert " Policy denied by denylist DROPPED " in format_compact(f)


def test_reply_swaps_sides_and_flips_the_arrow() -> None:
    f = flow()
    f.is_reply.value = True
    f.l4.TCP.flags.ACK = True
    line = format_compact(f)
    assert "default/backend:8080 (ID:1002) <- default/frontend:40000 (ID:1001)" in line
    assert line.endswith("(TCP Flags: SYN, ACK)")


def test_unknown_pods_fall_back_to_ip_and_reserved_identity_names() -> None:
    f = flow(source=flow_pb2.Endpoint(identity=2), trace_observation_point=flow_pb2.FROM_ENDPOINT)
    assert "10.200.0.10:40000 (world) -> default/backend:8080 (ID:1002) from-endpoint" in (
        format_compact(f)
    )


def test_udp_and_icmp_summaries() -> None:
    udp = flow(l4=flow_pb2.Layer4(UDP=flow_pb2.UDP(source_port=5353, destination_port=53)))
    assert format_compact(udp).endswith("FORWARDED (UDP)")
    icmp = flow(l4=flow_pb2.Layer4(ICMPv4=flow_pb2.ICMPv4(type=8)))
    line = format_compact(icmp)
    assert "default/frontend (ID:1001) -> default/backend (ID:1002)" in line
    assert line.endswith("(ICMPv4 EchoRequest)")


def test_day_of_month_is_space_padded_like_go_stamp_milli() -> None:
    assert format_time(datetime.datetime(2026, 11, 2, 1, 2, 3, 4000)) == "Nov  2 01:02:03.004"


def test_json_is_the_whole_response_with_proto_field_names() -> None:
    response = observer_pb2.GetFlowsResponse(flow=flow(), node_name="node-a")
    data = json.loads(format_json(response))
    assert data["node_name"] == "node-a"
    assert data["flow"]["l4"]["TCP"]["destination_port"] == 8080
    assert data["flow"]["source"]["pod_name"] == "frontend"
    assert data["flow"]["verdict"] == "FORWARDED"
    assert data["flow"]["trace_observation_point"] == "TO_ENDPOINT"
    assert data["flow"]["is_reply"] is False
    assert "\n" not in format_json(response)


def test_node_error_sentence_and_informational_events_are_silent() -> None:
    error = observer_pb2.GetFlowsResponse(
        node_name="relay",
        node_status=relay_pb2.NodeStatusEvent(
            state_change=relay_pb2.NODE_ERROR, node_names=["node-b"], message="rpc error: x"
        ),
    )
    line = format_node_status(error)
    assert line is not None
    assert line.endswith('[relay]: Error "rpc error: x" on 1 nodes: node-b')
    connected = observer_pb2.GetFlowsResponse(
        node_status=relay_pb2.NodeStatusEvent(state_change=relay_pb2.NODE_CONNECTED)
    )
    assert format_node_status(connected) is None
