"""Services without kube-proxy (issue 13): a ClusterIP Service with backends on two nodes of a
real cluster, reached through the agents' eBPF socket load balancer.

Cluster (:class:`cilia_testkit.cluster.Cluster`, native routing), pods plumbed by the real
``cilia-cni``; the ``web-*`` pods serve TCP and UDP on :data:`TARGET_PORT`
(:mod:`cilia_testkit.probe`):

    node-a: web-a (app=web, slot=a), client-a (app=client)
    node-b: web-b (app=web, slot=b), client-b (app=client)

A ``v1 Service`` ``web`` (selector ``app=web``; TCP :data:`TCP_PORT` and UDP
:data:`UDP_PORT`, both to :data:`TARGET_PORT`) is applied to the operator as an ordinary
manifest: the operator gives it a ClusterIP from its ServiceCIDR and keeps its
EndpointSlices from the endpoints the agents report; every agent programs its maps from the
operator's ``WatchServices`` stream. Nothing of kube-proxy exists (no ``KUBE-*`` rule).
A second Service ``web-np`` (same selector, type NodePort, nodePorts from the operator) is
reached from a LAN host that is not a node, through each node's ``bpf_host.c`` programs.
Tests run in file order on one module-scoped cluster; the last ones take web-b out.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import subprocess
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from cilia_testkit import VENV_BIN, cni, probe
from cilia_testkit.cluster import Cluster, Node
from cilia_testkit.host import sh, wait_for
from cilia_testkit.netns import create_netns, delete_netns

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

NS = "default"
SERVICE = "web"
TCP_PORT = 80
UDP_PORT = 53
TARGET_PORT = 8080
#: Seconds for a Service change to reach every agent's maps.
PROGRAMMED_WAIT_SECONDS = 20.0
#: Seconds one request may take before it counts as failed.
REQUEST_TIMEOUT_SECONDS = 2.0
#: Requests of the spread test, and the least share each of the two backends must get
#: (random choice: the expected share is 500, its standard deviation about 16).
SPREAD_REQUESTS = 1000
SPREAD_MIN_SHARE = 350
#: Bytes the held connection sends after its backend left the Service.
HELD_PAYLOAD = 1024 * 1024


@dataclasses.dataclass
class World:
    """The cluster, pods by short name, their servers, the Service's VIP."""

    cluster: Cluster
    pods: dict[str, cni.Pod]
    servers: dict[str, subprocess.Popen[str]]
    vip: str = ""

    def operator(self, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """``cilia-operator ARGV --server <operator>``; fails the test when it fails."""
        out = subprocess.run(
            [str(VENV_BIN / "cilia-operator"), *argv, "--server", self.cluster.operator_address],
            input=stdin, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert out.returncode == 0, f"cilia-operator {argv}: {out.stderr}"
        return out

    def greeting(self, short: str, port: int = TARGET_PORT) -> str:
        return probe.greeting(self.pods[short].name, port)

    def frontends(self, node: Node) -> dict[str, list[dict[str, Any]]]:
        """``cilia-agent service list -o json`` of ``node``: frontend -> backends."""
        out = sh(
            str(VENV_BIN / "cilia-agent"), "service", "list", "--bpf-pin-dir",
            str(node.agent.pin_dir), "-o", "json",
        )  # fmt: skip
        return {row["frontend"]: row["backends"] for row in json.loads(out.stdout) if row["id"]}

    def active_backends(self, node: Node, frontend: str) -> set[str]:
        return {
            b["address"] for b in self.frontends(node).get(frontend, []) if b["state"] == "active"
        }

    def programmed(self, backends: set[str]) -> bool:
        """Every node's maps hold exactly ``backends`` (pod IPs) as the active backends of
        both frontends of the Service."""
        for node in self.cluster.nodes.values():
            for port, proto in ((TCP_PORT, "TCP"), (UDP_PORT, "UDP")):
                want = {f"{ip}:{TARGET_PORT}/{proto}" for ip in backends}
                if self.active_backends(node, f"{self.vip}:{port}/{proto}") != want:
                    return False
        return True


def service_manifest(selector: dict[str, str]) -> str:
    return json.dumps({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE, "namespace": NS},
        "spec": {
            "selector": selector,
            "ports": [
                {"name": "http", "protocol": "TCP", "port": TCP_PORT, "targetPort": TARGET_PORT},
                {"name": "dns", "protocol": "UDP", "port": UDP_PORT, "targetPort": TARGET_PORT},
            ],
        },
    })  # fmt: skip


def nodeport_manifest() -> str:
    """``web-np``: ``web``'s ports as a NodePort Service (nodePorts from the operator)."""
    manifest = json.loads(service_manifest({"app": "web"}))
    manifest["metadata"]["name"] = NODEPORT_SERVICE
    manifest["spec"]["type"] = "NodePort"
    return json.dumps(manifest)


@pytest.fixture(scope="module")
def world(cluster: Any) -> Iterator[World]:
    c: Cluster = cluster(nodes=2, routing="native", name="e2e-services")
    w = World(c, {}, {})
    try:
        for node, short, labels in (
            ("node-a", "web-a", {"app": "web", "slot": "a"}),
            ("node-a", "client-a", {"app": "client"}),
            ("node-b", "web-b", {"app": "web", "slot": "b"}),
            ("node-b", "client-b", {"app": "client"}),
        ):
            pod = c.add_pod(node, f"svc-{short}", labels, namespace=NS)
            w.pods[short] = pod
            if short.startswith("web"):
                w.servers[short] = probe.start_server(pod.name, pod.name, (TARGET_PORT,))
        both = f"{service_manifest({'app': 'web'})}\n---\n{nodeport_manifest()}"
        w.operator("apply", "-f", "-", stdin=both)
        stored = json.loads(w.operator("get", "Service", SERVICE, "-n", NS, "-o", "json").stdout)
        w.vip = str(stored["spec"]["clusterIP"])
        webs = {w.pods["web-a"].ip, w.pods["web-b"].ip}
        assert wait_for(lambda: w.programmed(webs), PROGRAMMED_WAIT_SECONDS), (
            {n: w.frontends(node) for n, node in c.nodes.items()},
            c.logs(30),
        )
        yield w
    finally:
        for server in w.servers.values():
            probe.stop(server)
        c.stop()


def _greetings(results: list[probe.CheckResult]) -> Counter[str]:
    failed = [f"{r.source} -> {r.target}: {r.detail}" for r in results if not r.ok]
    assert not failed, "\n".join(failed[:20])
    return Counter(r.detail.split(" (reply")[0] for r in results)


def test_the_clusterip_comes_from_the_service_cidr(world: World) -> None:
    assert ipaddress.IPv4Address(world.vip) in ipaddress.IPv4Network("10.96.0.0/12"), world.vip


def test_clusterip_answers_from_pods_on_every_node_and_from_each_node(world: World) -> None:
    w = world
    sources = [w.pods["client-a"].name, w.pods["client-b"].name]
    sources += [node.netns for node in w.cluster.nodes.values()]
    jobs = [(src, [f"tcp:{w.vip}:{TCP_PORT}"] * 10) for src in sources]
    results = probe.check_many(jobs, timeout=REQUEST_TIMEOUT_SECONDS)
    greetings = _greetings(results)
    assert sum(greetings.values()) == 10 * len(sources)
    assert set(greetings) <= {w.greeting("web-a"), w.greeting("web-b")}, greetings


def test_a_thousand_requests_spread_over_both_backends(world: World) -> None:
    w = world
    half = SPREAD_REQUESTS // 2
    jobs = [
        (w.pods[src].name, [f"tcp:{w.vip}:{TCP_PORT}"] * half) for src in ("client-a", "client-b")
    ]
    greetings = _greetings(probe.check_many(jobs, timeout=REQUEST_TIMEOUT_SECONDS, deadline=300))
    assert sum(greetings.values()) == SPREAD_REQUESTS
    for web in ("web-a", "web-b"):
        assert greetings[w.greeting(web)] >= SPREAD_MIN_SHARE, greetings


def test_udp_through_the_clusterip_is_answered_from_the_vip(world: World) -> None:
    w = world
    results = probe.check_from(
        w.pods["client-b"].name, *[f"udp:{w.vip}:{UDP_PORT}"] * 20, timeout=REQUEST_TIMEOUT_SECONDS
    )
    assert all(r.ok for r in results), [r.detail for r in results if not r.ok]
    for r in results:  # the socket saw the VIP answer, not the backend
        assert r.detail.endswith(f"(reply from {w.vip}:{UDP_PORT})"), r.detail
    assert set(_greetings(results)) <= {w.greeting("web-a"), w.greeting("web-b")}


def test_no_kube_proxy_rules_exist(world: World) -> None:
    """Services work (above) and nothing of kube-proxy is installed: no ``KUBE-*`` chain or
    rule in the host's or any node's iptables."""
    dumps = [sh("iptables-save").stdout]
    dumps += [node.exec("iptables-save").stdout for node in world.cluster.nodes.values()]
    kube = [line for d in dumps for line in d.splitlines() if "KUBE-" in line]
    assert not kube, kube[:10]


NODEPORT_SERVICE = "web-np"
#: Requests per node and protocol of the NodePort test; each backend must answer at least
#: one of them (random choice: missing one has a chance of 2 * 2**-NODEPORT_REQUESTS).
NODEPORT_REQUESTS = 40
#: Bytes each NodePort TCP request sends and has acknowledged with the server's digest
#: (several full-size segments through the translation and its checksum fixes).
NODEPORT_PAYLOAD = 200_000
#: Host part of the LAN client's address (on the cluster bridge, not a node).
LAN_CLIENT_HOST = 250

_LAN_CLIENT = textwrap.dedent(
    """
    import hashlib, json, os, socket, sys
    timeout, payload = float(sys.argv[1]), int(sys.argv[2])
    for target in sys.argv[3:]:
        proto, ip, port = target.split(":")
        out = {"target": target}
        try:
            if proto == "tcp":
                with socket.create_connection((ip, int(port)), timeout=timeout) as c:
                    c.settimeout(timeout)
                    r = c.makefile("rb")
                    out["greeting"] = r.readline().decode().strip()
                    out["peer"] = "%s:%d" % c.getpeername()
                    data = os.urandom(payload)
                    c.sendall(data)
                    c.shutdown(socket.SHUT_WR)
                    want = "received %d %s" % (payload, hashlib.sha256(data).hexdigest())
                    out["digest_ok"] = r.readline().decode().strip() == want
            else:
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                    s.settimeout(timeout)
                    s.sendto(b"hello?", (ip, int(port)))
                    data, src = s.recvfrom(65535)
                    out["greeting"] = data.decode().strip()
                    out["peer"] = "%s:%d" % src
                    out["digest_ok"] = True
        except OSError as exc:
            out["error"] = repr(exc)
        print(json.dumps(out), flush=True)
    """
)


_NODE_ADDRS = textwrap.dedent(
    """
    import ctypes, json, pathlib, sys
    from cilia_agent.datapath.layout import ip_from_map
    from cilia_agent.datapath.libbpf import PinnedMap
    from cilia_agent.loadbalancer import nodeaddrs
    from cilia_agent.loadbalancer.layout import NODE_ADDRS_MAP
    pin = pathlib.Path(sys.argv[1])
    if len(sys.argv) > 2:
        nodeaddrs.sync(pin, json.loads(sys.argv[2]))
    with PinnedMap(pin / NODE_ADDRS_MAP, ctypes.c_uint32, ctypes.c_uint8) as pinned:
        print(json.dumps(sorted(ip_from_map(int(k.value)) for k in pinned)))
    """
)


def _node_addrs(pin_dir: Any, addresses: list[str] | None = None) -> list[str]:
    """The addresses in the node's ``cilia_lb4_node_addrs`` map (after setting them to
    ``addresses`` when given), through the agent's own code in the project's .venv."""
    extra = [json.dumps(addresses)] if addresses is not None else []
    out = sh(str(VENV_BIN / "python"), "-c", _NODE_ADDRS, str(pin_dir), *extra)
    return list(json.loads(out.stdout))


def test_nodeport_from_a_lan_host_reaches_backends_on_both_nodes(world: World) -> None:
    """A host on the cluster's LAN that is not a node (a netns with a veth on the bridge)
    reaches a NodePort Service on node-a's and on node-b's address, TCP and UDP: over
    :data:`NODEPORT_REQUESTS` requests per node and protocol both backends answer (web-a is
    local to node-a and remote to node-b, and the reverse: DNAT and SNAT paths on each
    node), every reply comes from the node address and nodePort the client used (reverse
    NAT), TCP payloads arrive intact; and still no ``KUBE-*`` rule exists anywhere."""
    w = world
    c = w.cluster
    webs = {w.pods["web-a"].ip, w.pods["web-b"].ip}
    node_ports: dict[str, int] = {}

    def programmed() -> bool:
        """Both nodes serve web-np's nodePorts (0.0.0.0 frontends) with both backends."""
        found: dict[str, int] = {}
        for node in c.nodes.values():
            for frontend, backends in w.frontends(node).items():
                address, port_proto = frontend.split(":")
                port, proto = port_proto.split("/")
                want = {f"{ip}:{TARGET_PORT}/{proto}" for ip in webs}
                active = {b["address"] for b in backends if b["state"] == "active"}
                if address == "0.0.0.0" and active == want:
                    found[f"{node.name}/{proto}"] = int(port)
        node_ports.update({k.split("/")[1]: v for k, v in found.items()})
        return len(found) == 2 * len(c.nodes)

    assert wait_for(programmed, PROGRAMMED_WAIT_SECONDS), {
        n: w.frontends(node) for n, node in c.nodes.items()
    }
    assert set(node_ports) == {"TCP", "UDP"}
    assert all(30000 <= p <= 32767 for p in node_ports.values()), node_ports  # operator's range
    client = f"{c.prefix}lanclient"
    veth = f"cl{c.slot}lan"
    client_ip = str(c.lan.network_address + LAN_CLIENT_HOST)
    # A harness artefact: every node's socket-LB is attached to this host's one root cgroup,
    # which the LAN client's process shares (a real LAN host is another machine). With the
    # nodes' own addresses in their cilia_lb4_node_addrs maps, the socket-LB would take the
    # client's connect to <node>:<nodePort> for a local one and send it straight to a
    # backend, so bpf_host's NodePort path -- what this test is about -- would never run.
    # The maps are emptied while the client runs and given back afterwards.
    saved = {name: _node_addrs(node.agent.pin_dir) for name, node in c.nodes.items()}
    for node in c.nodes.values():
        _node_addrs(node.agent.pin_dir, [])
    create_netns(client)
    try:
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", client)
        sh("ip", "link", "set", veth, "master", c.bridge, "up")
        sh("ip", "-n", client, "addr", "add", f"{client_ip}/{c.lan.prefixlen}", "dev", "eth0")
        sh("ip", "-n", client, "link", "set", "eth0", "up")
        nodes = [c.nodes["node-a"].address, c.nodes["node-b"].address]
        targets = [
            f"{proto.lower()}:{ip}:{port}"
            for ip in nodes
            for proto, port in node_ports.items()
            for _ in range(NODEPORT_REQUESTS)
        ]
        out = sh(
            "ip", "netns", "exec", client, "python3", "-c", _LAN_CLIENT,
            str(REQUEST_TIMEOUT_SECONDS), str(NODEPORT_PAYLOAD), *targets, timeout=300,
        )  # fmt: skip
    finally:
        delete_netns(client)
        for name, node in c.nodes.items():
            _node_addrs(node.agent.pin_dir, saved[name])
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(results) == len(targets)
    failed = [r for r in results if "error" in r or not r["digest_ok"]]
    assert not failed, failed[:10]
    answered: dict[str, Counter[str]] = {}
    for r in results:
        _, ip, port = r["target"].split(":")
        assert r["peer"] == f"{ip}:{port}", r  # the client sees the node, not the backend
        answered.setdefault(r["target"], Counter())[r["greeting"]] += 1
    greetings = {w.greeting("web-a"), w.greeting("web-b")}
    for target, counts in answered.items():
        assert set(counts) == greetings, (target, counts)
    dumps = [sh("iptables-save").stdout]
    dumps += [node.exec("iptables-save").stdout for node in c.nodes.values()]
    assert not [line for d in dumps for line in d.splitlines() if "KUBE-" in line]


_HOLD = textwrap.dedent(
    """
    import hashlib, os, socket, sys
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
    reader = conn.makefile("rb")
    print(reader.readline().decode().strip(), flush=True)
    sys.stdin.readline()  # held until the test says go
    data = os.urandom(int(sys.argv[3]))
    conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)
    print(reader.readline().decode().strip(), hashlib.sha256(data).hexdigest(), flush=True)
    """
)


def test_a_backend_taken_out_gets_no_new_connections_and_its_established_ones_finish(
    world: World,
) -> None:
    """While requests run from both clients, web-b leaves the Service (its selector narrows
    to ``slot=a``, as a terminating pod leaves the ready endpoints): a connection already
    established to web-b finishes its transfer, no request fails, and once every agent's
    maps hold web-a alone every new request lands on web-a. Then web-b's pod is deleted."""
    w = world
    held = None
    for _ in range(50):  # a connection that landed on web-b
        proc = subprocess.Popen(
            ["ip", "netns", "exec", w.pods["client-a"].name, "python3", "-c", _HOLD,
             w.vip, str(TCP_PORT), str(HELD_PAYLOAD)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() == w.greeting("web-b"):
            held = proc
            break
        proc.kill()
        proc.wait()
    assert held is not None and held.stdin is not None and held.stdout is not None
    jobs = [
        (w.pods[src].name, [f"tcp:{w.vip}:{TCP_PORT}"] * 150) for src in ("client-a", "client-b")
    ]
    outcome: dict[str, list[probe.CheckResult]] = {}
    load = threading.Thread(
        target=lambda: outcome.update(r=probe.check_many(jobs, timeout=REQUEST_TIMEOUT_SECONDS)),
    )
    load.start()
    time.sleep(0.3)
    w.operator("apply", "-f", "-", stdin=service_manifest({"app": "web", "slot": "a"}))
    assert wait_for(lambda: w.programmed({w.pods["web-a"].ip}), PROGRAMMED_WAIT_SECONDS), {
        n: w.frontends(node) for n, node in w.cluster.nodes.items()
    }
    load.join(timeout=120)
    assert not load.is_alive()
    greetings = _greetings(outcome["r"])  # no request failed while web-b was taken out
    assert sum(greetings.values()) == 300
    # the held connection to web-b still works after web-b left the Service
    held.stdin.write("go\n")
    held.stdin.flush()
    answer = held.stdout.readline().split()
    held.wait(timeout=30)
    assert len(answer) == 4 and answer[0] == "received" and answer[1] == str(HELD_PAYLOAD), answer
    assert answer[2] == answer[3], "the server's digest of the transfer differs"
    # new requests all land on web-a
    after = _greetings(probe.check_many(jobs, timeout=REQUEST_TIMEOUT_SECONDS))
    assert after == Counter({w.greeting("web-a"): 300}), after
    # the pod goes away; nothing changes for the Service
    probe.stop(w.servers.pop("web-b"))
    w.cluster.delete_pod(w.pods.pop("web-b"))
    again = _greetings(probe.check_from(w.pods["client-b"].name, *[f"tcp:{w.vip}:{TCP_PORT}"] * 50))
    assert again == Counter({w.greeting("web-a"): 50}), again
