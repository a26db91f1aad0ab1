"""Flows for the UI's tests, built as the agents send them (``flow.Flow`` messages)."""

from __future__ import annotations

from google.protobuf import wrappers_pb2

from cilia.hubble.flow import flow_pb2


def endpoint(namespace: str, pod: str, identity: int = 0, *labels: str) -> flow_pb2.Endpoint:
    """A pod endpoint labelled ``k8s:app=<pod>`` (plus ``labels``)."""
    return flow_pb2.Endpoint(
        identity=identity,
        namespace=namespace,
        pod_name=pod,
        labels=[f"k8s:app={pod}", *labels] if pod else list(labels),
    )


def tcp_flow(
    src: flow_pb2.Endpoint,
    dst: flow_pb2.Endpoint,
    dport: int = 8080,
    *,
    verdict: int = flow_pb2.FORWARDED,
    reply: bool = False,
    seconds: int = 1_760_000_000,
    src_ip: str = "10.0.0.1",
    dst_ip: str = "10.0.0.2",
    node: str = "node-a",
) -> flow_pb2.Flow:
    """One TCP flow ``src → dst:dport`` (a reply has the ports the other way round)."""
    sport, dport_ = (dport, 40000) if reply else (40000, dport)
    flow = flow_pb2.Flow(
        verdict=verdict,  # type: ignore[arg-type]
        node_name=node,
        IP=flow_pb2.IP(source=src_ip, destination=dst_ip, ipVersion=flow_pb2.IPv4),
        l4=flow_pb2.Layer4(TCP=flow_pb2.TCP(source_port=sport, destination_port=dport_)),
        source=src,
        destination=dst,
        traffic_direction=flow_pb2.INGRESS,
        is_reply=wrappers_pb2.BoolValue(value=reply),
    )
    flow.time.seconds = seconds
    if verdict == flow_pb2.DROPPED:
        flow.drop_reason_desc = flow_pb2.POLICY_DENIED
        flow.drop_reason = flow_pb2.POLICY_DENIED
    return flow
