"""The whole agent with its eBPF datapath, policy engine and Hubble, with real traffic.

One agent (BPF on, pins under /sys/fs/bpf/cilia-test-<rand>) talks to the in-process
contract-level operator of ``fake_operator``; three pods (netns ``cilia-t-*``) are
created through the agent's real gRPC Add: frontend, backend (TCP server on 8080 and
9090) and other. Traffic is real TCP between the namespaces. The tests run in file
order and share the pods (compiling the datapath costs seconds); the last one restarts
the agent under a ping flood.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cilia.agent.v1 import agent_pb2
from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia.hubble.peer import peer_pb2, peer_pb2_grpc
from cilia_agent.datapath import host_ifname
from cilia_agent.datapath.layout import IDENTITY_HOST
from cilia_testkit import skips

from .conftest import AgentThread, Env
from .fake_operator import FakeOperator

BIN = pathlib.Path(sys.executable).parent / "cilia-agent"
CNP = "CiliumNetworkPolicy"

SERVER = """
import socket, threading
def serve(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept(); c.sendall(b"ok"); c.close()
for p in (8080, 9090):
    threading.Thread(target=serve, args=(p,), daemon=True).start()
threading.Event().wait()
"""

CLIENT = """
import socket, sys
try:
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3]))
    sys.exit(0 if s.recv(2) == b"ok" else 3)
except OSError:
    sys.exit(1)
"""


@dataclass
class Pod:
    name: str
    netns: str  # name under /var/run/netns
    ip: str
    endpoint_id: int
    host_ifname: str


@dataclass
class Cluster:
    env: Env
    op: FakeOperator
    agent: AgentThread
    pods: dict[str, Pod]
    server: subprocess.Popen[bytes]

    def connect(self, src: str, dst: str, port: int, timeout: float = 1.0) -> bool:
        """A real TCP connect from pod ``src`` to pod ``dst`` that reads the server's reply."""
        proc = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                self.pods[src].netns,
                sys.executable,
                "-c",
                CLIENT,
                self.pods[dst].ip,
                str(port),
                str(timeout),
            ],
            capture_output=True,
            timeout=timeout + 10,
        )
        return proc.returncode == 0

    def revision(self) -> int:
        assert self.agent.agent.enforcement is not None
        return self.agent.agent.enforcement.engine.repository.revision

    def apply(self, *manifests: dict[str, Any], delete: tuple[str, ...] = ()) -> None:
        """Change policies at the operator and wait until the agent has applied them."""
        before = self.revision()
        for m in manifests:
            self.op.apply_policy(m)
        for name in delete:
            self.op.delete_policy(CNP, "default", name)
        wait(lambda: self.revision() >= before + len(manifests) + len(delete))

    def flows(self) -> list[flow_pb2.Flow]:
        sock = self.agent.config.hubble_socket_path()
        with grpc.insecure_channel(f"unix:{sock}") as ch:
            stub = observer_pb2_grpc.ObserverStub(ch)  # type: ignore[no-untyped-call]
            return [
                r.flow
                for r in stub.GetFlows(observer_pb2.GetFlowsRequest(number=4095), timeout=10)
                if r.HasField("flow")
            ]


def wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def cnp(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": CNP,
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def allow_ingress(name: str, apps: list[str], port: int | None = 8080) -> dict[str, Any]:
    rule: dict[str, Any] = {
        "fromEndpoints": [{"matchExpressions": [{"key": "app", "operator": "In", "values": apps}]}]
    }
    if port is not None:
        rule["toPorts"] = [{"ports": [{"port": str(port), "protocol": "TCP"}]}]
    return cnp(name, {"endpointSelector": {"matchLabels": {"app": "backend"}}, "ingress": [rule]})


def deny_ingress_from_frontend(name: str) -> dict[str, Any]:
    return cnp(
        name,
        {
            "endpointSelector": {"matchLabels": {"app": "backend"}},
            "ingressDeny": [
                {
                    "fromEndpoints": [{"matchLabels": {"app": "frontend"}}],
                    "toPorts": [{"ports": [{"port": "8080", "protocol": "TCP"}]}],
                }
            ],
        },
    )


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def add_pod(env: Env, agent: AgentThread, name: str, labels: dict[str, str]) -> Pod:
    path = env.add_netns()
    resp = agent.attach.Add(
        agent_pb2.AddRequest(
            container_id=f"ctr-{name}-{env.tag}",
            ifname="eth0",
            netns=path,
            labels=labels,
            pod_namespace="default",
            pod_name=name,
        ),
        timeout=20,
    )
    return Pod(
        name,
        os.path.basename(path),
        resp.ips[0].address.split("/")[0],
        int(resp.endpoint_id),
        resp.interfaces[0].name,
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    skips.require_bpf("netns, tc, BPF")
    env = Env(tmp_path_factory.mktemp("policy"))
    op = FakeOperator(env.cidr)
    server: subprocess.Popen[bytes] | None = None
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            hubble_port = probe.getsockname()[1]
        agent = env.start_agent(
            static={},
            enable_bpf=True,
            hubble_listen_address=f"127.0.0.1:{hubble_port}",
            hubble_metrics="flow",  # counted in Hubble's registry, read in-process
            hubble_metrics_server="",
            operator=op.address,
            operator_reconnect_min_backoff=0.1,
            operator_reconnect_max_backoff=0.5,
        )
        wait(lambda: agent.debug.Status(agent_pb2.StatusRequest()).ready, 20)
        pods = {n: add_pod(env, agent, n, {"app": n}) for n in ("frontend", "backend", "other")}
        server = subprocess.Popen(
            ["ip", "netns", "exec", pods["backend"].netns, sys.executable, "-c", SERVER]
        )
        c = Cluster(env, op, agent, pods, server)
        wait(lambda: c.connect("frontend", "backend", 8080), 10)  # server up, nothing enforced
        yield c
    finally:
        if server is not None:
            server.kill()
            server.wait()
        env.cleanup()
        op.stop()


def test_add_allocates_identity_at_operator_and_attaches_programs_before_returning(
    cluster: Cluster,
) -> None:
    pods, op = cluster.pods, cluster.op
    states = [
        json.loads(f.read_text()) for f in (cluster.env.state_dir / "endpoints").glob("*.json")
    ]
    ids = {s["pod_name"]: int(s["identity"]) for s in states}
    assert sorted(ids) == ["backend", "frontend", "other"]
    assert len(set(ids.values())) == 3 and min(ids.values()) >= 256
    assert (
        op.identities[("k8s:app=backend", "k8s:io.kubernetes.pod.namespace=default")]
        == ids["backend"]
    )
    recs = {name: r for (_, name), r in op.endpoints.items()}
    assert recs["backend"].ipv4 == pods["backend"].ip and recs["backend"].identity == ids["backend"]
    for pod in pods.values():
        ingress = subprocess.run(
            ["tc", "filter", "show", "dev", pod.host_ifname, "ingress"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        egress = subprocess.run(
            ["tc", "filter", "show", "dev", pod.host_ifname, "egress"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "cil_from_container" in ingress and "cil_to_container" in egress
    reg = op.registrations[0]
    assert reg.hubble_address == cluster.agent.config.hubble_listen_address


def test_hubble_serves_peers_on_the_socket_and_status_over_tcp(cluster: Cluster) -> None:
    cfg = cluster.agent.config
    with grpc.insecure_channel(f"unix:{cfg.hubble_socket_path()}") as ch:
        stub = peer_pb2_grpc.PeerStub(ch)  # type: ignore[no-untyped-call]
        stream = stub.Notify(peer_pb2.NotifyRequest(), timeout=5)
        first = next(iter(stream))
        stream.cancel()
    assert (first.name, first.address, first.type) == (
        cfg.node_name,
        cfg.hubble_listen_address,
        peer_pb2.PEER_ADDED,
    )
    with grpc.insecure_channel(cfg.hubble_listen_address) as ch:
        obs = observer_pb2_grpc.ObserverStub(ch)  # type: ignore[no-untyped-call]
        status = obs.ServerStatus(observer_pb2.ServerStatusRequest(), timeout=5)
    assert status.max_flows == 4095


def test_cnp_lets_frontend_reach_backend_8080_and_drops_other(cluster: Cluster) -> None:
    cluster.apply(allow_ingress("backend-8080", ["frontend"]))
    assert cluster.connect("frontend", "backend", 8080), "allowed by the CNP; reply passes"
    assert not cluster.connect("other", "backend", 8080), "not selected: default deny"
    assert not cluster.connect("frontend", "backend", 9090), "port not in toPorts"


def test_flows_from_the_hubble_socket_name_pods_and_verdicts(cluster: Cluster) -> None:
    def find() -> tuple[flow_pb2.Flow | None, flow_pb2.Flow | None]:
        fwd = drop = None
        for f in cluster.flows():
            if f.destination.pod_name != "backend" or f.l4.TCP.destination_port != 8080:
                continue
            if f.source.pod_name == "frontend" and f.verdict == flow_pb2.FORWARDED:
                fwd = f
            if f.source.pod_name == "other" and f.verdict == flow_pb2.DROPPED:
                drop = f
        return fwd, drop

    wait(lambda: all(find()))
    fwd, drop = find()
    assert fwd is not None and drop is not None
    assert fwd.source.namespace == "default" and "k8s:app=frontend" in fwd.source.labels
    assert fwd.source.identity >= 256 and fwd.destination.identity >= 256
    assert drop.drop_reason_desc == flow_pb2.POLICY_DENIED
    assert drop.traffic_direction == flow_pb2.INGRESS
    assert drop.node_name == cluster.agent.config.node_name


def test_policy_update_takes_effect_on_running_pods_without_recreating_them(
    cluster: Cluster,
) -> None:
    before = {
        n: (p.endpoint_id, socket.if_nametoindex(p.host_ifname)) for n, p in cluster.pods.items()
    }
    cluster.apply(allow_ingress("backend-8080", ["frontend", "other"]))
    assert cluster.connect("other", "backend", 8080)
    cluster.apply(allow_ingress("backend-8080", ["frontend"]))
    assert not cluster.connect("other", "backend", 8080)
    assert cluster.connect("frontend", "backend", 8080)
    after = {
        n: (p.endpoint_id, socket.if_nametoindex(p.host_ifname)) for n, p in cluster.pods.items()
    }
    assert before == after


def test_deny_beats_allow_and_is_reported_as_policy_deny(cluster: Cluster) -> None:
    cluster.apply(deny_ingress_from_frontend("deny-frontend"))
    try:
        assert not cluster.connect("frontend", "backend", 8080)

        def denied() -> bool:
            return any(
                f.source.pod_name == "frontend"
                and f.verdict == flow_pb2.DROPPED
                and f.drop_reason_desc == flow_pb2.POLICY_DENY
                for f in cluster.flows()
            )

        wait(denied)
    finally:
        cluster.apply(delete=("deny-frontend",))
    assert cluster.connect("frontend", "backend", 8080), "allowed again once the deny is gone"


def test_metrics_count_drops_forwards_policies_endpoints_and_flows(cluster: Cluster) -> None:
    text = generate_latest(cluster.agent.agent.metrics.registry).decode()
    assert metric(text, "cilium_drop_count_total", reason="Policy denied", direction="INGRESS") >= 1
    assert (
        metric(
            text, "cilium_drop_count_total", reason="Policy denied by denylist", direction="INGRESS"
        )
        >= 1
    )
    assert metric(text, "cilium_forward_count_total", direction="EGRESS") >= 1
    assert metric(text, "cilium_policy") == 1
    assert metric(text, "cilium_endpoint") == 3
    # the conntrack GC's first pass runs at start
    gc_run = dict(family="ipv4", protocol="TCP", status="completed")
    assert metric(text, "cilium_datapath_conntrack_gc_runs_total", **gc_run) >= 1
    flows = generate_latest(cluster.agent.agent.hubble.metrics.flow_registry).decode()
    assert metric(flows, "hubble_flows_processed_total", verdict="DROPPED") >= 1
    assert metric(flows, "hubble_flows_processed_total", verdict="FORWARDED") >= 1


def test_cli_shows_datapath_status_endpoint_identities_and_pinned_maps(cluster: Cluster) -> None:
    cfg = cluster.agent.config
    pin = ["--bpf-pin-dir", str(cfg.bpf_pin_dir)]

    def run(*args: str) -> str:
        proc = subprocess.run([str(BIN), *args], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    status = run("status", "--socket", str(cfg.socket))
    assert f"Datapath: eBPF loaded, pin dir {cfg.bpf_pin_dir}" in status
    assert re.search(r"Policy: revision \d+, 1 policies, synced", status)
    assert "Hubble: " in status and "/4095 flows" in status
    eps = json.loads(run("endpoint", "list", "--socket", str(cfg.socket), "-o", "json", *pin))
    by_pod = {e["pod_name"]: e for e in eps}
    assert by_pod["backend"]["policy_enforcement"] == {"ingress": True, "egress": False}
    assert by_pod["frontend"]["policy_enforcement"] == {"ingress": False, "egress": False}
    assert by_pod["backend"]["identity"] >= 256
    # uint64 id as a JSON number (not protobuf's "12"), zero/empty fields present
    assert by_pod["backend"]["id"] == cluster.pods["backend"].endpoint_id
    assert by_pod["backend"]["chained"] is False and by_pod["backend"]["state"] == "ready"
    table = run("endpoint", "list", "--socket", str(cfg.socket), *pin)
    assert "IDENTITY" in table and "ingress" in table
    policy = json.loads(run("bpf", "policy", "list", "-o", "json", *pin))
    backend = cluster.pods["backend"].endpoint_id
    assert {
        (e["endpoint_id"], e["direction"], e["identity"], e["protocol"], e["port"], e["verdict"])
        for e in policy
    } == {(backend, "ingress", by_pod["frontend"]["identity"], "TCP", 8080, "allow")}
    ipcache = {
        e["prefix"]: e["identity"]
        for e in json.loads(run("bpf", "ipcache", "list", "-o", "json", *pin))
    }
    assert ipcache[f"{cluster.pods['backend'].ip}/32"] == by_pod["backend"]["identity"]
    router = cluster.agent.debug.Status(agent_pb2.StatusRequest()).router_ip
    assert ipcache[f"{router}/32"] == IDENTITY_HOST
    assert "PREFIX" in run("bpf", "ipcache", "list", *pin)


def test_a_policy_cilia_cannot_enforce_fails_closed_and_says_so(cluster: Cluster) -> None:
    """Kubernetes mode hands the agent a NetworkPolicy with a named port (the API server
    accepts it; Cilia's parser does not): the pod it selects becomes default-deny in that
    direction (a real connect that worked before fails), and the agent's status and the
    ``cilia_policy_unenforceable`` gauge name it. Deleting it opens the path again."""
    assert cluster.connect("frontend", "backend", 8080), "open before"
    named = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "named-egress", "namespace": "default"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "frontend"}},
            "policyTypes": ["Egress"],
            "egress": [{"ports": [{"protocol": "TCP", "port": "http"}]}],
        },
    }
    cluster.apply(named)
    try:
        assert not cluster.connect("frontend", "backend", 8080), "egress fails closed"
        status = cluster.agent.debug.Status(agent_pb2.StatusRequest())
        (line,) = status.datapath.unenforced_policies
        assert line.startswith("NetworkPolicy/default/named-egress: egress default-deny")
        assert "spec.egress[0]: named port 'http' in an egress rule not supported" in line
        assert "Policy not enforceable as written: NetworkPolicy/default/named-egress" in (
            status.message
        )
        text = generate_latest(cluster.agent.agent.metrics.registry).decode()
        assert metric(text, "cilia_policy_unenforceable") == 1
    finally:
        before = cluster.revision()
        cluster.op.delete_policy("NetworkPolicy", "default", "named-egress")
        wait(lambda: cluster.revision() > before)
    assert cluster.connect("frontend", "backend", 8080), "open again once it is gone"
    text = generate_latest(cluster.agent.agent.metrics.registry).decode()
    assert metric(text, "cilia_policy_unenforceable") == 0


def test_identity_allocation_failure_answers_unavailable_and_leaves_nothing(
    cluster: Cluster,
) -> None:
    agent, env = cluster.agent, cluster.env
    used = agent.debug.Status(agent_pb2.StatusRequest()).pools[0].used
    files = sorted((env.state_dir / "endpoints").glob("*.json"))
    cluster.op.fail_allocate = True
    try:
        with pytest.raises(grpc.RpcError) as err:
            add_pod(env, agent, "unlucky", {"app": "unlucky"})
    finally:
        cluster.op.fail_allocate = False
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "identity allocation" in (err.value.details() or "")
    assert agent.debug.Status(agent_pb2.StatusRequest()).pools[0].used == used
    assert sorted((env.state_dir / "endpoints").glob("*.json")) == files
    assert len(agent.agent.bpf.endpoints()) == 3
    leftover = host_ifname(f"ctr-unlucky-{env.tag}", "eth0")
    assert not pathlib.Path(f"/sys/class/net/{leftover}").exists(), "host veth removed"


def test_del_detaches_forgets_endpoint_and_releases_identity_at_operator(
    cluster: Cluster,
) -> None:
    agent, env, op = cluster.agent, cluster.env, cluster.op
    pod = add_pod(env, agent, "shortlived", {"app": "shortlived"})
    ident = op.identities[("k8s:app=shortlived", "k8s:io.kubernetes.pod.namespace=default")]
    ifindex = socket.if_nametoindex(pod.host_ifname)
    assert ifindex in agent.agent.bpf.endpoints()
    agent.attach.Del(
        agent_pb2.DelRequest(container_id=f"ctr-shortlived-{env.tag}", ifname="eth0"), timeout=20
    )
    assert ifindex not in agent.agent.bpf.endpoints()
    wait(lambda: ("default", "shortlived") in op.deleted_endpoints and ident in op.releases)
    out = subprocess.run(
        [str(BIN), "bpf", "ipcache", "list", "--bpf-pin-dir", str(agent.config.bpf_pin_dir)],
        capture_output=True,
        text=True,
    ).stdout
    assert f"{pod.ip}/32" not in out
    # identities still used by running pods were not released
    assert op.identities[("k8s:app=backend", "k8s:io.kubernetes.pod.namespace=default")] not in (
        op.releases
    )


def test_restart_under_ping_flood_loses_no_packet_and_keeps_enforcement(cluster: Cluster) -> None:
    cluster.apply(allow_ingress("backend-l3", ["frontend"], port=None))
    assert cluster.connect("frontend", "backend", 9090), "L3 allow: every port"
    ping = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            cluster.pods["frontend"].netns,
            "ping",
            "-i",
            "0.002",
            "-c",
            "6000",
            "-q",
            cluster.pods["backend"].ip,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)
        old = cluster.agent
        old.stop()
        # agent down: programs stay attached, maps stay pinned
        assert not cluster.connect("other", "backend", 8080), "still enforced while down"
        assert cluster.connect("frontend", "backend", 8080)
        started = time.monotonic()
        new = cluster.env.start_agent(
            static={},
            **{
                k: getattr(old.config, k)
                for k in (
                    "enable_bpf",
                    "operator",
                    "operator_reconnect_min_backoff",
                    "operator_reconnect_max_backoff",
                )
            },
        )
        cluster.agent = new
        restart_s = time.monotonic() - started
        assert ping.poll() is None, f"restart ({restart_s:.1f}s) outlasted the ping flood"
        out, _ = ping.communicate(timeout=60)
    finally:
        if ping.poll() is None:
            ping.send_signal(signal.SIGINT)
            ping.wait(10)
    m = re.search(r"(\d+) packets transmitted, (\d+) received", out)
    assert m, out
    sent, received = int(m.group(1)), int(m.group(2))
    print(f"restart took {restart_s:.2f}s; ping: {sent} sent, {received} received")
    assert sent == 6000 and received == sent, out
    # enforcement unchanged under the new agent, endpoints restored with their identities
    eps = new.debug.ListEndpoints(agent_pb2.ListEndpointsRequest()).endpoints
    assert sorted(e.pod_name for e in eps) == ["backend", "frontend", "other"]
    wait(lambda: new.agent.enforcement is not None and new.agent.enforcement.streams.ready)
    assert not cluster.connect("other", "backend", 8080)
    assert cluster.connect("frontend", "backend", 8080)
    # flows resume in the new agent's Observer
    wait(
        lambda: any(
            f.source.pod_name == "other" and f.verdict == flow_pb2.DROPPED for f in cluster.flows()
        )
    )
