"""The graph model: flows → nodes, edges (by verdict) and the flow table."""

from __future__ import annotations

from flows import endpoint, tcp_flow

from cilia.hubble.flow import flow_pb2
from cilia_hubble_ui.graph import FlowGraph, endpoint_node, summarize

NS = "shop"
FRONT = endpoint(NS, "frontend", 1001)
BACK = endpoint(NS, "backend", 1002)
OTHER = endpoint(NS, "other", 1003)


def _graph(*flows: flow_pb2.Flow, capacity: int = 100) -> FlowGraph:
    graph = FlowGraph(capacity)
    graph.add_all(summarize(f) for f in flows)
    return graph


def test_pods_become_nodes_in_their_namespace_and_flows_become_edges_by_verdict() -> None:
    graph = _graph(
        tcp_flow(FRONT, BACK),
        tcp_flow(FRONT, BACK),
        tcp_flow(OTHER, BACK, verdict=flow_pb2.DROPPED),
    )
    snap = graph.snapshot(table_rows=10)
    assert [n["id"] for n in snap["nodes"]] == [
        "pod:shop/backend",
        "pod:shop/frontend",
        "pod:shop/other",
    ]
    assert {n["namespace"] for n in snap["nodes"]} == {NS} and snap["namespaces"] == [NS]
    assert snap["edges"] == [
        {
            "id": "pod:shop/frontend->pod:shop/backend:FORWARDED",
            "source": "pod:shop/frontend",
            "target": "pod:shop/backend",
            "verdict": "FORWARDED",
            "flows": 2,
            "ports": ["TCP/8080"],
            "drop_reasons": [],
        },
        {
            "id": "pod:shop/other->pod:shop/backend:DROPPED",
            "source": "pod:shop/other",
            "target": "pod:shop/backend",
            "verdict": "DROPPED",
            "flows": 1,
            "ports": ["TCP/8080"],
            "drop_reasons": ["POLICY_DENIED"],
        },
    ]


def test_a_pair_with_forwarded_and_dropped_flows_gets_two_edges() -> None:
    graph = _graph(
        tcp_flow(FRONT, BACK, 8080),
        tcp_flow(FRONT, BACK, 9090, verdict=flow_pb2.DROPPED),
    )
    edges = {(e["verdict"], tuple(e["ports"])) for e in graph.edges()}
    assert edges == {("FORWARDED", ("TCP/8080",)), ("DROPPED", ("TCP/9090",))}


def test_a_reply_counts_on_the_edge_of_the_connection_it_answers() -> None:
    graph = _graph(tcp_flow(FRONT, BACK, 8080), tcp_flow(BACK, FRONT, 8080, reply=True))
    (edge,) = graph.edges()
    assert (edge["source"], edge["target"], edge["flows"]) == (
        "pod:shop/frontend",
        "pod:shop/backend",
        2,
    )
    assert edge["ports"] == ["TCP/8080"]  # the reply's source port is the service port


def test_oldest_flows_are_forgotten_with_their_edges_and_nodes() -> None:
    graph = _graph(
        tcp_flow(OTHER, BACK, verdict=flow_pb2.DROPPED),
        tcp_flow(FRONT, BACK),
        tcp_flow(FRONT, BACK),
        capacity=2,
    )
    snap = graph.snapshot(table_rows=10)
    assert [e["verdict"] for e in snap["edges"]] == ["FORWARDED"]
    assert snap["edges"][0]["flows"] == 2
    assert "pod:shop/other" not in {n["id"] for n in snap["nodes"]}
    assert (snap["buffered"], snap["seen"]) == (2, 3)


def test_eviction_keeps_counts_of_ports_and_reasons_exact() -> None:
    graph = _graph(
        tcp_flow(FRONT, BACK, 80),
        tcp_flow(FRONT, BACK, 443),
        tcp_flow(FRONT, BACK, 443),
        capacity=2,
    )
    (edge,) = graph.edges()
    assert edge["ports"] == ["TCP/443"] and edge["flows"] == 2


def test_endpoints_without_a_pod_are_reserved_identities_or_addresses() -> None:
    world = flow_pb2.Endpoint(identity=2, labels=["reserved:world"])
    assert endpoint_node(world, "1.1.1.1").id == "reserved:world"
    assert endpoint_node(world, "1.1.1.1").kind == "reserved"
    remote = flow_pb2.Endpoint(identity=70001, labels=["k8s:app=x"])
    assert endpoint_node(remote, "10.9.0.1").id == "identity:70001"
    assert endpoint_node(flow_pb2.Endpoint(), "10.9.0.1").id == "ip:10.9.0.1"


def test_table_holds_the_newest_rows_first_with_verdict_and_reason() -> None:
    flows = [tcp_flow(FRONT, BACK, seconds=1_760_000_000 + i) for i in range(5)]
    flows.append(tcp_flow(OTHER, BACK, verdict=flow_pb2.DROPPED, seconds=1_760_000_010))
    rows = _graph(*flows).snapshot(table_rows=3)["flows"]
    assert len(rows) == 3
    assert rows[0]["verdict"] == "DROPPED" and rows[0]["drop_reason"] == "POLICY_DENIED"
    assert rows[0]["time"] == "2025-10-09T08:53:30.000Z"
    assert [r["time"][-8:-5] for r in rows[1:]] == [":24", ":23"]
    assert rows[0]["source_label"] == "other" and rows[0]["l4"] == "TCP/8080"
