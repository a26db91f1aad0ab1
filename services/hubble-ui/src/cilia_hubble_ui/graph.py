"""Flows → the service map: nodes (pods, identities), edges (who talks to whom, and with
which verdict) and the flow table. Pure logic: no clock, socket or gRPC of its own.

A node is what a flow's endpoint is, in this order of precedence:

* a pod (``namespace/pod_name``; kind ``pod``), placed in its namespace;
* a reserved identity (a ``reserved:<name>`` label: ``world``, ``host``, ``remote-node``,
  ``kube-apiserver`` ...; kind ``reserved``);
* another security identity (kind ``identity``; e.g. a pod of a cluster not seen here);
* its IP address when nothing else is known (kind ``ip``).

An edge is ``(source node, destination node, verdict)``: a pair that had forwarded and dropped
flows is drawn as two edges, so a dropped edge is never hidden under a forwarded one. A reply
(``is_reply``) belongs to the connection it answers, so it counts on the edge of the request's
direction (destination → source), never as an edge of its own. Edges carry their flow count,
their L4 ports (``TCP/8080``; for a reply its source port) and drop reasons.

:class:`FlowGraph` keeps the last ``capacity`` flows; the graph is always that of the flows
kept: adding a flow past capacity removes the oldest one's contribution (counts, then the
edge and nodes nobody else uses). Memory is O(capacity).

Source: what Hubble UI's service map shows (endpoints grouped by namespace, links coloured by
verdict); behaviour re-implemented.
"""

from __future__ import annotations

import datetime
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from cilia.hubble.flow import flow_pb2

RESERVED_PREFIX = "reserved:"


@dataclass(frozen=True)
class Node:
    """One endpoint of the map.

    Attributes:
        id: stable key: ``pod:<ns>/<name>``, ``reserved:<name>``, ``identity:<n>``, ``ip:<addr>``.
        label: what the page writes on it (pod name, ``world``, ``identity 1234``, address).
        namespace: the pod's namespace ("" for others).
        kind: ``pod``, ``reserved``, ``identity`` or ``ip``.
        identity: numeric security identity (0 when unknown).
        labels: the endpoint's labels (``k8s:app=frontend``, ...).
    """

    id: str
    label: str
    namespace: str
    kind: str
    identity: int
    labels: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The node as the page takes it."""
        return {
            "id": self.id,
            "label": self.label,
            "namespace": self.namespace,
            "kind": self.kind,
            "identity": self.identity,
            "labels": list(self.labels),
        }


@dataclass(frozen=True)
class FlowRow:
    """What the map and the table take from one flow.

    Attributes:
        time: RFC 3339 UTC time of the flow ("" when it has none).
        node_name: the agent's node that saw it.
        source, destination: the endpoints as :class:`Node`.
        verdict: ``FORWARDED``, ``DROPPED``, ... (``VERDICT_UNKNOWN`` when unset).
        drop_reason: ``POLICY_DENIED`` ... for a drop ("" otherwise).
        l4: ``TCP/8080`` (destination port), ``UDP/53``, ``ICMPv4`` or "".
        reply_l4: the same for the answered connection (a reply's source port).
        direction: ``INGRESS``, ``EGRESS`` or "".
        is_reply: the flow answers a connection opened the other way.
    """

    time: str
    node_name: str
    source: Node
    destination: Node
    verdict: str
    drop_reason: str
    l4: str
    reply_l4: str
    direction: str
    is_reply: bool

    def edge_key(self) -> tuple[str, str, str]:
        """``(from node id, to node id, verdict)`` in the connection's direction."""
        if self.is_reply:
            return (self.destination.id, self.source.id, self.verdict)
        return (self.source.id, self.destination.id, self.verdict)

    def edge_port(self) -> str:
        """The connection's service port for its edge (a reply's source port)."""
        return self.reply_l4 if self.is_reply else self.l4

    def to_json(self) -> dict[str, Any]:
        """The table row as the page takes it."""
        return {
            "time": self.time,
            "node": self.node_name,
            "source": self.source.id,
            "source_label": self.source.label,
            "destination": self.destination.id,
            "destination_label": self.destination.label,
            "verdict": self.verdict,
            "drop_reason": self.drop_reason,
            "l4": self.l4,
            "direction": self.direction,
            "reply": self.is_reply,
        }


def endpoint_node(endpoint: flow_pb2.Endpoint, address: str) -> Node:
    """The :class:`Node` of a flow endpoint seen at IP ``address`` (precedence in the
    module docstring)."""
    labels = tuple(endpoint.labels)
    identity = int(endpoint.identity)
    if endpoint.pod_name:
        return Node(
            id=f"pod:{endpoint.namespace}/{endpoint.pod_name}",
            label=endpoint.pod_name,
            namespace=endpoint.namespace,
            kind="pod",
            identity=identity,
            labels=labels,
        )
    reserved = sorted(
        lbl.removeprefix(RESERVED_PREFIX) for lbl in labels if lbl.startswith(RESERVED_PREFIX)
    )
    if reserved:
        name = reserved[0]
        return Node(f"reserved:{name}", name, "", "reserved", identity, labels)
    if identity:
        return Node(
            f"identity:{identity}", f"identity {identity}", "", "identity", identity, labels
        )
    return Node(f"ip:{address or '?'}", address or "unknown", "", "ip", 0, labels)


def _l4(layer: flow_pb2.Layer4) -> tuple[str, str]:
    kind = layer.WhichOneof("protocol")
    if kind in ("TCP", "UDP"):
        ports = getattr(layer, kind)
        return f"{kind}/{ports.destination_port}", f"{kind}/{ports.source_port}"
    if kind is None:
        return "", ""
    return kind, kind


def _time(flow: flow_pb2.Flow) -> str:
    if not flow.HasField("time"):
        return ""
    stamp = datetime.datetime.fromtimestamp(
        flow.time.seconds + flow.time.nanos / 1e9, tz=datetime.UTC
    )
    return stamp.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def summarize(flow: flow_pb2.Flow) -> FlowRow:
    """The :class:`FlowRow` of ``flow``."""
    l4, reply_l4 = _l4(flow.l4)
    verdict = (
        flow_pb2.Verdict.Name(flow.verdict)
        if flow.verdict in flow_pb2.Verdict.values()
        else str(flow.verdict)
    )
    drop_reason = ""
    if flow.verdict == flow_pb2.DROPPED:
        reason = flow.drop_reason_desc
        drop_reason = (
            flow_pb2.DropReason.Name(reason)
            if reason in flow_pb2.DropReason.values()
            else str(reason or flow.drop_reason)
        )
    direction = flow.traffic_direction
    return FlowRow(
        time=_time(flow),
        node_name=flow.node_name,
        source=endpoint_node(flow.source, flow.IP.source),
        destination=endpoint_node(flow.destination, flow.IP.destination),
        verdict=verdict,
        drop_reason=drop_reason,
        l4=l4,
        reply_l4=reply_l4,
        direction=flow_pb2.TrafficDirection.Name(direction) if direction else "",
        is_reply=flow.HasField("is_reply") and flow.is_reply.value,
    )


@dataclass
class _Edge:
    flows: int = 0
    ports: Counter[str] = field(default_factory=Counter)
    drop_reasons: Counter[str] = field(default_factory=Counter)


class FlowGraph:
    """The map of the last ``capacity`` flows.

    Args:
        capacity: flows kept (>= 1); the oldest is forgotten first.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.rows: deque[FlowRow] = deque()
        self.seen = 0
        self._edges: dict[tuple[str, str, str], _Edge] = {}
        self._nodes: dict[str, Node] = {}
        self._node_refs: Counter[str] = Counter()

    def add(self, row: FlowRow) -> None:
        """Take one flow (and forget the oldest when full)."""
        if len(self.rows) == self.capacity:
            self._forget(self.rows.popleft())
        self.rows.append(row)
        self.seen += 1
        edge = self._edges.setdefault(row.edge_key(), _Edge())
        edge.flows += 1
        if port := row.edge_port():
            edge.ports[port] += 1
        if row.drop_reason:
            edge.drop_reasons[row.drop_reason] += 1
        for node in (row.source, row.destination):
            self._nodes[node.id] = node  # the newest view of its labels
            self._node_refs[node.id] += 1

    def add_all(self, rows: Iterable[FlowRow]) -> None:
        """:meth:`add` each of ``rows`` in order."""
        for row in rows:
            self.add(row)

    def _forget(self, row: FlowRow) -> None:
        key = row.edge_key()
        edge = self._edges[key]
        edge.flows -= 1
        if port := row.edge_port():
            edge.ports[port] -= 1
            if edge.ports[port] <= 0:
                del edge.ports[port]
        if row.drop_reason:
            edge.drop_reasons[row.drop_reason] -= 1
            if edge.drop_reasons[row.drop_reason] <= 0:
                del edge.drop_reasons[row.drop_reason]
        if edge.flows <= 0:
            del self._edges[key]
        for node in (row.source, row.destination):
            self._node_refs[node.id] -= 1
            if self._node_refs[node.id] <= 0:
                del self._node_refs[node.id]
                del self._nodes[node.id]

    def nodes(self) -> list[Node]:
        """Every node of the kept flows, sorted by namespace then id."""
        return sorted(self._nodes.values(), key=lambda n: (n.namespace, n.id))

    def edges(self) -> list[dict[str, Any]]:
        """Every edge as the page takes it: ``{"id", "source", "target", "verdict", "flows",
        "ports", "drop_reasons"}`` (ports and reasons sorted), sorted by id."""
        out = []
        for (src, dst, verdict), edge in sorted(self._edges.items()):
            out.append(
                {
                    "id": f"{src}->{dst}:{verdict}",
                    "source": src,
                    "target": dst,
                    "verdict": verdict,
                    "flows": edge.flows,
                    "ports": sorted(edge.ports),
                    "drop_reasons": sorted(edge.drop_reasons),
                }
            )
        return out

    def snapshot(self, table_rows: int) -> dict[str, Any]:
        """The page's data: ``{"nodes", "edges", "namespaces", "flows", "buffered", "seen"}``;
        ``flows`` is the newest ``table_rows`` rows, newest first."""
        nodes = self.nodes()
        newest = [
            self.rows[i].to_json()
            for i in range(len(self.rows) - 1, max(-1, len(self.rows) - 1 - table_rows), -1)
        ]
        return {
            "nodes": [n.to_json() for n in nodes],
            "edges": self.edges(),
            "namespaces": sorted({n.namespace for n in nodes if n.namespace}),
            "flows": newest,
            "buffered": len(self.rows),
            "seen": self.seen,
        }
