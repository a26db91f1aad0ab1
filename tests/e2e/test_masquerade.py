"""Pods reach the outside world as their node (issue 27 item 4), on the netns cluster.

Two nodes (:class:`cilia_testkit.cluster.Cluster`, native routing and VXLAN) and an
"outside" host on the LAN bridge with no route to any pod CIDR
(:meth:`~cilia_testkit.cluster.Cluster.add_outside_host`), running a TCP server that answers
every client with the address it saw (:mod:`cilia_testkit.peer`). The agents run with their
default ``--enable-ipv4-masquerade=true`` (iptables mode), ``--enable-ip-masq-agent`` on a
file the tests rewrite and ``--iptables-reconcile-interval`` 1 s.

Shown: a pod's connect to the outside host succeeds and the outside host sees the node's
LAN address, never a pod's; ICMP echo and UDP get their replies; the agent's metrics; an
agent killed and restarted leaves the chain as it was (pods keep reaching out while it is
down); pod↔pod across nodes keeps pod addresses; a removed jump comes back; a destination listed
in nonMasqueradeCIDRs keeps the pod address; the node's conntrack entry of a translated
connection expires (the kernel's timeouts, shortened in the node's netns); connect latency
through SNAT against the same path without it, in interleaved rounds (printed).
BPF masquerade without the NodePort programs it runs in is refused (the agent exits with one line;
the BPF mode itself is tested in services/agent/tests/privileged/loadbalancer/test_bpf_masquerade.py
and on the kind cluster, tests/k8s).
"""

from __future__ import annotations

import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from cilia_testkit import VENV_BIN, cni, peer, probe
from cilia_testkit.cluster import METRICS_PORT, ROUTING_MODES, Cluster, OutsideHost
from cilia_testkit.host import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

PORT = 9200
#: The outside host's probe server (TCP and UDP greeting, cilia_testkit.probe).
PROBE_PORT = 9300
#: Seconds the agents take at most to apply a changed ip-masq-agent file (1 s interval).
APPLY_SECONDS = 10.0
#: Connects per round and rounds of the latency comparison.
LATENCY_CONNECTS = 50
LATENCY_ROUNDS = 4
#: nf_conntrack timeouts set in the node netns for the expiry test (kernel defaults 120 s/10 s).
CT_TIMEOUT_SECONDS = 3
CT_EXPIRE_WAIT_SECONDS = 20.0
IP_MASQ_DEFAULT = "nonMasqueradeCIDRs:\n- 192.0.2.0/24\n"
SCRAPE = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())"


@dataclass
class World:
    mode: str
    cluster: Cluster
    outside: OutsideHost
    server: peer.Server
    conf: pathlib.Path
    pods: dict[str, cni.Pod]
    pod_servers: dict[str, peer.Server]

    def node_address(self, pod: cni.Pod) -> str:
        return self.cluster.node_of(pod).address

    def pod_ips(self) -> set[str]:
        return {p.ip for p in self.pods.values()}


@pytest.fixture(scope="module", params=ROUTING_MODES)
def world(
    request: pytest.FixtureRequest,
    cluster: Callable[..., Cluster],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[World]:
    mode = str(request.param)
    conf = tmp_path_factory.mktemp(f"masq-{mode}") / "ip-masq-agent"
    conf.write_text(IP_MASQ_DEFAULT)
    c = cluster(
        nodes=2,
        routing=mode,
        name=f"e2e-masq-{mode}",
        relay=False,
        agent_args=[
            "--iptables-reconcile-interval=1",
            "--enable-ip-masq-agent=true",
            f"--ip-masq-agent-config-path={conf}",
        ],
    )
    outside = c.add_outside_host()
    server = peer.start(outside.netns, PORT)
    w = World(mode, c, outside, server, conf, {}, {})
    greeter = probe.start_server(outside.netns, "outside", (PROBE_PORT,))
    try:
        for node in ("node-a", "node-b"):
            pod = c.add_pod(node, f"{mode}-{node[-1]}1", {"app": "masq"})
            w.pods[node] = pod
            w.pod_servers[node] = peer.start(pod.name, PORT)
        yield w
    finally:
        probe.stop(greeter)
        for s in [server, *w.pod_servers.values()]:
            peer.stop(s)
        c.stop()


def test_pods_reach_the_outside_host_as_their_node_never_as_a_pod(world: World) -> None:
    for pod in world.pods.values():
        answers = peer.ask(pod.name, world.outside.address, PORT, rounds=5)
        assert all(a is not None for a in answers), (pod.name, answers, world.cluster.logs(20))
        assert {a.ip for a in answers if a} == {world.node_address(pod)}, answers
    seen = set(world.server.seen())
    assert seen == {n.address for n in world.cluster.nodes.values()}
    assert not seen & world.pod_ips()
    # the chain the agent wrote, as documented
    node = world.cluster.node("node-a")
    nat = node.exec("iptables", "-t", "nat", "-S").stdout
    assert "-A POSTROUTING -j CILIA_POST_nat" in nat
    assert "-j MASQUERADE --random-fully" in nat and "-o eth0" in nat
    # ... and its metrics, among them the kernel's conntrack failures (NAT port shortage)
    metrics = node.exec(sys.executable, "-c", SCRAPE, f"http://127.0.0.1:{METRICS_PORT}/metrics")
    assert 'cilia_masquerade_rules{kind="masquerade"} 1.0' in metrics.stdout
    assert "cilia_nf_conntrack_insert_failed_total " in metrics.stdout


def test_icmp_echo_and_udp_to_the_outside_host_get_their_replies(world: World) -> None:
    """The outside host has no route to a pod: every reply proves the translation."""
    out = world.outside.address
    for pod in world.pods.values():
        results = probe.check_from(pod.name, f"icmp:{out}", f"udp:{out}:{PROBE_PORT}")
        assert all(r.ok for r in results), [(r.target, r.detail) for r in results]


def test_an_agent_killed_and_restarted_leaves_masquerade_in_place(world: World) -> None:
    node = world.cluster.node("node-a")
    pod = world.pods["node-a"]
    before = node.exec("iptables", "-t", "nat", "-S", "CILIA_POST_nat").stdout
    world.cluster.kill_agent("node-a")
    answer = peer.ask(pod.name, world.outside.address, PORT)[0]  # while no agent runs
    assert answer is not None and answer.ip == node.address
    world.cluster.restart_agent("node-a")
    assert node.exec("iptables", "-t", "nat", "-S", "CILIA_POST_nat").stdout == before
    answer = peer.ask(pod.name, world.outside.address, PORT)[0]
    assert answer is not None and answer.ip == node.address


def test_pod_to_pod_across_nodes_keeps_pod_addresses(world: World) -> None:
    a, b = world.pods["node-a"], world.pods["node-b"]
    for src, dst in ((a, b), (b, a)):
        answer = peer.ask(src.name, dst.ip, PORT)[0]
        assert answer is not None and answer.ip == src.ip, (src.name, dst.name, answer)


def test_outside_host_without_masquerade_cannot_answer_and_the_jump_comes_back(
    world: World,
) -> None:
    node = world.cluster.node("node-a")
    pod = world.pods["node-a"]
    seen = len(world.server.seen())
    node.exec("iptables", "-t", "nat", "-D", "POSTROUTING", "-j", "CILIA_POST_nat")
    # the test can fail: without the rule the outside host sees the pod address, and cannot
    # answer it (no route) -- unless the agent has already repaired the jump (1 s interval),
    # in which case the connect succeeds as the node
    answer = peer.ask(pod.name, world.outside.address, PORT, timeout=0.5)[0]
    assert answer is None or answer.ip == node.address
    assert wait_for(
        lambda: (
            "-A POSTROUTING -j CILIA_POST_nat"
            in node.exec("iptables", "-t", "nat", "-S", "POSTROUTING").stdout
        ),
        APPLY_SECONDS,
    ), world.cluster.logs(20)
    again = peer.ask(pod.name, world.outside.address, PORT)[0]
    assert again is not None and again.ip == node.address
    assert not set(world.server.seen()[seen:]) & world.pod_ips()


def _set_ip_masq(world: World, text: str, node: str, present: str) -> None:
    world.conf.write_text(text)
    n = world.cluster.node(node)
    assert wait_for(
        lambda: present in n.exec("iptables", "-t", "nat", "-S", "CILIA_POST_nat").stdout,
        APPLY_SECONDS,
    ), (present, world.cluster.logs(20))


def _latency(pod: cni.Pod, address: str) -> tuple[list[float], int]:
    answers = peer.ask(pod.name, address, PORT, rounds=LATENCY_CONNECTS)
    return [a.seconds for a in answers if a], sum(1 for a in answers if a is None)


def test_non_masquerade_cidr_keeps_the_pod_address_and_connect_latency_compared(
    world: World,
) -> None:
    """nonMasqueradeCIDRs lists the outside host: it sees the pod (given a route back).
    Connect latency with and without SNAT, interleaved rounds, printed (no threshold)."""
    pod, out = world.pods["node-a"], world.outside
    node = world.cluster.node("node-a")
    # the outside host may answer pods of node-a for this test
    cidrs = world.cluster.pod_cidrs()["node-a"]
    for cidr in cidrs:
        subprocess.run(["ip", "-n", out.netns, "route", "add", cidr, "via", node.address],
                       check=True)  # fmt: skip
    excluded = f"nonMasqueradeCIDRs:\n- {out.address}/32\n"
    results: dict[str, list[float]] = {"snat": [], "no-snat": []}
    failures = {"snat": 0, "no-snat": 0}
    try:
        for _ in range(LATENCY_ROUNDS):
            _set_ip_masq(world, IP_MASQ_DEFAULT, "node-a", "192.0.2.0/24")
            answer = peer.ask(pod.name, out.address, PORT)[0]
            assert answer is not None and answer.ip == node.address
            took, failed = _latency(pod, out.address)
            results["snat"] += took
            failures["snat"] += failed
            _set_ip_masq(world, excluded, "node-a", f"-d {out.address}/32")
            answer = peer.ask(pod.name, out.address, PORT)[0]
            assert answer is not None and answer.ip == pod.ip, answer
            took, failed = _latency(pod, out.address)
            results["no-snat"] += took
            failures["no-snat"] += failed
    finally:
        world.conf.write_text(IP_MASQ_DEFAULT)
        for n in world.cluster.nodes.values():  # every agent reads the file on its own tick
            assert wait_for(
                lambda n=n: (
                    f"-d {out.address}/32"
                    not in n.exec("iptables", "-t", "nat", "-S", "CILIA_POST_nat").stdout
                ),
                APPLY_SECONDS,
            ), n.name
        for cidr in cidrs:
            subprocess.run(["ip", "-n", out.netns, "route", "del", cidr], check=False)
    assert failures == {"snat": 0, "no-snat": 0}
    summary = {
        k: f"n={len(v)} median={statistics.median(v) * 1e6:.0f}us "
        f"p90={statistics.quantiles(v, n=10)[-1] * 1e6:.0f}us"
        for k, v in results.items()
    }
    print(f"\nconnect latency pod->outside ({world.mode}, {LATENCY_ROUNDS} rounds): {summary}")


def _conntrack(node_netns: str, pod_ip: str) -> list[str]:
    text = subprocess.run(["ip", "netns", "exec", node_netns, "cat", "/proc/net/nf_conntrack"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [line for line in text.splitlines() if f"src={pod_ip} " in line]


def test_a_translated_connections_conntrack_entry_expires(world: World) -> None:
    node = world.cluster.node("node-b")
    pod = world.pods["node-b"]
    for key in ("tcp_timeout_time_wait", "tcp_timeout_close", "tcp_timeout_fin_wait"):
        node.exec("sysctl", "-qw", f"net.netfilter.nf_conntrack_{key}={CT_TIMEOUT_SECONDS}")
    try:
        answer = peer.ask(pod.name, world.outside.address, PORT)[0]
        assert answer is not None and answer.ip == node.address
        entries = [
            e
            for e in _conntrack(node.netns, pod.ip)
            if f"dport={answer.port} " in e and f"dst={node.address} " in e
        ]
        # the reply tuple goes to the node's address and the NAT port the server saw
        assert entries, _conntrack(node.netns, pod.ip)
        start = time.monotonic()

        def gone() -> bool:
            return not any(f"dport={answer.port} " in e for e in _conntrack(node.netns, pod.ip))

        assert wait_for(gone, CT_EXPIRE_WAIT_SECONDS), _conntrack(node.netns, pod.ip)
        print(f"\nconntrack entry of a masqueraded connection gone after "
              f"{time.monotonic() - start:.1f}s (timeouts {CT_TIMEOUT_SECONDS}s)")  # fmt: skip
    finally:
        for key, default in (("tcp_timeout_time_wait", 120), ("tcp_timeout_close", 10),
                             ("tcp_timeout_fin_wait", 120)):  # fmt: skip
            node.exec("sysctl", "-qw", f"net.netfilter.nf_conntrack_{key}={default}")


def test_bpf_masquerade_without_the_nodeport_programs_is_refused_with_one_line() -> None:
    proc = subprocess.run(
        [
            str(VENV_BIN / "cilia-agent"),
            "serve",
            "--enable-bpf-masquerade=true",
            "--enable-node-port=false",
            "--operator=",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert "--enable-bpf-masquerade needs the BPF NodePort programs" in proc.stderr, proc.stderr
