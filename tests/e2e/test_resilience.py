"""The stack under restarts and a hostile firewall: pods keep working, nothing is reused."""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import signal
import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support import assert_pod_ip, current_stack, dump_logs, endpoint_ips

from cilia_testkit import cni, host, netns

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

SENTINEL = "cilia-e2e-sentinel"
# How long an ADD may keep answering "try again later" (11) after an operator restart: the
# agent's reconnect backoff (--operator-reconnect-max-backoff) plus start-up.
ADD_RETRY_SECONDS = 30.0


def _add_all(conflist: dict[str, Any], pods: list[cni.Pod]) -> list[str]:
    for pod in pods:
        out = pod.add(conflist)
        assert out.returncode == 0, out.stdout + dump_logs()
    return [str(assert_pod_ip(p)) for p in pods]


def _assert_mesh(pods: list[cni.Pod]) -> None:
    unreachable = [
        (a.name, b.ip) for a, b in itertools.permutations(pods, 2) if not netns.ping(a.name, b.ip)
    ]
    assert not unreachable, unreachable


def _agent_pid() -> int:
    pid = current_stack().pid("agent")
    assert pid is not None, "the agent is not running"
    return pid


def _restart(component: str) -> None:
    current_stack().restart(component)


def test_pods_survive_agent_kill_9_and_restart_never_reuses_live_ips(
    conflist: dict[str, Any], make_pod: Callable[..., cni.Pod]
) -> None:
    pods = [make_pod(labels={"app": "survivor"}) for _ in range(3)]
    live = _add_all(conflist, pods)

    pid = _agent_pid()
    os.kill(pid, signal.SIGKILL)
    assert host.wait_for(lambda: not os.path.exists(f"/proc/{pid}/stat") or _zombie(pid), 10)
    _assert_mesh(pods)  # the datapath does not need the agent process
    current_stack().start_component("agent")

    _assert_mesh(pods)
    assert set(live) <= endpoint_ips(), "restarted agent lost restored endpoints"
    newcomers = [make_pod(labels={"app": "newcomer"}) for _ in range(4)]
    fresh = _add_all(current_stack().agent.conflist(), newcomers)
    assert not set(fresh) & set(live), f"live pod IPs handed out again: {set(fresh) & set(live)}"
    assert len(set(fresh)) == len(fresh)
    _assert_mesh([pods[0], *newcomers])


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def _allocated_cidrs(node: str) -> dict[str, list[str]]:
    """``spec.ipam.pools.allocated`` of CiliumNode ``node`` via ``cilia-operator get``."""
    out = current_stack().operator_cli("get", "ciliumnodes", node, "-o", "json")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)
    assert data["kind"] == "CiliumNode" and data["metadata"]["name"] == node, data
    allocated = data["spec"]["ipam"]["pools"]["allocated"]
    return {entry["pool"]: sorted(entry["cidrs"]) for entry in allocated}


def test_node_keeps_its_cidr_across_operator_restart(
    conflist: dict[str, Any], make_pod: Callable[..., cni.Pod]
) -> None:
    node = socket.gethostname()
    before = _allocated_cidrs(node)
    assert before.get("default"), before

    _restart("operator")

    assert _allocated_cidrs(node) == before
    pod = make_pod()
    # Like kubelet, retry while the agent reconnects (CNI code 11 = try again later).
    outcomes: list[cni.CniOutcome] = []

    def try_add() -> bool:
        outcomes.append(pod.add(conflist))
        return outcomes[-1].returncode == 0

    assert host.wait_for(try_add, ADD_RETRY_SECONDS, interval=1.0), (
        outcomes[-1].stdout + dump_logs()
    )
    assert all(o.json.get("code") == 11 for o in outcomes[:-1]), [o.stdout for o in outcomes]
    ip = str(assert_pod_ip(pod))
    assert any(ipaddress.ip_address(ip) in ipaddress.ip_network(c) for c in before["default"])


def _rules() -> tuple[list[str], list[str]]:
    return (
        host.sh("iptables", "-S").stdout.splitlines(),
        host.sh("iptables", "-t", "nat", "-S").stdout.splitlines(),
    )


@pytest.fixture
def sentinel_rules() -> Iterator[None]:
    """Foreign rules (as Docker or an admin would have) appended to FORWARD and POSTROUTING."""
    forward = [
        "FORWARD",
        "-s",
        "192.0.2.7/32",
        "-m",
        "comment",
        "--comment",
        SENTINEL,
        "-j",
        "DROP",
    ]
    nat = [
        "POSTROUTING",
        "-s",
        "192.0.2.7/32",
        "-m",
        "comment",
        "--comment",
        SENTINEL,
        "-j",
        "RETURN",
    ]
    host.sh("iptables", "-A", *forward)
    host.sh("iptables", "-t", "nat", "-A", *nat)
    try:
        yield
    finally:
        host.sh("iptables", "-D", *forward, check=False)
        host.sh("iptables", "-t", "nat", "-D", *nat, check=False)


def test_pods_reach_each_other_when_forward_policy_is_drop_and_foreign_rules_stay(
    make_pod: Callable[..., cni.Pod], sentinel_rules: None
) -> None:
    with host.iptables_forward_policy("DROP") as previous:
        before = _rules()
        _restart("agent")  # the agent (re)installs its rules under a DROP policy

        filter_after, nat_after = _rules()
        assert nat_after == before[1]
        assert filter_after == before[0], "agent changed iptables rules it does not own"
        assert "-P FORWARD DROP" in filter_after
        forward = [r for r in filter_after if r.startswith("-A FORWARD")]
        # our jump comes before anything that can drop (dockerd re-inserts its DOCKER-USER jump
        # at the top whenever it sets up a network; Docker's chains RETURN for other devices)
        ours = forward.index("-A FORWARD -j CILIA_FORWARD")
        droppers = [i for i, r in enumerate(forward) if r.endswith(("-j DROP", "-j REJECT"))]
        assert all(ours < i for i in droppers), forward
        assert any(SENTINEL in r for r in forward)
        assert forward.count("-A FORWARD -j CILIA_FORWARD") == 1

        pods = [make_pod() for _ in range(2)]
        _add_all(current_stack().agent.conflist(), pods)
        _assert_mesh(pods)
    assert host.sh("iptables", "-S", "FORWARD").stdout.splitlines()[0] == f"-P FORWARD {previous}"
