"""Live migration cluster-pool → multi-pool with two agents whose pods ping throughout.

A private :class:`cilia_testkit.stack.Stack` (not the session's: the operator has to run in
cluster-pool mode first): its own ``redis-server``, ``cilia-operator serve --ipam
cluster-pool`` and two ``cilia-agent serve --ipam cluster-pool`` as two nodes on this host.
Each agent has its own node name, state dir, sockets, CNI conf dir, bpffs pin dir and host
device (the kit's ``cilia_t<slot>a<i>``); Hubble TCP is off. Both datapaths share the host's kernel routing table: each
pod's /32 host route is installed by its own agent, so pods of the two nodes reach each
other through the host without routes between the nodes' pod CIDRs (what native routing
between hosts would add), and each agent's BPF programs sit only on its own pods' veths.

Then, as upstream's procedure (reference: cilium-upstream.md §3): the operator is
restarted with ``--ipam multi-pool --enable-cluster-pool-to-multi-pool-migration`` and a
default pool covering the old cluster CIDR with the same mask; once every CiliumNode lists
its podCIDR under ``pools.allocated[default]`` the agents are restarted one at a time with
``--ipam multi-pool``. Two ``ping -i 0.2`` streams (a→b and b→a) run from before the first
restart until after the last; every pod must keep its address, and no ping may be lost.
Afterwards a pod annotated ``ipam.cilium.io/ip-pool: blue`` (a second pool the restarted
operator auto-created) gets its address from that pool through the real ResolvePool/demand/allocation path.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from cilia_testkit import cni, host, netns
from cilia_testkit.stack import Agent, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

CLUSTER_CIDR = "10.243.0.0/16"  # this test's own range (stack 10.200/16, agent tests 10.251/16)
MASK = 24
READY_SECONDS = 60.0
STOP_SECONDS = 15.0
# Pods' netns prefix: deliberately not conftest's "cilia-e2e-", whose stale-pod sweep (run by
# any other e2e session on this shared host) would delete these pods' netns mid-test.
NETNS_PREFIX = "cilia-ipmig-"
# The private stack's logs are copied here at the end of each run (pytest's tmp dirs rotate
# quickly on a shared host).
LOG_COPY = pathlib.Path("/tmp/cilia-e2e-ipam-migration-logs")
MIGRATION_SECONDS = 30.0
PING_INTERVAL = "0.2"
BLUE_CIDR = "10.242.0.0/16"
# How long a pod of a pool new to the node keeps getting "no free address" (101) while the
# agent's demand reaches the operator and the block comes back (kubelet retries the same way).
POOL_DELIVERY_SECONDS = 30.0


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces, veth, iptables, BPF")
    for tool in ("ip", "ping", "redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool!r} on PATH (scripts/setup.sh installs it)")


def _endpoints(agent: Agent) -> dict[str, str]:
    """``pod name → IPv4`` of ``agent``'s endpoints (``cilia-agent endpoint list``)."""
    out = agent.endpoint_list("-o", "json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout or "[]")
    if isinstance(data, dict):
        data = data.get("endpoints", [])
    return {e["pod_name"]: str(e["ipv4"]).split("/")[0] for e in data}


def _ipam_status(stack: Stack) -> dict[str, Any] | None:
    """``cilia-operator ipam status -o json`` (GetStatus as JSON), None on failure."""
    out = stack.operator_cli("ipam", "status", "-o", "json")
    if out.returncode != 0:
        return None
    data = json.loads(out.stdout)
    assert isinstance(data, dict)
    return data


class PingStream:
    """``ping -i 0.2`` from pod ``src`` to ``address`` until :meth:`finish`."""

    def __init__(self, src: cni.Pod, address: str) -> None:
        self.label = f"{src.name} -> {address}"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", src.name, "ping", "-n", "-i", PING_INTERVAL, address],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def finish(self) -> tuple[int, int, str]:
        """Stop it (SIGINT: ping prints its summary); ``(transmitted, received, output)``."""
        self.proc.send_signal(signal.SIGINT)
        out, _ = self.proc.communicate(timeout=15)
        match = re.search(r"(\d+) packets transmitted, (\d+) received", out)
        assert match, f"{self.label}: no ping summary:\n{out[-2000:]}"
        return int(match.group(1)), int(match.group(2)), out


@pytest.fixture
def private_stack() -> Iterator[Stack]:
    """Redis of a test kit stack with two agents (no relay, no Hubble TCP, no pool of the
    kit's: the operator's IPAM flags come from the test); the test starts the operator and
    the agents. Everything is stopped at the end and the logs copied to :data:`LOG_COPY`."""
    _require_root()
    stack = Stack(
        "ipmig", agents=2, relay=False, hubble_tcp=False, auto_pool=False,
        agent_args=("--operator-reconnect-max-backoff", "2"),
    )  # fmt: skip
    try:
        for name in netns.list_netns(NETNS_PREFIX):  # pods of an earlier, killed run
            netns.delete_netns(name)
        stack.prepare()
        stack.start_redis()
        yield stack
    finally:
        shutil.rmtree(LOG_COPY, ignore_errors=True)
        LOG_COPY.mkdir(parents=True)
        for proc in stack.components().values():
            if proc.log.exists():
                shutil.copy(proc.log, LOG_COPY / proc.log.name)
        stack.stop()


def _pod(name: str) -> cni.Pod:
    pod = cni.Pod(name=f"{NETNS_PREFIX}{os.getpid()}-{name}", namespace="mig")
    pod.create_netns()
    return pod


def _add_until_ready(
    pod: cni.Pod, agent: Agent, annotations: dict[str, str]
) -> list[cni.CniOutcome]:
    """ADD with ``args.cni.annotations``, retried while the pool has no block here yet."""
    conf = cni.plugin_netconf(agent.conflist())
    conf["args"] = {"cni": {"annotations": annotations}}
    outcomes: list[cni.CniOutcome] = []

    def attempt() -> bool:
        out = cni.invoke(
            "ADD",
            stdin=json.dumps(conf),
            container_id=pod.container_id,
            netns=pod.netns,
            ifname=pod.ifname,
            args=cni.cni_args(pod.namespace, pod.name, pod.container_id),
        )
        outcomes.append(out)
        if out.returncode == 0:
            pod.result = out.json
        return out.returncode == 0

    host.wait_for(attempt, POOL_DELIVERY_SECONDS, interval=0.5)
    return outcomes


def _pod_cidrs(stack: Stack) -> dict[str, str]:
    """``node → its one podCIDR`` (CiliumNode spec.ipam.podCIDRs) from GetStatus."""
    status = _ipam_status(stack)
    assert status is not None and status.get("mode") == "cluster-pool", status
    out = {}
    for node in status.get("nodes", []):
        cidrs = node.get("podCidrs", [])
        assert len(cidrs) == 1, status
        out[node["nodeName"]] = str(cidrs[0])
    return out


def _migrated(stack: Stack, expected: dict[str, str]) -> bool:
    status = _ipam_status(stack) or {}
    if status.get("migration") != "done":
        return False
    for node in status.get("nodes", []):
        name = node.get("nodeName")
        if name in expected:
            allocated = {p["pool"]: p.get("cidrs", []) for p in node.get("allocated", [])}
            if allocated.get("default") != [expected[name]]:
                return False
    return True


def test_cluster_pool_to_multi_pool_migration_keeps_addresses_and_pings(
    private_stack: Stack,
) -> None:
    stack = private_stack
    a1, a2 = stack.agents
    stack.start_operator(
        "--ipam",
        "cluster-pool",
        "--cluster-pool-ipv4-cidr",
        CLUSTER_CIDR,
        "--cluster-pool-ipv4-mask-size",
        str(MASK),
    )
    for agent in stack.agents:  # both load their datapath at once
        agent.launch("--ipam", "cluster-pool")
    for agent in stack.agents:
        agent.wait_ready()
    pods = {"a1": _pod("a1"), "a2": _pod("a2"), "b1": _pod("b1"), "b2": _pod("b2")}
    owner = {"a1": a1, "a2": a1, "b1": a2, "b2": a2}
    streams: list[PingStream] = []
    try:
        with ThreadPoolExecutor(len(pods)) as pool:
            outs = dict(
                zip(pods, pool.map(lambda k: pods[k].add(owner[k].conflist()), pods), strict=True)
            )
        for key, out in outs.items():
            assert out.returncode == 0, f"ADD {key}: {out.stdout}\n{stack.logs()}"
        cidr = _pod_cidrs(stack)
        assert set(cidr) == {a1.node_name, a2.node_name}, cidr
        assert cidr[a1.node_name] != cidr[a2.node_name], cidr
        before = {k: p.ip for k, p in pods.items()}
        for key, ip in before.items():
            assert ipaddress.ip_address(ip) in ipaddress.ip_network(cidr[owner[key].node_name]), (
                key,
                ip,
                cidr,
            )
        # The streams start once both directions answer (each node learns the other's pods
        # through the operator's ipcache stream).
        t0 = time.monotonic()
        for src, dst in (("a1", "b1"), ("b2", "a2")):
            assert host.wait_for(
                lambda s=src, d=dst: netns.ping(pods[s].name, before[d], count=1), 20
            ), stack.logs()
        print(f"\ncross-node pings answered {time.monotonic() - t0:.1f} s after the ADDs")
        streams = [
            PingStream(pods["a1"], before["b1"]),
            PingStream(pods["b2"], before["a2"]),
        ]

        # 1. Operator: multi-pool with the migration; default pool = the old cluster CIDR.
        stack.stop_component("operator")
        stack.start_operator(
            "--ipam",
            "multi-pool",
            "--enable-cluster-pool-to-multi-pool-migration",
            "--auto-create-cilium-pod-ip-pools",
            f"default=ipv4-cidrs:{CLUSTER_CIDR};ipv4-mask-size:{MASK}",
            "--auto-create-cilium-pod-ip-pools",
            f"blue=ipv4-cidrs:{BLUE_CIDR};ipv4-mask-size:28",  # used only after the switch
        )
        assert host.wait_for(lambda: _migrated(stack, cidr), MIGRATION_SECONDS), (
            json.dumps(_ipam_status(stack), indent=1) + stack.logs()
        )
        # 2. Agents switched one at a time; each restores its pods with their addresses.
        for agent in stack.agents:
            agent.stop()
            agent.start("--ipam", "multi-pool")
            mine = {k: before[k] for k in pods if owner[k] is agent}
            restored = _endpoints(agent)
            assert {k: restored.get(pods[k].name) for k in mine} == mine, (
                f"{agent.node_name} restored {restored}; logs in {LOG_COPY}\n"
                + "\n".join(
                    line[-300:]
                    for line in agent.process.log.read_text().splitlines()
                    if "restore" in line or "endpoint" in line
                )
            )
            # A new flow (new ICMP id) crosses the restarted node too.
            assert netns.ping(pods["a1"].name, before["b1"], count=3), stack.logs()
        # After the switch, concurrently: a pod on a1 gets a fresh address of the same node
        # CIDR; and, non-default pools being usable once every agent runs multi-pool, a pod
        # on a2 annotated for a new pool gets its address from it (ResolvePool, demand, a
        # block of that pool for the node).
        late, blue = _pod("a3"), _pod("b3")
        pods.update(a3=late, b3=blue)
        owner.update(a3=a1, b3=a2)
        with ThreadPoolExecutor(2) as pool:
            late_add = pool.submit(late.add, a1.conflist())
            blue_adds = pool.submit(_add_until_ready, blue, a2, {"ipam.cilium.io/ip-pool": "blue"})
            out, outcomes = late_add.result(), blue_adds.result()
        assert out.returncode == 0, out.stdout + stack.logs()
        assert ipaddress.ip_address(late.ip) in ipaddress.ip_network(cidr[a1.node_name])
        assert late.ip not in before.values()
        assert outcomes[-1].returncode == 0, [o.stdout for o in outcomes] + [stack.logs()]
        assert all(o.json.get("code") in (11, 101) for o in outcomes[:-1]), outcomes
        assert ipaddress.ip_address(blue.ip) in ipaddress.ip_network(BLUE_CIDR), blue.ip
        assert netns.ping(blue.name, before["a1"], count=1), stack.logs()
        time.sleep(1.0)  # a few more pings of the streams after the last switch
    finally:
        results = [(s.label, *s.finish()[:2]) for s in streams]

        def remove(key: str) -> None:
            pod = pods[key]
            if pod.result is not None and owner[key].process.running():
                with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
                    pod.delete(owner[key].conflist(), timeout=30)
            pod.destroy_netns()

        with ThreadPoolExecutor(len(pods)) as pool:
            list(pool.map(remove, list(pods)))
    lost = {label: sent - got for label, sent, got in results}
    print(f"\nping streams (sent, received): {results}; lost: {lost}")
    assert all(sent >= 20 for _, sent, _ in results), results
    assert not any(lost.values()), f"pings lost during the migration: {results}\n{stack.logs()}"
    status = _ipam_status(stack)
    assert status is not None and status["mode"] == "multi-pool", status
    assert status["migration"] == "done", status
    assert status.get("nodesMigrated") == status.get("nodesTotal") == 2, status
    for node in status["nodes"]:
        assert not node.get("podCidrs"), node
        allocated = {p["pool"]: p["cidrs"] for p in node.get("allocated", [])}
        assert allocated["default"] == [cidr[node["nodeName"]]], node
