"""The kind-style cluster (cilia_testkit.kind), proved without Cilia: three node containers
with the reference CNI (Debian's bridge + host-local, routes between nodes written by the
harness). Pods on every node go Ready and reach each other, CoreDNS answers for
``kubernetes.default``, the outside host sees node addresses and no pod route, a node
restarts and comes back, nodes are added and deleted, ``down`` leaves nothing.

This is also the reference for performance comparisons: the timings of ``up`` (images,
node containers, API ready, nodes registered, DNS, CNI) and of pods Ready are printed
(``pytest -s``) and recorded as test properties.

One cluster for the module (its tests run in file order and build on each other: a
restart needs the pods of the connectivity test). Privileged: needs root and the Docker
engine (skipped with the reason otherwise, failing in CI).
"""

from __future__ import annotations

import ipaddress
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from cilia_testkit.kind import DockerError, KindCluster
from cilia_testkit.kind.api import parse_time
from cilia_testkit.kind.docker import docker, inspect
from cilia_testkit.kind.pods import echo_pod, in_pod_netns, pod, wait_pods_ready

PORT = 8080


@pytest.fixture(scope="module")
def ref(kind_cluster: Callable[..., KindCluster]) -> KindCluster:
    started = time.monotonic()
    cluster = kind_cluster(nodes=3, cni="reference")
    print(
        f"\nkind up (3 nodes, reference CNI): {time.monotonic() - started:.1f} s {cluster.timings}"
    )
    return cluster


@pytest.fixture(scope="module")
def ns(ref: KindCluster) -> str:
    name = f"kind-{uuid.uuid4().hex[:6]}"
    ref.kubectl("create", "namespace", name)
    return name


def _server_pod(name: str, namespace: str, node: str) -> dict[str, Any]:
    """A pod of the sandbox image (testpod) pinned to ``node``, answering on PORT with
    "hello from <pod name> on <port>"."""
    return echo_pod(name, namespace, node, port=PORT)


def _hello(cluster: KindCluster, namespace: str, client: str, ip: str) -> str:
    """What a TCP connection from pod ``client`` to ``ip``:PORT reads (bash's /dev/tcp in
    the client pod's network namespace)."""
    return in_pod_netns(
        cluster, namespace, client, "timeout", "5", "bash", "-c",
        f"exec 3<>/dev/tcp/{ip}/{PORT}; cat <&3",
    ).strip()  # fmt: skip


def _ips(cluster: KindCluster, namespace: str) -> dict[str, str]:
    items = cluster.get("pods", "-n", namespace, "-l", "app=echo")["items"]
    return {p["metadata"]["name"]: p["status"].get("podIP", "") for p in items}


@pytest.mark.parametrize(
    ("args", "kw"),
    [
        (("Bad_Name",), {}),
        (("x" * 40,), {}),
        (("ok", 0), {}),
        (("ok",), {"pod_cidr": "10.96.0.0/12"}),  # overlaps the service CIDR
        (("ok",), {"pod_cidr": "fd00::/64"}),
        (("ok",), {"pod_cidr": "10.244.0.0/24", "node_cidr_mask": 24}),
        (("ok",), {"service_cidr": "not-a-cidr"}),
        (("ok",), {"cni": "flannel"}),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_made(
    args: tuple[Any, ...], kw: dict[str, Any], tmp_path: Any
) -> None:
    with pytest.raises(ValueError):
        KindCluster(*args, state_root=tmp_path, **kw)
    assert not any(tmp_path.iterdir())


def test_parse_time_reads_docker_and_kubernetes_timestamps() -> None:
    docker_time = parse_time("2026-12-07T20:41:01.123456789Z")
    assert docker_time is not None and docker_time.microsecond == 123456
    assert parse_time("2026-12-07T20:41:02Z") is not None
    assert parse_time("soon") is None


def test_nodes_registered_with_their_container_address_and_a_pod_cidr(ref: KindCluster) -> None:
    nodes = ref.node_objects()
    assert sorted(nodes) == sorted(n.name for n in ref.nodes)
    cidrs = set()
    for n in ref.nodes:
        obj = nodes[n.name]
        internal = [a["address"] for a in obj["status"]["addresses"] if a["type"] == "InternalIP"]
        assert internal == [n.ip]
        cidr = ipaddress.IPv4Network(obj["spec"]["podCIDR"])
        assert cidr.subnet_of(ipaddress.IPv4Network(ref.pod_cidr)) and cidr.prefixlen == 24
        cidrs.add(cidr)
        taints = {t["key"] for t in obj["spec"].get("taints") or []}
        assert not taints - {"node.kubernetes.io/not-ready"}, "every node untainted, the first too"
    assert len(cidrs) == len(ref.nodes)
    # the API server's Service points at the control-plane node's address (k8sServiceHost)
    slices = ref.get(
        "endpointslices", "-n", "default", "-l", "kubernetes.io/service-name=kubernetes"
    )
    endpoints = {(a, p["port"]) for s in slices["items"] for e in s["endpoints"]
                 for a in e["addresses"] for p in s["ports"]}  # fmt: skip
    assert endpoints == {(ref.control_plane.ip, 6443)}
    assert ref.api_server == f"{ref.control_plane.ip}:6443"
    cidr_objects = ref.get("servicecidrs")["items"]
    assert [c["spec"]["cidrs"] for c in cidr_objects] == [[ref.service_cidr]]


def test_no_kube_proxy(ref: KindCluster) -> None:
    pods = ref.get("pods", "-A")["items"]
    assert not [p for p in pods if "kube-proxy" in p["metadata"]["name"]]
    assert not ref.get("daemonsets", "-A")["items"]
    for n in ref.nodes:
        rules = ref.exec(n, "iptables-save", "-t", "nat")
        assert "KUBE-SERVICES" not in rules, f"{n.name} has kube-proxy's chains"


def test_each_node_has_its_own_cgroup2_root_and_bpffs(ref: KindCluster) -> None:
    host_paths, bpf_devices = set(), set()
    for n in ref.nodes:
        # inside: the node's own cgroup namespace, cgroup2 mounted at its root
        assert ref.exec(n, "sh", "-c", "grep '^0::' /proc/1/cgroup").strip() == "0::/"
        mounts = ref.exec(n, "cat", "/proc/1/mountinfo").splitlines()
        cg2 = [m for m in mounts if " - cgroup2 " in m]
        assert cg2 and cg2[0].split()[3] == "/" and cg2[0].split()[4] == "/sys/fs/cgroup/unified"
        bpf = [m.split() for m in mounts if " - bpf " in m]
        assert [b[4] for b in bpf] == ["/sys/fs/bpf"]
        bpf_devices.add(bpf[0][2])
        # from the host: that root is a distinct subtree of the unified hierarchy
        pid = (inspect("container", n.container_id) or {})["State"]["Pid"]
        with open(f"/proc/{pid}/cgroup") as f:
            unified = next(line.strip() for line in f if line.startswith("0::"))
        assert unified == f"0::/docker/{n.container_id}"
        host_paths.add(unified)
    assert len(host_paths) == len(ref.nodes)
    assert len(bpf_devices) == len(ref.nodes), "each node mounts a bpffs instance of its own"


def test_pods_on_every_node_are_ready_and_reach_each_other(
    ref: KindCluster, ns: str, record_property: Any
) -> None:
    started = time.monotonic()
    items = [_server_pod(f"echo-{i}", ns, n.name) for i, n in enumerate(ref.nodes)]
    ref.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                       "items": items}))  # fmt: skip
    wait_pods_ready(ref, ns, "app=echo", len(ref.nodes))
    ready_s = time.monotonic() - started
    print(f"\n{len(items)} pods Ready in {ready_s:.1f} s")
    record_property("pods_ready_s", round(ready_s, 2))
    record_property("up_timings_s", ref.timings)
    ips = _ips(ref, ns)
    for cidr_ok in ips.values():
        assert ipaddress.ip_address(cidr_ok) in ipaddress.ip_network(ref.pod_cidr)
    for client in ips:
        for server, ip in ips.items():
            assert _hello(ref, ns, client, ip) == f"hello from {server} on {PORT}"


def test_coredns_answers_for_kubernetes_default(ref: KindCluster, ns: str) -> None:
    dns = wait_pods_ready(ref, "kube-system", "k8s-app=kube-dns", 2)
    service = ref.get("service", "-n", "kube-system", "kube-dns")
    assert service["spec"]["clusterIP"] == ref.dns_ip
    kubelet_config = json.loads(
        ref.exec(ref.nodes[1], "cat", "/etc/cilia-node/kubelet-config.json")
    )
    assert kubelet_config["clusterDNS"] == [ref.dns_ip]
    # no kube-proxy and no service load balancer in the reference CNI: ask the pods directly,
    # from a pod's network namespace on the last node
    client = f"echo-{len(ref.nodes) - 1}"
    for p in dns:
        answer = in_pod_netns(
            ref, ns, client, "dig", "+short", "+time=2", "+tries=2", f"@{p['status']['podIP']}",
            "kubernetes.default.svc.cluster.local",
        ).split()  # fmt: skip
        assert answer == ["10.96.0.1"]
    # a name outside the cluster is not forwarded anywhere (there is no internet here)
    status = in_pod_netns(ref, ns, client, "dig", "+time=2", "+tries=1",
                          f"@{dns[0]['status']['podIP']}", "example.com", check=False)  # fmt: skip
    assert "status: NOERROR" not in status


def test_outside_sees_node_addresses_and_has_no_route_to_pods(ref: KindCluster, ns: str) -> None:
    assert ref.outside is not None
    for n in ref.nodes:
        body = ref.exec(n, "curl", "-sS", "--max-time", "5", f"http://{ref.outside.ip}:8080/")
        assert body.split()[0] == n.ip
    # the reference CNI does not masquerade: a pod's datagram arrives with the pod's address,
    # and the outside host's reply (no route to a pod CIDR) never comes back
    pod_ip = _ips(ref, ns)["echo-1"]
    got = in_pod_netns(
        ref, ns, "echo-1", "curl", "-sS", "--max-time", "3", f"http://{ref.outside.ip}:8080/",
        check=False,
    )  # fmt: skip
    assert got == ""
    in_pod_netns(ref, ns, "echo-1", "bash", "-c", f"echo hi > /dev/udp/{ref.outside.ip}/9000")
    deadline = time.monotonic() + 5
    while f"udp {pod_ip}:" not in docker("logs", ref.outside.container_id).stdout:
        assert time.monotonic() < deadline, "the pod's datagram did not reach the outside host"
        time.sleep(0.2)
    routes = ref.exec(ref.outside.name, "ip", "-4", "route")
    assert routes.strip() and "10.244." not in routes


def test_restarted_node_comes_back_with_its_pods(ref: KindCluster, ns: str) -> None:
    worker = ref.nodes[1]
    server = "echo-1"
    old_ip = _ips(ref, ns)[server]
    before = (pod(ref, ns, server) or {})["status"]["containerStatuses"][0]["restartCount"]
    ref.restart_node(worker.name)
    deadline = time.monotonic() + 120
    while True:
        obj = pod(ref, ns, server) or {}
        statuses = (obj.get("status") or {}).get("containerStatuses") or [{}]
        if statuses[0].get("restartCount", 0) > before and statuses[0].get("ready"):
            break
        assert time.monotonic() < deadline, f"{server} not running again: {obj.get('status')}"
        time.sleep(0.5)
    ips = _ips(ref, ns)
    assert old_ip and ips[server], "a new sandbox with an address from the node's podCIDR"
    # the new sandbox is reachable from the other nodes' pods, and reaches them
    assert _hello(ref, ns, "echo-0", ips[server]) == f"hello from {server} on {PORT}"
    assert _hello(ref, ns, server, ips["echo-2"]) == f"hello from echo-2 on {PORT}"
    # the node's own services came back under the entrypoint, not started by the harness
    log = ref.state_dir / "nodes" / worker.name / "log" / "entrypoint.log"
    assert log.read_text().count("started kubelet") == 2


def test_restarted_control_plane_keeps_the_cluster_state(ref: KindCluster, ns: str) -> None:
    ref.kubectl("create", "configmap", "-n", ns, "kept", "--from-literal=k=v")
    ref.restart_node(ref.control_plane.name)
    # etcd's data is in the node's file system: the API server comes back with it
    got = ref.kubectl("get", "configmap", "-n", ns, "kept", "-o", "jsonpath={.data.k}")
    assert got.stdout == "v"
    ref.wait_ready()
    assert _hello(ref, ns, "echo-2", _ips(ref, ns)["echo-1"]) == f"hello from echo-1 on {PORT}"


def test_added_node_joins_and_a_deleted_node_leaves(ref: KindCluster, ns: str) -> None:
    node = ref.add_node()
    obj = ref.node_objects()[node.name]
    cidr = obj["spec"]["podCIDR"]
    assert [a["address"] for a in obj["status"]["addresses"] if a["type"] == "InternalIP"] == [
        node.ip
    ]
    # images loaded before it joined are imported into it too
    assert "cilia-coredns" in ref.exec(node, "ctr", "-n", "k8s.io", "images", "ls", "-q")
    ref.kubectl("apply", "-f", "-", input=json.dumps(_server_pod("echo-new", ns, node.name)))
    wait_pods_ready(ref, ns, "app=echo", len(ref.nodes))
    ip = _ips(ref, ns)["echo-new"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)
    assert _hello(ref, ns, "echo-0", ip) == f"hello from echo-new on {PORT}"
    ref.delete_node(node.name)
    assert node.name not in ref.node_objects()
    assert inspect("container", node.container_id) is None
    assert cidr not in ref.exec(ref.nodes[0], "ip", "route")
    with pytest.raises(KeyError):
        ref.node(node.name)


def test_down_removes_every_container_and_the_network(ref: KindCluster) -> None:
    ids = [n.container_id for n in ref.nodes] + [ref.outside.container_id if ref.outside else ""]
    network = ref.network_id
    memory = ref.memory()
    print(
        f"\nmemory (docker stats): { {k: f'{v / 2**20:.0f} MiB' for k, v in memory.items()} }"
        f" total {sum(memory.values()) / 2**20:.0f} MiB"
    )
    ref.down()
    for cid in ids:
        assert inspect("container", cid) is None
    assert inspect("network", network) is None
    assert not ref.state_dir.exists()
    with pytest.raises(DockerError):
        docker("network", "inspect", network)
