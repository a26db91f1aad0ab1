"""FlowFilter semantics: whitelist/blacklist, OR across filters, AND inside one."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format

from cilia.hubble.flow import flow_pb2
from cilia_agent.hubble import events
from cilia_agent.hubble.errors import InvalidFilter
from cilia_agent.hubble.filters import FilterSet, compile_filter, parse_namespaced_name

from . import helpers as h

P = h.parser()
FLOWS: dict[str, flow_pb2.Flow] = {
    # frontend -> backend:8080 SYN, forwarded, seen at frontend's egress
    "syn": P.parse(h.event()),
    # other -> backend:8080 dropped at backend's ingress (Policy denied)
    "drop": P.parse(h.dropped()),
    # backend -> frontend SYN-ACK reply, seen at backend's egress
    "reply": P.parse(
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
        )
    ),
    # frontend -> world UDP 53
    "dns": P.parse(
        h.event(daddr=h.WORLD_IP, dst_identity=2, proto=events.IPPROTO_UDP, dport=53, tcp_flags=0)
    ),
    # frontend -> remote pod prod/db-0, ICMP echo
    "ping": P.parse(
        h.event(
            daddr=h.REMOTE_IP,
            dst_identity=h.REMOTE_ID,
            proto=events.IPPROTO_ICMP,
            sport=9,
            dport=9,
            tcp_flags=0,
        )
    ),
}
ALL = set(FLOWS)


def ff(**fields: Any) -> flow_pb2.FlowFilter:
    return json_format.ParseDict(fields, flow_pb2.FlowFilter())


def selected(
    whitelist: list[flow_pb2.FlowFilter], blacklist: list[flow_pb2.FlowFilter]
) -> set[str]:
    fs = FilterSet(whitelist, blacklist)
    return {name for name, flow in FLOWS.items() if fs.matches(flow)}


CASES: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]], set[str]]] = [
    ("no filters", [], [], ALL),
    ("empty filter matches all", [{}], [], ALL),
    ("source ip exact", [{"source_ip": [h.FRONTEND_IP]}], [], {"syn", "dns", "ping"}),
    ("destination ip cidr", [{"destination_ip": ["10.200.1.0/24"]}], [], {"ping"}),
    (
        "destination ip several ORed",
        [{"destination_ip": [h.WORLD_IP, h.REMOTE_IP]}],
        [],
        {"dns", "ping"},
    ),
    ("source pod ns/name prefix", [{"source_pod": ["demo/front"]}], [], {"syn", "dns", "ping"}),
    ("source pod ns/ selects namespace", [{"source_pod": ["demo/"]}], [], ALL),
    ("pod without ns means default ns", [{"source_pod": ["frontend"]}], [], set()),
    ("destination pod remote", [{"destination_pod": ["prod/db"]}], [], {"ping"}),
    ("verdict dropped", [{"verdict": ["DROPPED"]}], [], {"drop"}),
    ("event type drop", [{"event_type": [{"type": 1}]}], [], {"drop"}),
    (
        "event type trace from-endpoint subtype",
        [{"event_type": [{"type": 4, "match_sub_type": True, "sub_type": 5}]}],
        [],
        {"syn", "reply", "dns", "ping"},
    ),
    ("label k8s:key=value", [{"source_label": ["k8s:app=other"]}], [], {"drop"}),
    ("label key=value any source", [{"destination_label": ["app=backend"]}], [], {"syn", "drop"}),
    ("label bare key form", [{"destination_label": ["reserved:world"]}], [], {"dns"}),
    ("label set-based", [{"source_label": ["app in (backend, other)"]}], [], {"drop", "reply"}),
    (
        "label requirements ANDed",
        [{"source_label": ["app=frontend,!nope"]}],
        [],
        {"syn", "dns", "ping"},
    ),
    ("label negation", [{"destination_label": ["app!=backend"]}], [], {"reply", "dns", "ping"}),
    ("protocol udp", [{"protocol": ["UDP"]}], [], {"dns"}),
    ("protocol icmp", [{"protocol": ["icmp"]}], [], {"ping"}),
    ("protocol http never matches L3/L4 flows", [{"protocol": ["http"]}], [], set()),
    ("destination port", [{"destination_port": ["8080"]}], [], {"syn", "drop"}),
    ("source port", [{"source_port": ["8080"]}], [], {"reply"}),
    ("reply true", [{"reply": [True]}], [], {"reply"}),
    ("reply false", [{"reply": [False]}], [], ALL - {"reply"}),
    ("source identity", [{"source_identity": [h.OTHER_ID]}], [], {"drop"}),
    ("destination identity", [{"destination_identity": [2, h.REMOTE_ID]}], [], {"dns", "ping"}),
    ("node name exact", [{"node_name": [h.NODE]}], [], ALL),
    ("node name pattern", [{"node_name": ["default/node-*"]}], [], ALL),
    ("node name other", [{"node_name": ["node-b"]}], [], set()),
    ("traffic direction ingress", [{"traffic_direction": ["INGRESS"]}], [], {"drop", "reply"}),
    ("tcp flags SYN", [{"tcp_flags": [{"SYN": True}]}], [], {"syn", "drop", "reply"}),
    ("tcp flags SYN+ACK", [{"tcp_flags": [{"SYN": True, "ACK": True}]}], [], {"reply"}),
    ("ip version", [{"ip_version": ["IPv4"]}], [], ALL),
    # AND inside one filter, OR across filters
    (
        "fields ANDed",
        [{"source_pod": ["demo/frontend"], "protocol": ["udp"]}],
        [],
        {"dns"},
    ),
    (
        "filters ORed",
        [{"verdict": ["DROPPED"]}, {"protocol": ["icmp"]}],
        [],
        {"drop", "ping"},
    ),
    # blacklist
    ("blacklist only", [], [{"verdict": ["DROPPED"]}], ALL - {"drop"}),
    (
        "whitelist minus blacklist",
        [{"destination_port": ["8080"]}, {"protocol": ["udp"]}],
        [{"source_pod": ["demo/other"]}],
        {"syn", "dns"},
    ),
    ("blacklist filters ORed", [], [{"protocol": ["tcp"]}, {"protocol": ["udp"]}], {"ping"}),
]


@pytest.mark.parametrize(
    ("whitelist", "blacklist", "expected"),
    [(w, b, e) for _, w, b, e in CASES],
    ids=[c[0] for c in CASES],
)
def test_filter_selection(
    whitelist: list[dict[str, Any]], blacklist: list[dict[str, Any]], expected: set[str]
) -> None:
    assert selected([ff(**w) for w in whitelist], [ff(**b) for b in blacklist]) == expected


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"source_ip": ["10.0.0.300"]}, "invalid IP"),
        ({"destination_ip": ["10.0.0.0/33"]}, "invalid IP"),
        ({"source_pod": [""]}, "must be"),
        ({"protocol": ["gopher"]}, "unknown protocol"),
        ({"destination_port": ["http"]}, "invalid port"),
        ({"destination_port": ["70000"]}, "invalid port"),
        ({"source_label": ["app in (a"]}, "label"),
        ({"source_label": ["a=b=c"]}, "label"),
        ({"node_name": ["a/b/c"]}, "too many slashes"),
        ({"node_name": ["UPPER$"]}, "invalid character"),
    ],
)
def test_invalid_filter_values_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidFilter, match=message):
        compile_filter(ff(**fields))


def test_upstream_field_cilia_does_not_implement_is_refused_not_ignored() -> None:
    # flow.FlowFilter.source_fqdn = 7 (upstream), absent from Cilia's proto.
    raw = bytes([7 << 3 | 2, 11]) + b"example.com"
    flt = flow_pb2.FlowFilter()
    flt.MergeFromString(raw)
    with pytest.raises(InvalidFilter, match=r"7 \(source_fqdn\)"):
        FilterSet([flt])
    with pytest.raises(InvalidFilter):
        FilterSet([], [flt])


def test_parse_namespaced_name_like_upstream() -> None:
    assert parse_namespaced_name("kube-system/coredns-") == ("kube-system", "coredns-")
    assert parse_namespaced_name("xwing") == ("default", "xwing")
    assert parse_namespaced_name("ns/") == ("ns", "")
    assert parse_namespaced_name("") == ("", "")
