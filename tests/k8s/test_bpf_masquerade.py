"""BPF masquerade on a real cluster: the chart installed with ``bpf.masquerade=true`` (the
Deckhouse module's mode) on a two-node kind-style cluster without kube-proxy
(cilia_testkit.kind), judged by the "outside" host's own log.

1. ``helm install`` with ``bpf.masquerade=true``: every Cilia pod Ready, the agents run with
   ``--enable-bpf-masquerade=true`` and no node has the iptables chain ``CILIA_POST_nat``;
2. a pod on each node reaches the outside host (no route to any pod CIDR) over TCP (HTTP and
   raw), UDP and ICMP echo; the outside host sees its node's address and never a pod's;
3. pods still reach each other across nodes and through a ClusterIP Service (pod CIDRs and
   nodes are never masqueraded), and each agent counts the flows it masqueraded
   (``cilia_nat_masquerade_flows_total``) and no exhausted port;
4. ``helm uninstall`` leaves no Cilia pin (the masquerade maps included) on the nodes.

Privileged: needs root and the Docker engine (skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from cilia_testkit.kind import KindCluster
from cilia_testkit.kind.docker import docker
from cilia_testkit.kind.install import (
    cluster_values,
    ensure_cilia_images,
    install,
    not_ready,
    uninstall,
)
from cilia_testkit.kind.outside_echo import HTTP_PORT, TCP_PORT, UDP_PORT
from cilia_testkit.kind.pods import echo_pod, in_pod_netns, wait_pods_ready

pytestmark = pytest.mark.privileged

PORT = 8080
NS = "kube-system"
IMAGE_TAG = "0.1.0-bpfmasq"
UDP_ASK = (
    "import socket,sys; s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM); s.settimeout(3); "
    "s.sendto(b'hi',(sys.argv[1],int(sys.argv[2]))); print(s.recvfrom(512)[0].decode().strip())"
)
# three ICMP echo requests on a raw socket (the node image has no ping); prints how many
# replies came back from the address with the request's identifier and sequence and a valid
# ICMP checksum (the datapath rewrote the identifier both ways)
PING = """
import os, socket, struct, sys, time
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xFFFF)
    s += s >> 16
    return ~s & 0xFFFF
dst, ident, ok = sys.argv[1], os.getpid() & 0xFFFF, 0
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(2)
for seq in range(3):
    req = struct.pack("!BBHHH", 8, 0, 0, ident, seq) + b"cilia-bpf-masq!!"
    s.sendto(req[:2] + struct.pack("!H", csum(req)) + req[4:], (dst, 0))
    end = time.time() + 2
    while time.time() < end:
        try:
            data, peer = s.recvfrom(2048)
        except socket.timeout:
            break
        icmp = data[(data[0] & 15) * 4:]
        t, _, _, i, q = struct.unpack("!BBHHH", icmp[:8])
        if peer[0] == dst and t == 0 and i == ident and q == seq and csum(icmp) == 0:
            ok += 1
            break
print(ok)
"""


@pytest.fixture(scope="module")
def cluster(kind_cluster: Callable[..., KindCluster]) -> KindCluster:
    return kind_cluster(nodes=2)


@pytest.fixture(scope="module")
def installed(cluster: KindCluster) -> dict[str, Any]:
    # images of their own tag: another checkout building the version's tag meanwhile does
    # not change what this cluster runs
    tag = {"image": {"tag": IMAGE_TAG}}
    values = cluster_values(
        cluster, bpf={"masquerade": True}, **tag, cni=tag, operator=tag, safeAgentUpdater=tag,
        hubble={"relay": tag, "ui": {"backend": tag}},
    )  # fmt: skip
    ready = install(cluster, values, images=ensure_cilia_images(IMAGE_TAG))
    print(f"\nhelm install (bpf.masquerade=true) -> all Ready {ready:.1f} s")
    return values


@pytest.fixture(scope="module")
def ns(cluster: KindCluster, installed: dict[str, Any]) -> str:
    name = f"bm-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    items = [echo_pod(f"echo-{i}", name, n.name, port=PORT) for i, n in enumerate(cluster.nodes)]
    items.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "echo", "namespace": name},
        "spec": {"selector": {"app": "echo"}, "ports": [{"port": 80, "targetPort": PORT}]},
    })  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                          "items": items}))  # fmt: skip
    wait_pods_ready(cluster, name, "app=echo", len(cluster.nodes))
    return name


def _pods(cluster: KindCluster, ns: str) -> dict[str, tuple[str, str]]:
    """``{pod: (pod IP, node address)}``."""
    items = cluster.get("pods", "-n", ns, "-l", "app=echo")["items"]
    return {p["metadata"]["name"]: (p["status"]["podIP"], cluster.node(p["spec"]["nodeName"]).ip)
            for p in items}  # fmt: skip


def test_install_with_bpf_masquerade_is_ready_without_the_iptables_chain(
    cluster: KindCluster, installed: dict[str, Any]
) -> None:
    assert not_ready(cluster) == []
    ds = cluster.get("daemonset", "-n", NS, "cilia-agent")
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--enable-bpf-masquerade=true" in args and "--enable-ipv4-masquerade=true" in args
    for n in cluster.nodes:
        assert "CILIA_POST_nat" not in cluster.exec(n, "iptables", "-t", "nat", "-S")


def test_pods_reach_the_outside_as_their_node_over_tcp_udp_and_icmp(
    cluster: KindCluster, ns: str
) -> None:
    assert cluster.outside is not None
    out = cluster.outside.ip
    pods = _pods(cluster, ns)
    for pod, (_, node_ip) in pods.items():
        for _ in range(3):
            body = in_pod_netns(cluster, ns, pod, "curl", "-sS", "--max-time", "5",
                                f"http://{out}:{HTTP_PORT}/")  # fmt: skip
            assert body.split()[0] == node_ip, f"{pod} http: {body}"
        tcp = in_pod_netns(cluster, ns, pod, "timeout", "5", "bash", "-c",
                           f"exec 3<>/dev/tcp/{out}/{TCP_PORT}; cat <&3")  # fmt: skip
        assert tcp.split()[0] == node_ip, f"{pod} tcp: {tcp}"
        udp = in_pod_netns(cluster, ns, pod, "python3", "-c", UDP_ASK, out, str(UDP_PORT))
        assert udp.split()[0] == node_ip, f"{pod} udp: {udp}"
        ping = in_pod_netns(cluster, ns, pod, "python3", "-c", PING, out)
        assert ping.strip() == "3", f"{pod} ICMP echo replies: {ping}"
    log = docker("logs", cluster.outside.container_id).stdout
    peers = {line.split()[1].rsplit(":", 1)[0] for line in log.splitlines()
             if line.startswith(("http ", "tcp ", "udp "))}  # fmt: skip
    assert {node for _, node in pods.values()} <= peers, peers
    assert not peers & {ip for ip, _ in pods.values()}, peers
    assert "10.244." not in cluster.exec(cluster.outside.name, "ip", "-4", "route")


def test_pods_and_services_keep_pod_addresses_and_the_agents_count_the_flows(
    cluster: KindCluster, ns: str
) -> None:
    pods = _pods(cluster, ns)
    svc = cluster.get("service", "-n", ns, "echo")["spec"]["clusterIP"]
    for client in pods:
        for server, (ip, _) in pods.items():
            got = in_pod_netns(cluster, ns, client, "timeout", "5", "bash", "-c",
                               f"exec 3<>/dev/tcp/{ip}/{PORT}; cat <&3", check=False)  # fmt: skip
            assert got.strip() == f"hello from {server} on {PORT}", f"{client} -> {server}"
        got = in_pod_netns(cluster, ns, client, "timeout", "5", "bash", "-c",
                           f"exec 3<>/dev/tcp/{svc}/80; cat <&3", check=False)  # fmt: skip
        assert got.strip().startswith("hello from echo-"), f"{client} -> Service {svc}"
    for n in cluster.nodes:
        text = cluster.exec(n, "curl", "-sS", "--max-time", "5", "http://127.0.0.1:9962/metrics")
        flows = re.search(r"^cilia_nat_masquerade_flows_total (\S+)$", text, re.M)
        assert flows and float(flows.group(1)) >= 5, f"{n.name}: {flows}"
        exhausted = re.findall(r'^cilia_nat_port_exhausted_total\{kind="\w+"\} (\S+)$', text, re.M)
        assert exhausted and all(float(v) == 0 for v in exhausted), exhausted


def test_uninstall_leaves_no_pin_on_the_nodes(cluster: KindCluster, ns: str) -> None:
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
    uninstall(cluster)
    for n in cluster.nodes:
        pins = cluster.exec(n, "bash", "-c", "ls -R /sys/fs/bpf 2>/dev/null || true")
        for name in ("cilium_snat_v4_external", "cilium_ipmasq_v4", "cilia_masq_src_v4",
                     "cilia_masq_dev_v4", "cilia_nat_stats"):  # fmt: skip
            assert name not in pins, f"{n.name}: {pins}"
