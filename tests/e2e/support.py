"""Helpers shared by the e2e test modules (fixtures live in conftest.py).

They read the session's stack, set by the ``stack`` fixture through :func:`use_stack`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import re
from typing import Any

from cilia_testkit import bpfmaps, cni, host
from cilia_testkit.stack import Stack

#: The e2e stack's pool: not the ``make up`` stack's 10.200.0.0/16, so both run side by side.
POD_CIDR = ipaddress.ip_network("10.209.0.0/16")

_current: Stack | None = None


def use_stack(stack: Stack | None) -> None:
    """Make ``stack`` the one the helpers below talk to (the ``stack`` session fixture)."""
    global _current
    _current = stack


def current_stack() -> Stack:
    """The session's stack.

    Raises:
        RuntimeError: no test requested the ``stack`` fixture yet.
    """
    if _current is None:
        raise RuntimeError("no e2e stack: request the `stack` fixture")
    return _current


def assert_pod_ip(pod: cni.Pod) -> ipaddress.IPv4Address:
    """The pod's address, asserted to be inside the stack's pool :data:`POD_CIDR`."""
    ip = ipaddress.ip_address(pod.ip)
    assert ip in POD_CIDR, f"{pod.name} got {ip}, outside {POD_CIDR}"
    assert isinstance(ip, ipaddress.IPv4Address)
    return ip


def dump_logs() -> str:
    """Tail of the agent and operator logs, for assertion messages."""
    stack = current_stack()
    return "\n".join(stack.components()[name].tail(20) for name in ("agent", "operator"))


def endpoint_list() -> str:
    """``cilia-agent endpoint list -o json`` output of the stack's agent, with its pin dir
    (asserts exit 0)."""
    out = current_stack().agent.endpoint_list("-o", "json")
    assert out.returncode == 0, f"endpoint list exited {out.returncode}: {out.stderr}"
    return out.stdout


def endpoints() -> list[dict[str, Any]]:
    """The agent's endpoints as dicts (accepts a JSON list or ``{"endpoints": [...]}``)."""
    data = json.loads(endpoint_list() or "[]")
    if isinstance(data, dict):
        data = data.get("endpoints", [])
    assert isinstance(data, list), data
    return data


def endpoint_ips() -> set[str]:
    """IPv4 addresses (no prefix) of every endpoint the agent holds."""
    ips = set()
    for ep in endpoints():
        value = ep.get("ipv4") or ep.get("ip") or ""
        if value:
            ips.add(str(value).split("/")[0])
    return ips


def pool_used(pool: str = "default") -> int:
    """``used`` of ``pool`` from ``cilia-agent status -o json`` (or the text form)."""
    out = current_stack().agent_cli("status", "-o", "json")
    if out.returncode == 0:
        data = json.loads(out.stdout)
        for entry in data.get("pools", []):
            if entry.get("pool") == pool:
                return int(entry["used"])
        raise AssertionError(f"pool {pool!r} not in cilia-agent status: {out.stdout}")
    text = current_stack().agent_cli("status")
    assert text.returncode == 0, text.stderr
    match = re.search(rf"{pool}\D*?(\d+)\s*/\s*\d+", text.stdout)
    assert match, f"no '{pool} used/capacity' in cilia-agent status:\n{text.stdout}"
    return int(match.group(1))


def endpoint_keys() -> dict[tuple[str, str], dict[str, Any]]:
    """The agent's endpoints by attachment key ``(container_id, ifname)``."""
    return {(str(ep["container_id"]), str(ep["ifname"])): ep for ep in endpoints()}


def router_ip() -> str:
    """The node's router IP from ``cilia-agent status`` (``Router IP:`` line)."""
    out = current_stack().agent_cli("status")
    match = re.search(r"^Router IP:\s*(\S+)", out.stdout, re.MULTILINE)
    assert match and match.group(1) != "-", f"no router IP in cilia-agent status:\n{out.stdout}"
    return match.group(1)


@dataclasses.dataclass(frozen=True)
class NodeState:
    """Everything a pod attachment leaves on the node, read from outside the agent.

    Attributes:
        endpoints: attachment keys ``(container_id, ifname)`` → endpoint IPv4 (debug API).
        used: addresses in use in the ``default`` pool (router IP included).
        lxc: host veth names (``lxc*``).
        state_files: names of the agent's endpoint state files.
        bpf_endpoints: the datapath endpoint map, ifindex → ``{ep_id, identity, ipv4}``.
        ipcache_pods: ipcache /32 prefixes inside :data:`POD_CIDR` → identity.
    """

    endpoints: dict[tuple[str, str], str]
    used: int
    lxc: frozenset[str]
    state_files: frozenset[str]
    bpf_endpoints: dict[int, dict[str, Any]]
    ipcache_pods: dict[str, int]


def node_state() -> NodeState:
    """Snapshot :class:`NodeState` now (the BPF maps through bpftool: see bpfmaps.bpf_map_dump)."""
    ipcache = bpfmaps.bpf_ipcache(current_stack().agent.pin_dir)
    # One ``cilia-agent status`` exec (each CLI run costs ~1 s of Python start-up on a busy host).
    status = current_stack().agent_cli("status")
    match = re.search(r"^Pool default: (\d+)/\d+ used", status.stdout, re.MULTILINE)
    used = int(match.group(1)) if match else pool_used()
    return NodeState(
        endpoints={k: str(ep.get("ipv4", "")) for k, ep in endpoint_keys().items()},
        used=used,
        lxc=frozenset(host.host_lxc_links()),
        state_files=frozenset(p.name for p in current_stack().agent.state_files()),
        bpf_endpoints=bpfmaps.bpf_endpoints(current_stack().agent.pin_dir),
        ipcache_pods={
            prefix: ident
            for prefix, ident in ipcache.items()
            if prefix.endswith("/32") and ipaddress.ip_address(prefix[:-3]) in POD_CIDR
        },
    )


def pod_object(name: str, node: str, app: str, service_account: str) -> dict[str, Any]:
    """A Pod object bound to ``node`` (``spec.nodeName``; no kubelet runs, so it stays
    Pending) labelled ``app=<app>``, running as ``service_account``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {
            "nodeName": node,
            "serviceAccountName": service_account,
            "automountServiceAccountToken": False,
            "containers": [{"name": "main", "image": "registry.invalid/none:1"}],
        },
    }
