"""Render GetFlows responses like ``hubble observe`` (``-o compact`` and ``-o json``).

Compact (one line per flow)::

    Nov 29 18:40:01.123: default/frontend:40000 (ID:1001) -> default/backend:8080 (ID:1002) to-endpoint FORWARDED (TCP Flags: SYN)

* time: the flow's time in local time, Go's ``Jan _2 15:04:05.000``;
* endpoints: ``namespace/pod:port`` when the pod is known, else ``ip:port``
  (``[ip6]:port``), no port for ICMP; identity ``(ID:n)`` or ``(world)``/``(host)``…
  for reserved identities;
* arrow ``->``; for replies the sides are swapped and the arrow is ``<-``; ``<>``
  when the flow does not say whether it is a reply;
* type: the trace observation point (``to-endpoint``, ``from-endpoint``…) or, for
  drops, the drop reason text (``Policy denied``, ``Policy denied by denylist``);
* verdict and a summary (``TCP Flags: SYN, ACK``, ``UDP``, ``ICMPv4 EchoRequest``).

JSON: the whole ``GetFlowsResponse`` as one line of protobuf JSON with proto field
names (``node_name``, ``source_port``…), as hubble's ``-o json``.

Node status events go to stderr (compact: a sentence; json: a JSON line), only for
``NODE_ERROR`` and ``NODE_UNAVAILABLE`` as hubble does without ``--debug``.
"""

from __future__ import annotations

import datetime
import json

from google.protobuf.json_format import MessageToDict

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2
from cilia.hubble.relay import relay_pb2

RESERVED_IDENTITIES = {
    1: "host",
    2: "world",
    3: "unmanaged",
    4: "health",
    5: "init",
    6: "remote-node",
    7: "kube-apiserver",
    8: "ingress",
}

DROP_REASONS: dict[int, str] = {
    flow_pb2.POLICY_DENIED: "Policy denied",
    flow_pb2.POLICY_DENY: "Policy denied by denylist",
    flow_pb2.AUTH_REQUIRED: "Authentication required",
}
"""Upstream drop reason texts (``pkg/monitor/api``) for the codes Cilia emits."""

OBSERVATION_POINTS = {
    flow_pb2.TO_ENDPOINT: "to-endpoint",
    flow_pb2.TO_PROXY: "to-proxy",
    flow_pb2.TO_HOST: "to-host",
    flow_pb2.TO_STACK: "to-stack",
    flow_pb2.TO_OVERLAY: "to-overlay",
    flow_pb2.FROM_ENDPOINT: "from-endpoint",
    flow_pb2.FROM_PROXY: "from-proxy",
    flow_pb2.FROM_HOST: "from-host",
    flow_pb2.FROM_STACK: "from-stack",
    flow_pb2.FROM_OVERLAY: "from-overlay",
    flow_pb2.FROM_NETWORK: "from-network",
    flow_pb2.TO_NETWORK: "to-network",
}

# Upstream trace sub-types (monitor API): index = CiliumEventType.sub_type of a trace event.
TRACE_SUB_TYPES = (
    "to-endpoint",
    "to-proxy",
    "to-host",
    "to-stack",
    "to-overlay",
    "from-endpoint",
    "from-proxy",
    "from-host",
    "from-stack",
    "from-overlay",
    "from-network",
    "to-network",
)

EVENT_TYPE_DROP = 1
EVENT_TYPE_TRACE = 4

ICMPV4_TYPES = {
    0: "EchoReply",
    3: "DestinationUnreachable",
    5: "Redirect",
    8: "EchoRequest",
    11: "TimeExceeded",
}

TCP_FLAG_ORDER = ("SYN", "ACK", "RST", "FIN", "PSH", "URG", "ECE", "CWR", "NS")


def format_time(response_or_flow_time: datetime.datetime | None) -> str:
    """Go's ``time.StampMilli`` (``Jan _2 15:04:05.000``) of a local datetime; N/A for None."""
    if response_or_flow_time is None:
        return "N/A"
    t = response_or_flow_time
    return f"{t:%b} {t.day:2d} {t:%H:%M:%S}.{t.microsecond // 1000:03d}"


def _local_time(seconds: int, nanos: int) -> datetime.datetime | None:
    if seconds == 0 and nanos == 0:
        return None
    return datetime.datetime.fromtimestamp(seconds + nanos / 1e9)


def format_identity(identity: int) -> str:
    """``(world)`` for reserved identities, else ``(ID:n)``."""
    name = RESERVED_IDENTITIES.get(identity)
    return f"({name})" if name else f"(ID:{identity})"


def _ports(flow: flow_pb2.Flow) -> tuple[int, int]:
    which = flow.l4.WhichOneof("protocol")
    if which == "TCP":
        return flow.l4.TCP.source_port, flow.l4.TCP.destination_port
    if which == "UDP":
        return flow.l4.UDP.source_port, flow.l4.UDP.destination_port
    return 0, 0


def _host(ip: str, port: int, endpoint: flow_pb2.Endpoint, names: list[str]) -> str:
    host = ip
    if endpoint.pod_name:
        host = (
            f"{endpoint.namespace}/{endpoint.pod_name}"
            if endpoint.namespace
            else (endpoint.pod_name)
        )
    elif names:
        host = ",".join(names)
    if port:
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return host


def drop_reason_text(flow: flow_pb2.Flow) -> str:
    """Upstream text of the flow's drop reason (``Policy denied``…), the number if unknown."""
    code = int(flow.drop_reason_desc) or int(flow.drop_reason)
    return DROP_REASONS.get(code, str(code))


def flow_type(flow: flow_pb2.Flow) -> str:
    """``to-endpoint``/``from-endpoint``… for traces, the drop reason text for drops."""
    event = flow.event_type.type
    if event == EVENT_TYPE_DROP or (event == 0 and flow.verdict == flow_pb2.DROPPED):
        return drop_reason_text(flow)
    if event == EVENT_TYPE_TRACE or event == 0:
        point = OBSERVATION_POINTS.get(flow.trace_observation_point)
        if point:
            return point
        sub = flow.event_type.sub_type
        if event == EVENT_TYPE_TRACE and 0 <= sub < len(TRACE_SUB_TYPES):
            return TRACE_SUB_TYPES[sub]
    return "UNKNOWN"


def summary(flow: flow_pb2.Flow) -> str:
    """``TCP Flags: SYN, ACK`` / ``UDP`` / ``ICMPv4 EchoRequest``; empty otherwise."""
    which = flow.l4.WhichOneof("protocol")
    if which == "TCP":
        flags = flow.l4.TCP.flags
        names = [name for name in TCP_FLAG_ORDER if getattr(flags, name)]
        return "TCP Flags: " + ", ".join(names)
    if which == "UDP":
        return "UDP"
    if which == "ICMPv4":
        kind = flow.l4.ICMPv4.type
        return f"ICMPv4 {ICMPV4_TYPES.get(kind, f'Type{kind}')}"
    return ""


def format_compact(flow: flow_pb2.Flow) -> str:
    """One compact line for ``flow`` (see the module docstring), without newline."""
    sport, dport = _ports(flow)
    src = _host(flow.IP.source, sport, flow.source, list(flow.source_names))
    dst = _host(flow.IP.destination, dport, flow.destination, list(flow.destination_names))
    src_id = format_identity(flow.source.identity)
    dst_id = format_identity(flow.destination.identity)
    arrow = "->"
    if not flow.HasField("is_reply"):
        arrow = "<>"
    elif flow.is_reply.value:
        src, dst, src_id, dst_id = dst, src, dst_id, src_id
        arrow = "<-"
    when = format_time(_local_time(flow.time.seconds, flow.time.nanos))
    line = (
        f"{when}: {src} {src_id} {arrow} {dst} {dst_id} "
        f"{flow_type(flow)} {flow_pb2.Verdict.Name(flow.verdict)}"
    )
    text = summary(flow)
    return f"{line} ({text})" if text else line


def format_json(response: observer_pb2.GetFlowsResponse) -> str:
    """The response as one line of protobuf JSON with proto field names."""
    return json.dumps(
        MessageToDict(response, preserving_proto_field_name=True), separators=(",", ":")
    )


def format_node_status(response: observer_pb2.GetFlowsResponse) -> str | None:
    """A sentence for NODE_ERROR/NODE_UNAVAILABLE events (None for informational ones)."""
    status = response.node_status
    names = ", ".join(status.node_names)
    count = len(status.node_names)
    prefix = (
        f"{format_time(_local_time(response.time.seconds, response.time.nanos))} "
        f"[{response.node_name}]"
    )
    if status.state_change == relay_pb2.NODE_ERROR:
        return f"{prefix}: Error {json.dumps(status.message)} on {count} nodes: {names}"
    if status.state_change == relay_pb2.NODE_UNAVAILABLE:
        return f"{prefix}: {count} nodes are unavailable: {names}"
    return None


def format_lost(response: observer_pb2.GetFlowsResponse) -> str:
    """``EVENTS LOST: HUBBLE_RING_BUFFER CPU(0) 12`` for a lost-events response."""
    lost = response.lost_events
    source = flow_pb2.LostEventSource.Name(lost.source)
    cpu = f"CPU({lost.cpu.value})" if lost.HasField("cpu") else "CPU(unknown)"
    return f"EVENTS LOST: {source} {cpu} {lost.num_events_lost}"
