"""Client side of ``cilia-agent status`` and ``cilia-agent endpoint list``.

Both talk to the agent's unix socket through ``cilia.agent.v1.DebugService``.
When the agent is not running they print one line on stderr and exit 2.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, TextIO

import grpc
from google.protobuf import json_format

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc

EXIT_AGENT_UNAVAILABLE = 2


class AgentUnavailable(Exception):
    """The agent's socket does not answer (not running, wrong path, no permission)."""


def _call(socket: pathlib.Path, timeout: float, method: str) -> Any:
    target = f"unix:{socket.absolute()}"
    if not socket.exists():
        raise AgentUnavailable(f"agent not running: socket {socket} does not exist")
    with grpc.insecure_channel(target) as channel:
        stub = agent_pb2_grpc.DebugServiceStub(channel)  # type: ignore[no-untyped-call]
        try:
            if method == "status":
                return stub.Status(agent_pb2.StatusRequest(), timeout=timeout)
            return stub.ListEndpoints(agent_pb2.ListEndpointsRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise AgentUnavailable(
                f"agent not answering on {target}: {getattr(code, 'name', code)}: {details}"
            ) from exc


def status(socket: pathlib.Path, timeout: float, out: TextIO = sys.stdout) -> int:
    """Print the agent status; exit code 0 when ready, 1 when not ready.

    Raises:
        AgentUnavailable: the socket does not answer.
    """
    resp: agent_pb2.StatusResponse = _call(socket, timeout, "status")
    state = "ready" if resp.ready else f"not ready ({resp.message})"
    out.write(f"Node:      {resp.node_name}\n")
    out.write(f"Version:   {resp.version}\n")
    out.write(f"State:     {state}\n")
    out.write(f"Router IP: {resp.router_ip or '-'}\n")
    out.write(f"Endpoints: {resp.endpoint_count}\n")
    for pool in resp.pools:
        out.write(
            f"Pool {pool.pool}: {pool.used}/{pool.capacity} used, CIDRs {', '.join(pool.cidrs)}\n"
        )
    return 0 if resp.ready else 1


def endpoint_list(
    socket: pathlib.Path, timeout: float, output: str, out: TextIO = sys.stdout
) -> int:
    """Print every endpoint as a table or (``output == "json"``) a JSON list.

    Raises:
        AgentUnavailable: the socket does not answer.
    """
    resp: agent_pb2.ListEndpointsResponse = _call(socket, timeout, "list")
    if output == "json":
        items = [
            json_format.MessageToDict(e, preserving_proto_field_name=True) for e in resp.endpoints
        ]
        json.dump(items, out, indent=2)
        out.write("\n")
        return 0
    rows = [("ID", "STATE", "IPV4", "POD", "CONTAINER", "IFNAME", "HOST-IF", "POOL")]
    for e in resp.endpoints:
        pod = f"{e.pod_namespace}/{e.pod_name}" if e.pod_name else "-"
        rows.append(
            (str(e.id), e.state, e.ipv4, pod, e.container_id[:12], e.ifname, e.host_ifname, e.pool)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")
    return 0
