"""Kubernetes mode against cilia-kubemock (a mock API server speaking real HTTP).

A test-side controller thread plays the DaemonSet controller and the kubelet: when the agent
pod of a node is gone it creates the replacement from the DaemonSet's template, and (unless
told not to) marks it Ready; a real gRPC health server plays the agent.
"""

from __future__ import annotations

import datetime as dt
import http.client
import http.server
import pathlib
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cilia_kubemock import KubeAPI, KubeMock, write_kubeconfig
from cilia_safe_agent_updater.__main__ import main
from cilia_safe_agent_updater.exitcodes import Exit
from cilia_safe_agent_updater.generation import ANNOTATION

NS = "cilia-system"
AGENT_IMAGE = "cilia-agent:0.2.0"
OLD = "a" * 64
NEW = "b" * 64
FAST = [
    "--poll-interval",
    "0.05",
    "--api-retry-backoff",
    "0.01",
    "--pod-replace-attempts",
    "200",
    "--ready-attempts",
    "200",
    "--image-check-attempts",
    "20",
]


def _node(name: str, images: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"images": [{"names": images, "sizeBytes": 1}]},
    }


def _daemonset(generation: str | None) -> dict[str, Any]:
    annotations = {ANNOTATION: generation} if generation is not None else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "cilia-agent", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": {"app": "cilia-agent"}},
            "updateStrategy": {"type": "OnDelete"},
            "template": {
                "metadata": {"labels": {"app": "cilia-agent"}, "annotations": annotations},
                "spec": {"containers": [{"name": "agent", "image": AGENT_IMAGE}]},
            },
        },
    }


def _pod(name: str, node: str, generation: str, ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"app": "cilia-agent"},
            "annotations": {ANNOTATION: generation},
        },
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": AGENT_IMAGE}]},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


class Controller(threading.Thread):
    """Plays the DaemonSet controller + kubelet for ``nodes`` on the mock.

    When a node has no live agent pod, it creates one from the DaemonSet template
    (annotation included), then marks it Ready when ``make_ready``. Records the largest
    number of nodes that were without a Ready agent at the same time.
    """

    def __init__(self, mock: KubeMock, nodes: list[str], make_ready: bool = True) -> None:
        super().__init__(daemon=True)
        self.mock = mock
        self.nodes = nodes
        self.make_ready = make_ready
        self.stop = threading.Event()
        self.created: list[str] = []
        self.max_not_ready = 0

    def __enter__(self) -> Controller:
        """Start the thread; ``with Controller(...) as c:`` runs it for the block."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the thread and wait for it to end."""
        self.stop.set()
        self.join()

    def run(self) -> None:
        serial = 0
        while not self.stop.wait(0.02):
            template = self.mock.get_object("DaemonSet", "cilia-agent", NS)["spec"]["template"]
            pods = self.mock.objects("Pod", NS)
            not_ready = 0
            for node in self.nodes:
                mine = [p for p in pods if p["spec"]["nodeName"] == node]
                live = [p for p in mine if not p["metadata"].get("deletionTimestamp")]
                if not live:
                    not_ready += 1
                    serial += 1
                    name = f"cilia-agent-{node}-{serial}"
                    pod = _pod(
                        name, node, template["metadata"]["annotations"][ANNOTATION], ready=False
                    )
                    self.mock.put_object(pod)
                    self.created.append(name)
                    continue
                pod = live[0]
                if not any(c.get("status") == "True" for c in pod["status"]["conditions"]):
                    not_ready += 1
                    if self.make_ready:
                        pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
                        self.mock.put_object(pod)
            self.max_not_ready = max(self.max_not_ready, not_ready)


@pytest.fixture
def agent_health(tmp_path: pathlib.Path) -> Iterator[str]:
    """A real grpc.health.v1 server answering SERVING on a unix socket (the agent)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"unix:{tmp_path}/agent.sock"
    server.add_insecure_port(address)
    server.start()
    yield address
    server.stop(0)


def _setup(mock: KubeMock, *, ds_generation: str | None = NEW, pods: int = 1) -> None:
    mock.put_object(_daemonset(ds_generation))
    mock.put_object(_node("node-1", [AGENT_IMAGE]))
    for i in range(pods):
        mock.put_object(_pod(f"cilia-agent-old-{i}", "node-1", OLD))


def _run(kube_api: KubeAPI, *extra: str, node: str = "node-1", health_addr: str = "") -> int:
    return main(
        [
            "--mode",
            "kubernetes",
            "--kubeconfig",
            str(kube_api.kubeconfig),
            "--node-name",
            node,
            "--agent-health-address",
            health_addr,
            *FAST,
            *extra,
        ]
    )


def _deletes(mock: KubeMock) -> list[str]:
    return [path for method, path in mock.requests if method == "DELETE"]


def _reasons(mock: KubeMock) -> list[str]:
    events = sorted(mock.objects("Event", NS), key=lambda e: int(e["metadata"]["resourceVersion"]))
    return [e["reason"] for e in events]


def test_equal_hash_is_a_noop(kube_api: KubeAPI) -> None:
    _setup(kube_api.mock)
    pod = kube_api.mock.get_object("Pod", "cilia-agent-old-0", NS)
    pod["metadata"]["annotations"][ANNOTATION] = NEW
    kube_api.mock.put_object(pod)

    assert _run(kube_api) == Exit.OK
    assert _deletes(kube_api.mock) == []
    assert kube_api.mock.get_object("Pod", "cilia-agent-old-0", NS)["metadata"]["uid"]
    assert _reasons(kube_api.mock) == ["AgentUpToDate"]


def test_differing_hash_deletes_waits_for_ready_and_health(
    kube_api: KubeAPI, agent_health: str
) -> None:
    _setup(kube_api.mock)
    with Controller(kube_api.mock, ["node-1"]) as controller:
        assert _run(kube_api, health_addr=agent_health) == Exit.OK
    pods = kube_api.mock.objects("Pod", NS)
    assert [p["metadata"]["name"] for p in pods] == controller.created
    assert len(pods) == 1
    assert pods[0]["metadata"]["annotations"][ANNOTATION] == NEW
    assert _deletes(kube_api.mock) == [f"/api/v1/namespaces/{NS}/pods/cilia-agent-old-0"]
    assert _reasons(kube_api.mock) == [
        "AgentOutdated",
        "ImagesPresent",
        "AgentPodDeleted",
        "ReplacementCreated",
        "ReplacementReady",
        "AgentHealthy",
        "AgentUpdated",
    ]
    new_pod_events = [
        e for e in kube_api.mock.objects("Event", NS) if e["reason"] == "ReplacementReady"
    ]
    assert new_pod_events[0]["involvedObject"]["name"] == controller.created[0]


@pytest.mark.kubemock(pod_termination_delay=0.3)
def test_terminating_old_pod_is_not_taken_for_the_replacement(
    kube_api: KubeAPI, agent_health: str
) -> None:
    _setup(kube_api.mock)
    with Controller(kube_api.mock, ["node-1"]) as controller:
        assert _run(kube_api, health_addr=agent_health) == Exit.OK
    live = [
        p for p in kube_api.mock.objects("Pod", NS) if not p["metadata"].get("deletionTimestamp")
    ]
    assert [p["metadata"]["name"] for p in live] == controller.created


def test_replacement_never_ready_fails_bounded(kube_api: KubeAPI) -> None:
    _setup(kube_api.mock)
    with Controller(kube_api.mock, ["node-1"], make_ready=False):
        code = _run(kube_api, "--ready-attempts", "5")
    assert code == Exit.REPLACEMENT_NOT_READY
    reasons = _reasons(kube_api.mock)
    assert reasons[-1] == "UpdateFailed"
    assert "ReplacementReady" not in reasons


def test_agent_health_never_serving_fails(kube_api: KubeAPI, tmp_path: pathlib.Path) -> None:
    _setup(kube_api.mock)
    with Controller(kube_api.mock, ["node-1"]):
        code = _run(
            kube_api,
            "--health-attempts",
            "2",
            "--health-rpc-timeout",
            "0.2",
            health_addr=f"unix:{tmp_path}/nobody.sock",
        )
    assert code == Exit.AGENT_UNHEALTHY


def test_missing_annotation_exits_11_and_touches_nothing(kube_api: KubeAPI) -> None:
    _setup(kube_api.mock, ds_generation=None)
    assert _run(kube_api) == Exit.ANNOTATION_MISSING
    assert _deletes(kube_api.mock) == []


def test_two_agent_pods_on_the_node_exit_13(kube_api: KubeAPI) -> None:
    _setup(kube_api.mock, pods=2)
    assert _run(kube_api) == Exit.MULTIPLE_AGENT_PODS
    assert _deletes(kube_api.mock) == []
    assert len(kube_api.mock.objects("Pod", NS)) == 2


def test_no_agent_pod_and_no_daemonset(kube_api: KubeAPI) -> None:
    kube_api.mock.put_object(_node("node-1", [AGENT_IMAGE]))
    assert _run(kube_api) == Exit.DAEMONSET_NOT_FOUND
    kube_api.mock.put_object(_daemonset(NEW))
    assert _run(kube_api) == Exit.NO_AGENT_POD


def test_missing_image_on_node_does_not_delete(kube_api: KubeAPI) -> None:
    _setup(kube_api.mock)
    kube_api.mock.put_object(_node("node-1", ["something-else:1"]))
    assert _run(kube_api, "--image-check-attempts", "3") == Exit.IMAGES_MISSING
    assert _deletes(kube_api.mock) == []


def test_generation_skew_exits_19(kube_api: KubeAPI) -> None:
    _setup(kube_api.mock)
    assert _run(kube_api, "--expected-generation", "c" * 64) == Exit.GENERATION_SKEW
    assert _deletes(kube_api.mock) == []


class FlakyProxy(http.server.ThreadingHTTPServer):
    """Forwards to the mock, answering 503 to the first ``failures`` GETs of ``path``."""

    def __init__(self, upstream: str, path: str, failures: int) -> None:
        self.upstream = urllib.parse.urlsplit(upstream)
        self.path = path
        self.failures = failures
        self.failed = 0
        super().__init__(("127.0.0.1", 0), _ProxyHandler)


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: FlakyProxy

    def log_message(self, *args: object) -> None:
        pass

    def _forward(self) -> None:
        srv = self.server
        if (
            self.command == "GET"
            and self.path.split("?")[0] == srv.path
            and srv.failed < srv.failures
        ):
            srv.failed += 1
            body = b'{"kind":"Status","status":"Failure","code":503,"reason":"ServiceUnavailable"}'
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else None
        conn = http.client.HTTPConnection(srv.upstream.hostname, srv.upstream.port, timeout=10)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        conn.request(self.command, self.path, body=data, headers=headers)
        resp = conn.getresponse()
        payload = resp.read()
        self.send_response(resp.status)
        for key, value in resp.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        conn.close()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _forward  # noqa: N815


def test_transient_get_failures_are_retried_not_fatal(
    kube_api: KubeAPI, tmp_path: pathlib.Path, agent_health: str
) -> None:
    _setup(kube_api.mock)
    ds_path = f"/apis/apps/v1/namespaces/{NS}/daemonsets/cilia-agent"
    proxy = FlakyProxy(kube_api.url, ds_path, failures=3)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    kubeconfig = write_kubeconfig(f"http://127.0.0.1:{proxy.server_address[1]}", tmp_path / "kc")
    try:
        with Controller(kube_api.mock, ["node-1"]):
            code = main(
                [
                    "--mode",
                    "kubernetes",
                    "--kubeconfig",
                    str(kubeconfig),
                    "--node-name",
                    "node-1",
                    "--agent-health-address",
                    agent_health,
                    *FAST,
                ]
            )
    finally:
        proxy.shutdown()
    assert proxy.failed == 3
    assert code == Exit.OK
    assert kube_api.mock.objects("Pod", NS)[0]["metadata"]["annotations"][ANNOTATION] == NEW


def test_api_down_after_retries_exits_3(tmp_path: pathlib.Path) -> None:
    kubeconfig = write_kubeconfig("http://127.0.0.1:9", tmp_path / "kc")  # discard port: refused
    code = main(
        [
            "--mode",
            "kubernetes",
            "--kubeconfig",
            str(kubeconfig),
            "--node-name",
            "n",
            "--api-retries",
            "2",
            *FAST,
        ]
    )
    assert code == Exit.API_UNAVAILABLE


def _lease(holder: str, renewed: dt.datetime) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "cilia-safe-agent-updater-0", "namespace": NS},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 60,
            "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        },
    }


def test_lease_held_by_another_node_blocks_the_update(kube_api: KubeAPI) -> None:
    _setup(kube_api.mock)
    kube_api.mock.put_object(_lease("node-9", dt.datetime.now(dt.UTC)))
    code = _run(kube_api, "--max-concurrent-updates", "1", "--lease-wait-timeout", "0.3")
    assert code == Exit.LOCK_TIMEOUT
    assert _deletes(kube_api.mock) == []
    lease = kube_api.mock.get_object("Lease", "cilia-safe-agent-updater-0", NS)
    assert lease["spec"]["holderIdentity"] == "node-9"


def test_expired_lease_is_taken_and_released(kube_api: KubeAPI, agent_health: str) -> None:
    _setup(kube_api.mock)
    stale = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=120)
    kube_api.mock.put_object(_lease("node-9", stale))
    with Controller(kube_api.mock, ["node-1"]):
        code = _run(kube_api, "--max-concurrent-updates", "1", health_addr=agent_health)
    assert code == Exit.OK
    lease = kube_api.mock.get_object("Lease", "cilia-safe-agent-updater-0", NS)
    assert lease["spec"].get("holderIdentity") is None
    assert lease["spec"]["leaseTransitions"] == 1


def test_lease_limit_of_one_serialises_three_nodes(kube_api: KubeAPI, agent_health: str) -> None:
    nodes = ["node-1", "node-2", "node-3"]
    kube_api.mock.put_object(_daemonset(NEW))
    for node in nodes:
        kube_api.mock.put_object(_node(node, [AGENT_IMAGE]))
        kube_api.mock.put_object(_pod(f"cilia-agent-{node}-old", node, OLD))
    controller = Controller(kube_api.mock, nodes)
    controller.start()
    # Three updaters at once (threads: one interpreter start instead of three).
    with futures.ThreadPoolExecutor(max_workers=3) as pool:
        running = [
            pool.submit(
                _run,
                kube_api,
                "--max-concurrent-updates",
                "1",
                "--lease-wait-timeout",
                "60",
                "--poll-interval",
                "0.1",
                node=node,
                health_addr=agent_health,
            )
            for node in nodes
        ]
        try:
            codes = [f.result(timeout=120) for f in running]
        finally:
            controller.stop.set()
            controller.join()
    assert codes == [0, 0, 0]
    assert controller.max_not_ready == 1
    pods = kube_api.mock.objects("Pod", NS)
    assert sorted(p["metadata"]["annotations"][ANNOTATION] for p in pods) == [NEW] * 3


def test_exit_code_of_the_process(kube_api: KubeAPI) -> None:
    _setup(kube_api.mock, pods=2)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cilia_safe_agent_updater",
            "--mode",
            "kubernetes",
            "--kubeconfig",
            str(kube_api.kubeconfig),
            "--node-name",
            "node-1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 13
    assert "2 agent pods on node node-1" in out.stderr
    assert '"step": "UpdateFailed"' in out.stderr or '"exit_code": 13' in out.stderr


def test_missing_node_name_is_usage_error(kube_api: KubeAPI) -> None:
    args = ["--mode", "kubernetes", "--kubeconfig", str(kube_api.kubeconfig), "--node-name", ""]
    assert main(args) == Exit.USAGE
