"""Client side of ``cilia-agent status``, ``endpoint list`` and ``bpf … list``.

``status`` and ``endpoint list`` talk to the agent's unix socket through
``cilia.agent.v1.DebugService``; when the agent is not running they print one line on
stderr and exit 2. The endpoint's identity and policy enforcement, and the ``bpf``
commands, come from the datapath's pinned maps under ``--bpf-pin-dir`` (read directly,
like upstream ``cilium-dbg bpf``: they work while the agent is down; root needed).
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import pathlib
import socket as socketlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TextIO

import grpc

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia_common.protojson import message_to_dict

EXIT_AGENT_UNAVAILABLE = 2
EXIT_BROKEN_PIPE = 1
"""Exit status when the reader of stdout went away (``| head -1``), as ``cilia-operator``."""

_P = ParamSpec("_P")
DEFAULT_PIN_DIR = pathlib.Path("/sys/fs/bpf/cilia")


class AgentUnavailable(Exception):
    """The agent's socket does not answer (not running, wrong path, no permission)."""


def quiet_on_broken_pipe(command: Callable[_P, int]) -> Callable[_P, int]:
    """Wrap an output command so a closed stdout (``cilia-agent endpoint list | head -1``)
    ends it quietly with :data:`EXIT_BROKEN_PIPE` instead of a BrokenPipeError traceback.

    stdout is flushed inside the wrapper (a write into a closed pipe may only fail at the
    flush), and on EPIPE pointed at /dev/null so the interpreter's final flush at exit does
    not report the error again.
    """

    @functools.wraps(command)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> int:
        try:
            code = command(*args, **kwargs)
            sys.stdout.flush()
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)
            return EXIT_BROKEN_PIPE
        return code

    return wrapper


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


@quiet_on_broken_pipe
def status(
    socket: pathlib.Path, timeout: float, out: TextIO = sys.stdout, output: str = "table"
) -> int:
    """Print the agent status (``output`` "table", or "json": the StatusResponse in
    protobuf's JSON mapping with every field present and 64-bit integers as numbers, e.g.
    ``{"ready": true, "pools": [{"pool": "default", "used": 3, "capacity": 254, ...}]}``);
    exit code 0 when ready, 1 when not ready.

    Raises:
        AgentUnavailable: the socket does not answer.
    """
    resp: agent_pb2.StatusResponse = _call(socket, timeout, "status")
    if output == "json":
        data = message_to_dict(resp)
        out.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return 0 if resp.ready else 1
    reason, *details = resp.message.split("\n")
    state = "ready" if resp.ready else f"not ready ({reason})"
    out.write(f"Node:      {resp.node_name}\n")
    out.write(f"Version:   {resp.version}\n")
    out.write(f"State:     {state}\n")
    out.write(f"Router IP: {resp.router_ip or '-'}\n")
    out.write(f"Endpoints: {resp.endpoint_count}\n")
    for pool in resp.pools:
        draining = f", draining {', '.join(pool.draining_cidrs)}" if pool.draining_cidrs else ""
        out.write(
            f"Pool {pool.pool}: {pool.used}/{pool.capacity} used, "
            f"CIDRs {', '.join(pool.cidrs)}{draining}\n"
        )
    for line in details:
        out.write(f"{line}\n")
    return 0 if resp.ready else 1


def _endpoint_map(pin_dir: pathlib.Path) -> dict[int, Any]:
    """ifindex → ``EndpointInfo`` from the pinned endpoint map ({} when unreadable)."""
    from cilia_agent.datapath.bpffs import PinnedMap, PinnedMapError
    from cilia_agent.datapath.layout import EndpointInfo

    try:
        with PinnedMap(pin_dir / "cilia_endpoints", ctypes.c_uint32, EndpointInfo) as m:
            return {int(k.value): v for k, v in m.items()}
    except PinnedMapError:
        return {}


def _enforcement(info: Any) -> str:
    if info is None:
        return "-"
    parts = [
        d for d, on in (("ingress", info.enforce_ingress), ("egress", info.enforce_egress)) if on
    ]
    text = "+".join(parts) or "none"
    # audit mode (--policy-audit-mode): what enforcement would drop is forwarded and reported
    return f"{text} (audit)" if info.policy_audit else text


def _ifindex(name: str) -> int:
    try:
        return socketlib.if_nametoindex(name)
    except OSError:
        return 0


@quiet_on_broken_pipe
def endpoint_list(
    socket: pathlib.Path,
    timeout: float,
    output: str,
    out: TextIO = sys.stdout,
    pin_dir: pathlib.Path = DEFAULT_PIN_DIR,
) -> int:
    """Print every endpoint as a table or (``output == "json"``) a JSON list.

    Identity and policy enforcement come from the pinned endpoint map under ``pin_dir``
    (the identity falls back to the agent's record; enforcement "-" / absent in JSON when
    the map cannot be read, e.g. BPF disabled). JSON items carry every Endpoint field with
    its .proto name, zero/empty ones too (``identity`` 0 = none), ``id`` as a number.

    Raises:
        AgentUnavailable: the socket does not answer.
    """
    resp: agent_pb2.ListEndpointsResponse = _call(socket, timeout, "list")
    bpf = _endpoint_map(pin_dir)
    infos = {e.id: bpf.get(_ifindex(e.host_ifname)) for e in resp.endpoints}
    if output == "json":
        items = []
        for e in resp.endpoints:
            item = message_to_dict(e, preserving_proto_field_name=True)
            info = infos[e.id]
            if info is not None and int(info.ep_id) == e.id:
                item["identity"] = int(info.sec_identity)
                item["policy_enforcement"] = {
                    "ingress": bool(info.enforce_ingress),
                    "egress": bool(info.enforce_egress),
                }
                item["policy_audit_mode"] = bool(info.policy_audit)
            items.append(item)
        json.dump(items, out, indent=2)
        out.write("\n")
        return 0
    rows = [
        ("ID", "STATE", "IDENTITY", "ENFORCEMENT", "IPV4", "POD", "CONTAINER", "IFNAME", "HOST-IF")
    ]
    for e in resp.endpoints:
        pod = f"{e.pod_namespace}/{e.pod_name}" if e.pod_name else "-"
        info = infos[e.id]
        if info is not None and int(info.ep_id) != e.id:
            info = None
        identity = (
            str(int(info.sec_identity))
            if info is not None
            else (str(e.identity) if e.identity else "-")
        )
        rows.append(
            (
                str(e.id),
                e.state,
                identity,
                _enforcement(info),
                e.ipv4,
                pod,
                e.container_id[:12],
                e.ifname,
                e.host_ifname,
            )
        )
    _table(rows, out)
    return 0


def _table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


_PROTO = {0: "ANY", 1: "ICMP", 6: "TCP", 17: "UDP", 132: "SCTP"}


@quiet_on_broken_pipe
def bpf_policy_list(pin_dir: pathlib.Path, output: str, out: TextIO = sys.stdout) -> int:
    """Print the pinned policy map (every endpoint's entries) with packet/byte counters.

    Raises:
        cilia_agent.datapath.bpffs.PinnedMapError: the map cannot be opened (not root,
            BPF disabled, wrong ``--bpf-pin-dir``).
    """
    from cilia_agent.datapath.bpffs import PinnedMap
    from cilia_agent.datapath.layout import PolicyKey, PolicyValue
    from cilia_agent.policy.maps import decode_key, decode_value

    entries = []
    with PinnedMap(pin_dir / "cilia_policy", PolicyKey, PolicyValue) as m:
        for key, value in m.items():
            ep_id, entry = decode_key(key)
            entries.append(
                {
                    "endpoint_id": ep_id,
                    "direction": "egress" if entry.direction else "ingress",
                    "identity": entry.peer,
                    "protocol": _PROTO.get(entry.protocol, str(entry.protocol)),
                    "port": entry.port,
                    "end_port": entry.last_port if entry.port else 0,
                    "verdict": decode_value(value).value,
                    "packets": int(value.packets),
                    "bytes": int(value.bytes),
                }
            )
    entries.sort(key=lambda e: (e["endpoint_id"], e["direction"], e["identity"], e["port"]))
    if output == "json":
        json.dump(entries, out, indent=2)
        out.write("\n")
        return 0
    rows = [("ENDPOINT", "DIRECTION", "IDENTITY", "PROTO", "PORT", "VERDICT", "PACKETS", "BYTES")]
    for e in entries:
        rows.append(
            (
                str(e["endpoint_id"]),
                str(e["direction"]),
                str(e["identity"]) if e["identity"] else "ANY",
                str(e["protocol"]),
                str(e["port"]) if e["port"] else "ANY",
                str(e["verdict"]),
                str(e["packets"]),
                str(e["bytes"]),
            )
        )
    _table(rows, out)
    return 0


@quiet_on_broken_pipe
def bpf_ipcache_list(pin_dir: pathlib.Path, output: str, out: TextIO = sys.stdout) -> int:
    """Print the pinned ipcache (prefix → identity, hosting node).

    Raises:
        cilia_agent.datapath.bpffs.PinnedMapError: the map cannot be opened.
    """
    from cilia_agent.datapath.bpffs import PinnedMap
    from cilia_agent.datapath.layout import IpcacheKey, IpcacheValue, ip_from_map

    entries = []
    with PinnedMap(pin_dir / "cilia_ipcache", IpcacheKey, IpcacheValue) as m:
        for key, value in m.items():
            entries.append(
                {
                    "prefix": f"{ip_from_map(int(key.ip))}/{int(key.prefixlen)}",
                    "identity": int(value.sec_identity),
                    "node_ip": ip_from_map(int(value.node_ip)) if value.node_ip else "",
                }
            )
    entries.sort(key=lambda e: str(e["prefix"]))
    if output == "json":
        json.dump(entries, out, indent=2)
        out.write("\n")
        return 0
    rows = [("PREFIX", "IDENTITY", "NODE-IP")]
    rows += [(str(e["prefix"]), str(e["identity"]), str(e["node_ip"]) or "-") for e in entries]
    _table(rows, out)
    return 0


@quiet_on_broken_pipe
def bpf_ct_list(pin_dir: pathlib.Path, output: str, out: TextIO = sys.stdout) -> int:
    """Print the pinned conntrack map (upstream ``cilium bpf ct list global``): per entry the
    hook that made it (``OUT`` = from the pod, ``IN`` = to the pod), protocol, source and
    destination as that hook saw the first packet, state (``conntrack.gc.state``), seconds
    since its last packet and since it was made, packets both ways.

    Raises:
        cilia_agent.datapath.bpffs.PinnedMapError: the map cannot be opened.
    """
    import time

    from cilia_agent.conntrack.gc import state
    from cilia_agent.datapath.bpffs import PinnedMap
    from cilia_agent.datapath.layout import CtKey, CtValue, ip_from_map

    now = time.monotonic_ns()
    entries = []
    with PinnedMap(pin_dir / "cilia_ct", CtKey, CtValue) as m:
        for key, value in m.batch_items():
            entries.append(
                {
                    "direction": "OUT" if key.dir == 1 else "IN",
                    "protocol": _PROTO.get(int(key.proto), str(int(key.proto))),
                    "source": f"{ip_from_map(int(key.saddr))}:{socketlib.ntohs(key.sport)}",
                    "destination": f"{ip_from_map(int(key.daddr))}:{socketlib.ntohs(key.dport)}",
                    "state": state(key, value),
                    "idle_seconds": max(0, (now - int(value.last_seen_ns)) // 10**9),
                    "age_seconds": max(0, (now - int(value.created_ns)) // 10**9),
                    "packets": int(value.packets),
                }
            )
    entries.sort(key=lambda e: (e["idle_seconds"], e["source"], e["destination"]))
    if output == "json":
        json.dump(entries, out, indent=2)
        out.write("\n")
        return 0
    rows = [("DIR", "PROTO", "SOURCE", "DESTINATION", "STATE", "IDLE", "AGE", "PACKETS")]
    rows += [
        (str(e["direction"]), str(e["protocol"]), str(e["source"]), str(e["destination"]),
         str(e["state"]), f"{e['idle_seconds']}s", f"{e['age_seconds']}s", str(e["packets"]))
        for e in entries
    ]  # fmt: skip
    _table(rows, out)
    return 0


def bpf_ct_flush(pin_dir: pathlib.Path, out: TextIO = sys.stdout) -> int:
    """Delete every entry of the pinned conntrack map (upstream ``cilium bpf ct flush
    global``); the next packet of each connection is decided by policy again.

    Raises:
        cilia_agent.datapath.bpffs.PinnedMapError: the map cannot be opened or written.
    """
    from cilia_agent.datapath.bpffs import PinnedMap
    from cilia_agent.datapath.layout import CtKey, CtValue

    path = pin_dir / "cilia_ct"
    with PinnedMap(path, CtKey, CtValue) as m:
        flushed = m.clear()
    out.write(f"Flushed {flushed} entries from {path}\n")
    return 0


@quiet_on_broken_pipe
def service_list(pin_dir: pathlib.Path, output: str, out: TextIO | None = None) -> int:
    """Print the load balancer's frontends and backends from the pinned maps (upstream
    ``cilium service list``): ID (rev-NAT index), frontend, type, backends with state.
    ``out`` defaults to the ``sys.stdout`` of the call (not of the import).

    Raises:
        cilia_agent.datapath.libbpf.LibbpfError: the maps cannot be opened (not root,
            load balancer never started, wrong ``--bpf-pin-dir``).
    """
    out = out if out is not None else sys.stdout
    from cilia_agent.loadbalancer.listing import read_frontends

    rows = read_frontends(pin_dir)
    if output == "json":
        json.dump(rows, out, indent=2)
        out.write("\n")
        return 0
    table = [("ID", "FRONTEND", "SERVICE TYPE", "BACKEND")]
    for r in rows:
        lines = [f"{i}) {b['address']} ({b['state']})" for i, b in enumerate(r["backends"], 1)]
        head = (str(r["id"] or "-"), str(r["frontend"] or "-"), str(r["type"] or "-"))
        table.append((*head, lines[0] if lines else "(none)"))
        table += [("", "", "", line) for line in lines[1:]]
    _table(table, out)
    return 0
