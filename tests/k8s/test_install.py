"""Cilia installed from its Helm chart on a real three-node Kubernetes cluster without
kube-proxy (cilia_testkit.kind: node containers with containerd + kubelet, the control plane
in the first, CoreDNS), the shipped images running as pods, judged by real traffic.

In file order, on one cluster (each test builds on the ones before); ``long`` ones run in
``make k8s-e2e`` only (``make test`` runs the rest):

1. ``helm install`` with only the API server's address given: every Cilia pod and Node
   Ready, no kube-proxy anywhere;
2. pods on all three nodes reach each other by pod IP (native routing, direct routes), a
   ClusterIP Service (the agents' socket load balancer) and the Service by name through
   CoreDNS, itself reached through its ClusterIP;
3. a pod reaching the "outside" host (no route to any pod CIDR) arrives with its node's
   address: masquerade; the outside host never sees a pod address; the CI subset of the
   upstream e2e suite (``conformance.CI_SPECS``: Services ClusterIP/NodePort, DNS,
   pod-to-pod Conformance specs and five NetworkPolicy specs) passes;
4. ``kill -9`` of one node's agent under traffic from every node's pod (to a pod on the
   next node and to the Service): the kubelet restarts it, not one request fails;
5. (long) ``helm upgrade`` to a second agent image: the safe-agent-updater replaces the
   agents node by node (never two down at once) under the same traffic: 0 failed, no connect
   slower than 1 s; then ``helm rollback``, the same;
6. (long) ``helm upgrade`` to ``routingMode=tunnel``: after the roll, the same traffic
   crosses nodes through VXLAN (each route through ``cilium_vxlan``);
7. (long) a fourth node joins and serves pods within 60 s; a deleted node's CiliumNode and
   routes leave every peer within 10 s; a restarted node container, then the whole cluster
   stopped and started, come back with no hand step;
8. ``helm uninstall``: nothing of Cilia is left on any node (conflist, plugin, pins, devices,
   routes, iptables chains).

Privileged: needs root and the Docker engine (skipped with the reason otherwise, failing in
CI). The upgrade/kill numbers are printed (``pytest -s``) and recorded as test properties.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cilia_testkit.kind import KindCluster
from cilia_testkit.kind.docker import docker
from cilia_testkit.kind.install import (
    CHART,
    cluster_values,
    ensure_cilia_images,
    helm,
    install,
    not_ready,
    uninstall,
    wait_ready,
)
from cilia_testkit.kind.pods import container_pid, echo_pod, in_pod_netns, wait_pods_ready

pytestmark = pytest.mark.privileged

PORT = 8080
NS = "kube-system"


@pytest.fixture(scope="module")
def cluster(kind_cluster: Callable[..., KindCluster]) -> KindCluster:
    return kind_cluster(nodes=3)


@pytest.fixture(scope="module")
def installed(cluster: KindCluster) -> dict[str, Any]:
    started = time.monotonic()
    images = ensure_cilia_images()
    built = time.monotonic() - started
    ready = install(cluster, images=images)
    print(f"\nimages {built:.1f} s, load + helm install -> all Ready {ready:.1f} s")
    return {"values": cluster_values(cluster), "ready_s": ready}


@pytest.fixture(scope="module")
def ns(cluster: KindCluster, installed: dict[str, Any]) -> str:
    name = f"k8s-{uuid.uuid4().hex[:6]}"
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


def _ips(cluster: KindCluster, ns: str) -> dict[str, str]:
    items = cluster.get("pods", "-n", ns, "-l", "app=echo")["items"]
    return {p["metadata"]["name"]: p["status"]["podIP"] for p in items}


def _service_ip(cluster: KindCluster, ns: str) -> str:
    return str(cluster.get("service", "-n", ns, "echo")["spec"]["clusterIP"])


def _hello(cluster: KindCluster, ns: str, client: str, host: str, port: int = PORT) -> str:
    return in_pod_netns(
        cluster, ns, client, "timeout", "5", "bash", "-c",
        f"exec 3<>/dev/tcp/{host}/{port}; cat <&3", check=False,
    ).strip()  # fmt: skip


def _all_pairs_and_service(cluster: KindCluster, ns: str) -> None:
    ips = _ips(cluster, ns)
    svc = _service_ip(cluster, ns)
    for client in ips:
        for server, ip in ips.items():
            assert _hello(cluster, ns, client, ip) == f"hello from {server} on {PORT}", (
                f"{client} -> {server} ({ip})"
            )
        assert _hello(cluster, ns, client, svc, 80).startswith("hello from echo-"), (
            f"{client} -> Service {svc}"
        )


def _eventually_all_pairs_and_service(cluster: KindCluster, ns: str, seconds: float) -> float:
    """:func:`_all_pairs_and_service` passing within ``seconds`` (after a restart, the pods'
    new addresses and endpoints reach every node a moment after the pods are Ready);
    returns the seconds it took."""
    started = time.monotonic()
    while True:
        try:
            _all_pairs_and_service(cluster, ns)
            return time.monotonic() - started
        except AssertionError:
            if time.monotonic() - started > seconds:
                raise
            time.sleep(1)


def test_install_brings_every_cilia_pod_ready_without_kube_proxy(
    cluster: KindCluster, installed: dict[str, Any], record_property: Any
) -> None:
    record_property("install_ready_s", round(installed["ready_s"], 1))
    assert not_ready(cluster) == []
    pods = cluster.get("pods", "-A")["items"]
    assert not [p for p in pods if "kube-proxy" in p["metadata"]["name"]]
    assert not cluster.get("daemonsets", "-A", "-l", "k8s-app=kube-proxy")["items"]
    agents = cluster.get("pods", "-n", NS, "-l", "app=cilia-agent")["items"]
    assert sorted(p["spec"]["nodeName"] for p in agents) == sorted(n.name for n in cluster.nodes)
    # the kubelet reports NotReady until a CNI config exists: the agents wrote theirs
    for n in cluster.nodes:
        assert "05-cilia.conflist" in cluster.exec(n, "ls", "/etc/cni/net.d")
    # two operators, one leader (a Lease held by one of them)
    assert len(wait_pods_ready(cluster, NS, "app=cilia-operator", 2)) == 2


def test_pods_on_every_node_reach_each_other_the_service_and_dns(
    cluster: KindCluster, ns: str
) -> None:
    _all_pairs_and_service(cluster, ns)
    svc = _service_ip(cluster, ns)
    dns = cluster.get("service", "-n", "kube-system", "kube-dns")["spec"]["clusterIP"]
    for client in _ips(cluster, ns):
        answer = in_pod_netns(
            cluster, ns, client, "dig", "+short", "+time=2", "+tries=2", f"@{dns}",
            f"echo.{ns}.svc.cluster.local",
        ).split()  # fmt: skip
        assert answer == [svc], f"{client}: {answer}"


def test_outside_sees_the_node_address_never_a_pod_address(cluster: KindCluster, ns: str) -> None:
    assert cluster.outside is not None
    ips = _ips(cluster, ns)
    nodes = {p["metadata"]["name"]: p["spec"]["nodeName"]
             for p in cluster.get("pods", "-n", ns, "-l", "app=echo")["items"]}  # fmt: skip
    for client in ips:
        body = in_pod_netns(cluster, ns, client, "curl", "-sS", "--max-time", "5",
                            f"http://{cluster.outside.ip}:8080/")  # fmt: skip
        assert body.split()[0] == cluster.node(nodes[client]).ip, f"{client}: {body}"
    # the outside host's log line per request ("http <peer ip>:<port> ..."): node addresses,
    # never a pod's
    log = docker("logs", cluster.outside.container_id).stdout
    peers = {line.split()[1].rsplit(":", 1)[0] for line in log.splitlines()
             if line.startswith(("http ", "tcp ", "udp "))}  # fmt: skip
    assert {cluster.node(nodes[c]).ip for c in ips} <= peers, peers
    assert not peers & set(ips.values()), peers
    routes = cluster.exec(cluster.outside.name, "ip", "-4", "route")
    assert "10.244." not in routes


class Prober:
    """Connects from pod ``client`` to ``host:port`` every ``gap`` seconds in its network
    namespace (bash ``/dev/tcp``, each connect + read cut at 1 s) until stopped; counts
    failures and the slowest success (ms)."""

    def __init__(self, cluster: KindCluster, ns: str, client: str, host: str, port: int,
                 seconds: float, gap: float = 0.2) -> None:  # fmt: skip
        script = (
            f"end=$((SECONDS+{int(seconds)})); while ((SECONDS<end)); do s=$(date +%s%N); "
            f"if timeout 1 bash -c 'exec 3<>/dev/tcp/{host}/{port}; read -t 1 l <&3' 2>/dev/null;"
            ' then r=ok; else r=fail; fi; echo "$r $(( ($(date +%s%N)-s)/1000000 ))"; '
            f"sleep {gap}; done"
        )
        self.out = ""
        self.name = f"{client}->{host}:{port}"

        def run() -> None:
            self.out = in_pod_netns(cluster, ns, client, "bash", "-c", script,
                                    check=False, timeout=seconds + 60)  # fmt: skip

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self) -> tuple[int, int, int]:
        """(requests, failures, slowest ms), after the prober's time is up."""
        self.thread.join()
        lines = [ln.split() for ln in self.out.splitlines() if ln.strip()]
        fails = sum(1 for r, _ in lines if r != "ok")
        slowest = max((int(ms) for r, ms in lines if r == "ok"), default=0)
        return len(lines), fails, slowest


def _probers(cluster: KindCluster, ns: str, seconds: float) -> list[Prober]:
    """From each echo pod: to the next node's pod by IP, and to the Service."""
    ips = _ips(cluster, ns)
    names = sorted(ips)
    svc = _service_ip(cluster, ns)
    out = []
    for i, client in enumerate(names):
        peer = names[(i + 1) % len(names)]
        out.append(Prober(cluster, ns, client, ips[peer], PORT, seconds))
        out.append(Prober(cluster, ns, client, svc, 80, seconds))
    return out


def _report(probers: list[Prober], record_property: Any, what: str) -> tuple[int, int, int]:
    total = fails = slowest = 0
    for p in probers:
        n, f, s = p.result()
        total, fails, slowest = total + n, fails + f, max(slowest, s)
        if f:
            print(f"  {p.name}: {f} of {n} failed")
    print(f"\n{what}: {total} requests, {fails} failed, slowest connect {slowest} ms")
    record_property(f"{what}_requests", total)
    record_property(f"{what}_failed", fails)
    record_property(f"{what}_slowest_ms", slowest)
    return total, fails, slowest


@pytest.mark.timeout(900)
def test_the_ci_subset_of_the_upstream_e2e_suite_passes(
    cluster: KindCluster, installed: dict[str, Any], record_property: Any
) -> None:
    """Services ClusterIP/NodePort, DNS and pod-to-pod Conformance specs and five
    NetworkPolicy specs (a named port among them) of the upstream e2e suite
    (``conformance.CI_SPECS``), run by the upstream binary against this cluster."""
    import pathlib

    import conformance
    from e2e_images import ensure_e2e_images

    from cilia_testkit.kind.image import coredns_bin_dir

    started = time.monotonic()
    binary = conformance.build_tools() / "e2e-network.test"
    names = ensure_e2e_images(binary.parent, coredns_bin_dir() / "coredns", progress=print)
    cluster.load_images(names)
    prepared = time.monotonic() - started
    out = pathlib.Path(conformance.ROOT) / ".run" / "conformance-ci" / cluster.name
    with conformance.service_cidr_unrouted(cluster):
        results = conformance.run_suite(conformance.SUITES["ci"], binary, cluster, out)
    took = time.monotonic() - started - prepared
    print(f"\ntools + images {prepared:.0f} s, specs {took:.0f} s")
    record_property("ci_specs_s", round(took, 1))
    got = {r.name: r.status for r in results}
    assert len(got) == len(conformance.CI_SPECS), sorted(got)
    failed = {r.name: r.reason for r in results if r.status != "passed"}
    assert not failed, failed


def test_agent_killed_with_sigkill_is_restarted_and_traffic_keeps_flowing(
    cluster: KindCluster, ns: str, record_property: Any
) -> None:
    victim = cluster.nodes[1].name
    agent = next(p for p in cluster.get("pods", "-n", NS, "-l", "app=cilia-agent")["items"]
                 if p["spec"]["nodeName"] == victim)  # fmt: skip
    restarts = _restarts(agent)
    probers = _probers(cluster, ns, seconds=25)
    time.sleep(3)
    node, pid = container_pid(cluster, NS, agent["metadata"]["name"])
    cluster.exec(node, "kill", "-9", str(pid))
    deadline = time.monotonic() + 120
    while True:
        now = cluster.get("pod", "-n", NS, agent["metadata"]["name"])
        if _restarts(now) > restarts and not not_ready(cluster):
            break
        assert time.monotonic() < deadline, "the killed agent did not come back Ready"
        time.sleep(1)
    total, fails, _ = _report(probers, record_property, "agent_kill")
    assert total > 50
    assert fails == 0
    _all_pairs_and_service(cluster, ns)


def _restarts(pod: dict[str, Any]) -> int:
    return sum(s.get("restartCount", 0) for s in pod["status"].get("containerStatuses", [])
               if s["name"] == "agent")  # fmt: skip


GENERATION = "safe-agent-updater-daemonset-generation"


def _agents(cluster: KindCluster) -> dict[str, tuple[str, str]]:
    """{node: (agent image, generation annotation)} of the agent pods not being deleted."""
    out = {}
    for p in cluster.get("pods", "-n", NS, "-l", "app=cilia-agent")["items"]:
        if p["metadata"].get("deletionTimestamp"):
            continue
        image = next(c["image"] for c in p["spec"]["containers"] if c["name"] == "agent")
        out[p["spec"]["nodeName"]] = (image, p["metadata"]["annotations"].get(GENERATION, ""))
    return out


def _roll(cluster: KindCluster, values: dict[str, Any], image: str) -> tuple[float, int]:
    """``helm upgrade`` with ``values``; wait until the updater has replaced every node's
    agent with one of the DaemonSet's new generation (the chart's hash of the pod template)
    running ``image``, and everything is Ready. Returns (seconds taken, the most nodes seen
    at once without a Ready agent)."""
    started = time.monotonic()
    helm(cluster, "upgrade", "cilia", str(CHART), "-n", NS, values=values)
    ds = cluster.get("daemonset", "-n", NS, "cilia-agent")
    want = (image, ds["spec"]["template"]["metadata"]["annotations"][GENERATION])
    deadline = time.monotonic() + 420
    most_down = 0
    while True:
        agents = _agents(cluster)
        missing = not_ready(cluster)
        most_down = max(most_down, sum(1 for m in missing if m.startswith("agent on ")))
        if len(agents) == len(cluster.nodes) and set(agents.values()) == {want} and not missing:
            return time.monotonic() - started, most_down
        assert time.monotonic() < deadline, f"roll to {want} not done: {agents}"
        time.sleep(2)


@pytest.mark.long
@pytest.mark.timeout(900)
def test_helm_upgrade_rolls_the_agents_node_by_node_with_no_failed_request(
    cluster: KindCluster, ns: str, installed: dict[str, Any], record_property: Any
) -> None:
    images = ensure_cilia_images("0.1.0-b", label="b")
    cluster.load_images(images)
    values = {**installed["values"], "image": {"tag": "0.1.0-b"}}
    probers = _probers(cluster, ns, seconds=150)
    took, most_down = _roll(cluster, values, "cilia-agent:0.1.0-b")
    print(f"\nroll of {len(cluster.nodes)} agents: {took:.1f} s, at most {most_down} down at once")
    record_property("roll_s", round(took, 1))
    assert most_down <= 1, "the updater replaced more than one node's agent at a time"
    total, fails, slowest = _report(probers, record_property, "roll")
    assert total > 100
    assert fails == 0
    assert slowest < 1000
    _all_pairs_and_service(cluster, ns)
    installed["values"] = values


@pytest.mark.long
@pytest.mark.timeout(900)
def test_helm_rollback_rolls_the_agents_back_with_no_failed_request(
    cluster: KindCluster, ns: str, installed: dict[str, Any], record_property: Any
) -> None:
    history = json.loads(helm(cluster, "history", "cilia", "-n", NS, "-o", "json").stdout)
    first = min(int(h["revision"]) for h in history)
    probers = _probers(cluster, ns, seconds=150)
    started = time.monotonic()
    helm(cluster, "rollback", "cilia", str(first), "-n", NS)
    ds = cluster.get("daemonset", "-n", NS, "cilia-agent")
    want = ("cilia-agent:0.1.0", ds["spec"]["template"]["metadata"]["annotations"][GENERATION])
    deadline = time.monotonic() + 420
    while _agents(cluster) != {n.name: want for n in cluster.nodes} or not_ready(cluster):
        assert time.monotonic() < deadline, f"rollback not done: {_agents(cluster)}"
        time.sleep(2)
    print(f"\nrollback of {len(cluster.nodes)} agents: {time.monotonic() - started:.1f} s")
    total, fails, slowest = _report(probers, record_property, "rollback")
    assert total > 100
    assert fails == 0
    assert slowest < 1000
    installed["values"] = cluster_values(cluster)


@pytest.mark.long
@pytest.mark.timeout(900)
def test_helm_upgrade_to_tunnel_mode_carries_traffic_over_vxlan(
    cluster: KindCluster, ns: str, installed: dict[str, Any]
) -> None:
    values = {**installed["values"], "routingMode": "tunnel", "autoDirectNodeRoutes": False}
    _roll(cluster, values, "cilia-agent:0.1.0")
    wait_ready(cluster)
    for n in cluster.nodes:
        links = cluster.exec(n, "ip", "-d", "link", "show", "cilium_vxlan")
        assert "vxlan" in links
        routes = cluster.exec(n, "ip", "-4", "route", "show", "proto", "0xc1").splitlines()
        # one route per other node's pod CIDR, each through the tunnel device (none left
        # of native routing's direct routes)
        assert len(routes) == len(cluster.nodes) - 1, routes
        assert all("dev cilium_vxlan" in r for r in routes), routes
    _all_pairs_and_service(cluster, ns)
    installed["values"] = values


@pytest.mark.long
def test_a_fourth_node_joins_and_serves_pods_within_60_s(
    cluster: KindCluster, ns: str, record_property: Any
) -> None:
    started = time.monotonic()
    node = cluster.add_node()
    cluster.kubectl(
        "apply",
        "-f",
        "-",
        input=json.dumps(echo_pod("joiner", ns, node.name, port=PORT, app="echo-extra")),
    )
    wait_pods_ready(cluster, ns, "app=echo-extra", 1, timeout=90)
    wait_ready(cluster, timeout=90)
    took = time.monotonic() - started
    print(f"\nnode {node.name} joined and serves a pod in {took:.1f} s")
    record_property("join_s", round(took, 1))
    ips = _ips(cluster, ns)
    joiner = cluster.get("pod", "-n", ns, "joiner")["status"]["podIP"]
    for client, ip in ips.items():
        assert _hello(cluster, ns, client, joiner) == f"hello from joiner on {PORT}", client
        assert _hello(cluster, ns, "joiner", ip) == f"hello from {client} on {PORT}", client
    assert took < 60


@pytest.mark.long
def test_a_deleted_node_leaves_every_peer_within_10_s(
    cluster: KindCluster, ns: str, record_property: Any
) -> None:
    gone = cluster.nodes[-1]
    cidr = cluster.get("node", gone.name)["spec"]["podCIDR"]
    cluster.kubectl("delete", "pod", "-n", ns, "joiner", "--wait=false", check=False)
    started = time.monotonic()
    cluster.delete_node(gone.name)
    deadline = started + 10
    while True:
        left = []
        if cluster.kubectl("get", "ciliumnode", gone.name, check=False).returncode == 0:
            left.append("CiliumNode")
        for n in cluster.nodes:
            routes = cluster.exec(n, "ip", "-4", "route", "show", "proto", "0xc1")
            if cidr.split("/")[0] in routes:
                left.append(f"route on {n.name}")
        if not left:
            break
        assert time.monotonic() < deadline, f"{gone.name} ({cidr}) still has: {left}"
        time.sleep(0.5)
    took = time.monotonic() - started
    print(f"\nnode {gone.name} gone from every peer in {took:.1f} s")
    record_property("leave_s", round(took, 1))
    _all_pairs_and_service(cluster, ns)


@pytest.mark.long
@pytest.mark.timeout(600)
def test_restarted_node_containers_and_the_whole_cluster_come_back(
    cluster: KindCluster, ns: str, record_property: Any
) -> None:
    worker = cluster.nodes[1].name
    started = time.monotonic()
    cluster.restart_node(worker)
    wait_ready(cluster)
    wait_pods_ready(cluster, ns, "app=echo", len(cluster.nodes), timeout=120)
    converged = _eventually_all_pairs_and_service(cluster, ns, 30)
    print(f"\nnode restart: Ready, then all pairs {converged:.1f} s later")
    record_property("node_restart_s", round(time.monotonic() - started, 1))
    started = time.monotonic()
    for n in reversed(cluster.nodes):
        cluster.stop_node(n.name)
    for n in cluster.nodes:
        cluster.start_node(n.name)
    wait_ready(cluster)
    wait_pods_ready(cluster, ns, "app=echo", len(cluster.nodes), timeout=180)
    took = time.monotonic() - started
    converged = _eventually_all_pairs_and_service(cluster, ns, 30)
    print(f"\nwhole cluster restarted and Ready in {took:.1f} s, all pairs {converged:.1f} s later")
    record_property("cluster_restart_s", round(took, 1))


def test_helm_uninstall_leaves_nothing_on_the_nodes(
    cluster: KindCluster, ns: str, installed: dict[str, Any]
) -> None:
    cluster.kubectl("delete", "namespace", ns, "--wait=true", timeout=120)
    uninstall(cluster)
    assert not cluster.get("pods", "-n", NS, "-l", "app.kubernetes.io/part-of=cilia")["items"]
    # pods still running (CoreDNS) keep the interfaces they were given, as upstream leaves
    # them: one lxc device per such pod of the node, nothing else of Cilia
    pods = [p for p in cluster.get("pods", "-A")["items"] if not p["spec"].get("hostNetwork")]
    for n in cluster.nodes:
        left = cluster.exec(n, "sh", "-c", (
            "ls /etc/cni/net.d/05-cilia.conflist /opt/cni/bin/cilia-cni /opt/cni/cilia"
            " /sys/fs/bpf/cilia /etc/sysctl.d/99-zzz-override_cilia.conf 2>/dev/null;"
            " ip -o link show | grep -E 'cilia_|cilium_' ;"
            " ip -4 route show proto 0xc1;"
            " iptables-save 2>/dev/null | grep -i cilia; true"
        ))  # fmt: skip
        assert left.strip() == "", f"{n.name} still has:\n{left}"
        lxc = cluster.exec(n, "sh", "-c", "ip -o link show | grep -c ' lxc' ; true").strip()
        running = sum(1 for p in pods if p["spec"].get("nodeName") == n.name)
        assert int(lxc or 0) == running, f"{n.name}: {lxc} lxc devices, {running} pods running"


@pytest.fixture(autouse=True)
def _timing(request: pytest.FixtureRequest) -> Iterator[None]:
    started = time.monotonic()
    yield
    print(f"\n[{request.node.name}] {time.monotonic() - started:.1f} s")
