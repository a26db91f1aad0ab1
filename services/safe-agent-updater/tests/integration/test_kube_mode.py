"""Kubernetes mode against a REAL kube-apiserver (the testkit's session ``kube_apiserver``:
etcd + kube-apiserver built by scripts/kube-tools.sh).

No kubelet or controller manager runs, so a test-side controller thread plays the DaemonSet
controller and the kubelet through the API: when the agent pod of a node is gone it creates
the replacement from the DaemonSet's template (a Pod bound to the node) and, unless told not
to, sets its Ready condition through the pods/status subresource; a pod being deleted
(``deletionTimestamp``: the server waits for the kubelet) is removed after its termination
delay, as a kubelet would. A real gRPC health server plays the agent. Each test works in a
namespace and on nodes of its own (the server is shared by the session); which requests the
updater made comes from the server's audit log.

API GETs failing with 503 a given number of times — a fault a real server cannot be made to
produce on demand — come from a plain-HTTP proxy in front of the real server.
(Kubeconfigs for the proxy and for a port nothing listens on: ``cilia_testkit.kubeconfig``.)
"""

from __future__ import annotations

import datetime as dt
import http.client
import http.server
import json
import pathlib
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cilia_safe_agent_updater.__main__ import main
from cilia_safe_agent_updater.exitcodes import Exit
from cilia_safe_agent_updater.generation import ANNOTATION
from cilia_testkit.kubeapi import KubeAPI, unique_name
from cilia_testkit.kubeconfig import write_kubeconfig

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
#: The User-Agent of the test's own requests (the controller/kubelet thread, set-up), so the
#: audit log tells them from the updater's.
TEST_AGENT = "cilia-test-controller"
#: Seconds a Controller leaving its block waits for the pods being deleted to be removed.
SETTLE_SECONDS = 10.0
#: Where each kind lives in the REST API: (path prefix, namespaced, plural).
RESOURCES = {
    "Pod": ("/api/v1", True, "pods"),
    "Node": ("/api/v1", False, "nodes"),
    "Event": ("/api/v1", True, "events"),
    "ServiceAccount": ("/api/v1", True, "serviceaccounts"),
    "DaemonSet": ("/apis/apps/v1", True, "daemonsets"),
    "ControllerRevision": ("/apis/apps/v1", True, "controllerrevisions"),
    "Lease": ("/apis/coordination.k8s.io/v1", True, "leases"),
}


class ApiError(RuntimeError):
    """A request the test made was refused: ``code`` and the server's Status message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"HTTP {code}: {message}")
        self.code = code


class Cluster:
    """One test's view of the real server: its namespace ``ns``, its node names, and the
    object helpers the tests need (put/get/list/delete as plain dicts, over HTTPS as admin).
    Thread-safe (one request per call)."""

    def __init__(self, kube: KubeAPI, ns: str) -> None:
        self.kube = kube
        self.ns = ns
        self._ctx: ssl.SSLContext = kube.ssl_context()

    def node(self, n: int = 1) -> str:
        """The name of this test's node ``n`` (cluster-scoped: named after the namespace)."""
        return f"{self.ns}-node-{n}"

    def _path(self, kind: str, name: str = "", ns: str | None = None, sub: str = "") -> str:
        prefix, namespaced, plural = RESOURCES[kind]
        path = (
            f"{prefix}/namespaces/{ns or self.ns}/{plural}" if namespaced else f"{prefix}/{plural}"
        )
        if name:
            path += f"/{name}"
        if sub:
            path += f"/{sub}"
        return path

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        """One API request; the decoded answer.

        Raises:
            ApiError: a non-2xx answer.
        """
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.kube.server + path, data=data, method=method,
            headers={"Content-Type": content_type, "User-Agent": TEST_AGENT},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=10) as resp:
                result: dict[str, Any] = json.load(resp)
                return result
        except urllib.error.HTTPError as exc:
            raise ApiError(exc.code, exc.read().decode(errors="replace")) from None

    def put_object(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Create ``obj``, or replace the existing one unconditionally; then set its
        ``status`` (Pod, Node) through the status subresource, as kubelet does."""
        obj = json.loads(json.dumps(obj))
        status = obj.pop("status", None)
        kind, meta = obj["kind"], obj["metadata"]
        ns = meta.get("namespace")
        try:
            if meta.get("resourceVersion"):  # read from the server: replace it
                raise ApiError(409, "exists")
            made = self.request("POST", self._path(kind, ns=ns), obj)
        except ApiError as exc:
            if exc.code != 409:
                raise
            current = self.get_object(kind, meta["name"], ns)
            meta["resourceVersion"] = current["metadata"]["resourceVersion"]
            made = self.request("PUT", self._path(kind, meta["name"], ns), obj)
        if status is not None and kind in ("Pod", "Node"):
            made = self.request(
                "PATCH", self._path(kind, meta["name"], ns, "status"), {"status": status},
                content_type="application/merge-patch+json",
            )  # fmt: skip
        return made

    def get_object(self, kind: str, name: str, ns: str | None = None) -> dict[str, Any]:
        """The object as the server has it (raises ApiError 404 when there is none)."""
        return self.request("GET", self._path(kind, name, ns))

    def objects(self, kind: str, ns: str | None = None) -> list[dict[str, Any]]:
        """Every object of ``kind`` in the namespace (this test's by default)."""
        items: list[dict[str, Any]] = self.request("GET", self._path(kind, ns=ns))["items"]
        return items

    def delete_now(self, kind: str, name: str) -> None:
        """Delete at once (grace period 0: what the kubelet does when a pod has stopped)."""
        try:
            self.request("DELETE", self._path(kind, name), {"gracePeriodSeconds": 0})
        except ApiError as exc:
            if exc.code != 404:
                raise

    def deletes(self) -> list[str]:
        """Paths of the pod DELETEs the updater made (the audit log, the test's own left out)."""
        return [
            e["requestURI"].split("?")[0]
            for e in self.kube.requests("delete", "pods", self.ns)
            if e.get("userAgent") != TEST_AGENT
        ]

    def reasons(self) -> list[str]:
        """The reasons of the Events in the namespace, oldest first."""
        events = sorted(self.objects("Event"), key=lambda e: int(e["metadata"]["resourceVersion"]))
        return [e["reason"] for e in events]


@pytest.fixture
def cluster(kube_apiserver: KubeAPI, request: pytest.FixtureRequest) -> Cluster:
    """A namespace of this test's own (with its ``default`` ServiceAccount, which admission
    requires before a Pod) on the session's real server."""
    ns = unique_name(request.node.name.removeprefix("test_")[:30])
    c = Cluster(kube_apiserver, ns)
    c.request("POST", "/api/v1/namespaces", {"metadata": {"name": ns}})
    c.put_object(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "default", "namespace": ns},
        }
    )
    return c


def _node(name: str, images: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"images": [{"names": images, "sizeBytes": 1}]},
    }


def _daemonset(ns: str, generation: str | None) -> dict[str, Any]:
    annotations = {ANNOTATION: generation} if generation is not None else {}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "cilia-agent", "namespace": ns},
        "spec": {
            "selector": {"matchLabels": {"app": "cilia-agent"}},
            "updateStrategy": {"type": "OnDelete"},
            "template": {
                "metadata": {"labels": {"app": "cilia-agent"}, "annotations": annotations},
                "spec": {"containers": [{"name": "agent", "image": AGENT_IMAGE}]},
            },
        },
    }


def _pod(ns: str, name: str, node: str, generation: str, ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": {"app": "cilia-agent"},
            "annotations": {ANNOTATION: generation},
        },
        "spec": {"nodeName": node, "containers": [{"name": "agent", "image": AGENT_IMAGE}]},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


class Controller(threading.Thread):
    """Plays the DaemonSet controller + kubelet for ``nodes`` on the real server.

    When a node has no live agent pod, it creates one from the DaemonSet template
    (annotation included), then marks it Ready when ``make_ready``. A pod being deleted is
    removed ``termination_delay`` seconds after it was first seen terminating. Records the
    largest number of nodes that were without a Ready agent at the same time.
    """

    def __init__(
        self,
        cluster: Cluster,
        nodes: list[str],
        make_ready: bool = True,
        termination_delay: float = 0.0,
    ) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.nodes = nodes
        self.make_ready = make_ready
        self.termination_delay = termination_delay
        self.stop = threading.Event()
        self.created: list[str] = []
        self.max_not_ready = 0
        self.error: BaseException | None = None
        self._terminating: dict[str, float] = {}

    def __enter__(self) -> Controller:
        """Start the thread; ``with Controller(...) as c:`` runs it for the block."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Let the kubelet finish the pods being deleted (up to SETTLE_SECONDS), stop the
        thread, wait for it to end, re-raise what failed in it."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while self.error is None and time.monotonic() < deadline:
            if not any(p["metadata"].get("deletionTimestamp") for p in self.cluster.objects("Pod")):
                break
            time.sleep(0.05)
        self.stop.set()
        self.join()
        if self.error is not None:
            raise self.error

    def run(self) -> None:
        try:
            serial = 0
            while not self.stop.wait(0.02):
                serial = self._step(serial)
        except BaseException as exc:  # reported by __exit__
            self.error = exc

    def _step(self, serial: int) -> int:
        c = self.cluster
        template = c.get_object("DaemonSet", "cilia-agent")["spec"]["template"]
        pods = c.objects("Pod")
        now = time.monotonic()
        for p in pods:  # the kubelet: a stopped pod is removed
            if p["metadata"].get("deletionTimestamp"):
                first = self._terminating.setdefault(p["metadata"]["uid"], now)
                if now - first >= self.termination_delay:
                    c.delete_now("Pod", p["metadata"]["name"])
        not_ready = 0
        for node in self.nodes:
            mine = [p for p in pods if p["spec"]["nodeName"] == node]
            live = [p for p in mine if not p["metadata"].get("deletionTimestamp")]
            if not live:
                not_ready += 1
                serial += 1
                name = f"cilia-agent-{node}-{serial}"
                generation = template["metadata"]["annotations"][ANNOTATION]
                c.put_object(_pod(c.ns, name, node, generation, ready=False))
                self.created.append(name)
                continue
            pod = live[0]
            if not _ready(pod):
                not_ready += 1
                if self.make_ready:
                    pod["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
                    c.put_object({"apiVersion": "v1", "kind": "Pod", **pod})
        self.max_not_ready = max(self.max_not_ready, not_ready)
        return serial


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


def _setup(c: Cluster, *, ds_generation: str | None = NEW, pods: int = 1) -> None:
    c.put_object(_daemonset(c.ns, ds_generation))
    c.put_object(_node(c.node(), [AGENT_IMAGE]))
    for i in range(pods):
        c.put_object(_pod(c.ns, f"cilia-agent-old-{i}", c.node(), OLD))


def _run(c: Cluster, *extra: str, node: str = "", health_addr: str = "") -> int:
    return main(
        [
            "--mode",
            "kubernetes",
            "--kubeconfig",
            str(c.kube.kubeconfig),
            "--namespace",
            c.ns,
            "--node-name",
            node or c.node(),
            "--agent-health-address",
            health_addr,
            *FAST,
            *extra,
        ]
    )


def test_equal_hash_is_a_noop(cluster: Cluster) -> None:
    _setup(cluster)
    pod = cluster.get_object("Pod", "cilia-agent-old-0")
    pod["metadata"]["annotations"][ANNOTATION] = NEW
    cluster.put_object(pod)

    assert _run(cluster) == Exit.OK
    assert cluster.deletes() == []
    assert cluster.get_object("Pod", "cilia-agent-old-0")["metadata"]["uid"]
    assert cluster.reasons() == ["AgentUpToDate"]


def _revision(c: Cluster, number: int, digest: str) -> None:
    """A ControllerRevision of the agent DaemonSet, as its controller writes one."""
    ds = c.get_object("DaemonSet", "cilia-agent")
    c.put_object(
        {
            "apiVersion": "apps/v1",
            "kind": "ControllerRevision",
            "metadata": {
                "name": f"cilia-agent-{digest}",
                "namespace": c.ns,
                "labels": {"app": "cilia-agent", "controller-revision-hash": digest},
                "ownerReferences": [
                    {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "cilia-agent",
                     "uid": ds["metadata"]["uid"], "controller": True}
                ],
            },
            "revision": number,
            "data": {"spec": {"template": ds["spec"]["template"]}},
        }
    )  # fmt: skip


def _label_revision(c: Cluster, digest: str, annotation: str = NEW) -> None:
    pod = c.get_object("Pod", "cilia-agent-old-0")
    pod["metadata"]["annotations"][ANNOTATION] = annotation
    pod["metadata"].setdefault("labels", {})["controller-revision-hash"] = digest
    c.put_object(pod)


def test_a_new_daemonset_revision_rolls_the_agent_though_the_stamped_hash_is_unchanged(
    cluster: Cluster, agent_health: str
) -> None:
    """An overlay changed the agent's image without `hash --write`: the annotation is the
    same, the DaemonSet controller's revision is new — the agent is replaced (issue 12)."""
    _setup(cluster)
    _revision(cluster, 1, "6c9b7f5d4")
    _revision(cluster, 2, "7d8f9c6b5")
    _label_revision(cluster, "6c9b7f5d4")  # the committed hash did not change
    with Controller(cluster, [cluster.node()]):
        assert _run(cluster, health_addr=agent_health) == Exit.OK
    assert cluster.deletes() == [f"/api/v1/namespaces/{cluster.ns}/pods/cilia-agent-old-0"]
    assert cluster.reasons()[0] == "AgentOutdated"


def test_the_current_revision_on_the_pod_is_a_noop_whatever_the_annotations(
    cluster: Cluster,
) -> None:
    _setup(cluster)
    _revision(cluster, 1, "6c9b7f5d4")
    _revision(cluster, 2, "7d8f9c6b5")
    _label_revision(cluster, "7d8f9c6b5", annotation=OLD)  # the revision is the truth
    assert _run(cluster) == Exit.OK
    assert cluster.deletes() == []
    assert cluster.reasons() == ["AgentUpToDate"]


def test_differing_hash_deletes_waits_for_ready_and_health(
    cluster: Cluster, agent_health: str
) -> None:
    _setup(cluster)
    with Controller(cluster, [cluster.node()]) as controller:
        assert _run(cluster, health_addr=agent_health) == Exit.OK
    pods = cluster.objects("Pod")
    assert [p["metadata"]["name"] for p in pods] == controller.created
    assert len(pods) == 1
    assert pods[0]["metadata"]["annotations"][ANNOTATION] == NEW
    assert cluster.deletes() == [f"/api/v1/namespaces/{cluster.ns}/pods/cilia-agent-old-0"]
    assert cluster.reasons() == [
        "AgentOutdated",
        "ImagesPresent",
        "AgentPodDeleted",
        "ReplacementCreated",
        "ReplacementReady",
        "AgentHealthy",
        "AgentUpdated",
    ]
    new_pod_events = [e for e in cluster.objects("Event") if e["reason"] == "ReplacementReady"]
    assert new_pod_events[0]["involvedObject"]["name"] == controller.created[0]


def test_terminating_old_pod_is_not_taken_for_the_replacement(
    cluster: Cluster, agent_health: str
) -> None:
    _setup(cluster)
    with Controller(cluster, [cluster.node()], termination_delay=0.3) as controller:
        assert _run(cluster, health_addr=agent_health) == Exit.OK
    live = [p for p in cluster.objects("Pod") if not p["metadata"].get("deletionTimestamp")]
    assert [p["metadata"]["name"] for p in live] == controller.created


def test_replacement_never_ready_fails_bounded(cluster: Cluster) -> None:
    _setup(cluster)
    with Controller(cluster, [cluster.node()], make_ready=False):
        code = _run(cluster, "--ready-attempts", "5")
    assert code == Exit.REPLACEMENT_NOT_READY
    reasons = cluster.reasons()
    assert reasons[-1] == "UpdateFailed"
    assert "ReplacementReady" not in reasons


def test_agent_health_never_serving_fails(cluster: Cluster, tmp_path: pathlib.Path) -> None:
    _setup(cluster)
    with Controller(cluster, [cluster.node()]):
        code = _run(
            cluster,
            "--health-attempts",
            "2",
            "--health-rpc-timeout",
            "0.2",
            health_addr=f"unix:{tmp_path}/nobody.sock",
        )
    assert code == Exit.AGENT_UNHEALTHY


def test_missing_annotation_exits_11_and_touches_nothing(cluster: Cluster) -> None:
    _setup(cluster, ds_generation=None)
    assert _run(cluster) == Exit.ANNOTATION_MISSING
    assert cluster.deletes() == []


def test_two_agent_pods_on_the_node_exit_13(cluster: Cluster) -> None:
    _setup(cluster, pods=2)
    assert _run(cluster) == Exit.MULTIPLE_AGENT_PODS
    assert cluster.deletes() == []
    assert len(cluster.objects("Pod")) == 2


def test_no_agent_pod_and_no_daemonset(cluster: Cluster) -> None:
    cluster.put_object(_node(cluster.node(), [AGENT_IMAGE]))
    assert _run(cluster) == Exit.DAEMONSET_NOT_FOUND
    cluster.put_object(_daemonset(cluster.ns, NEW))
    assert _run(cluster) == Exit.NO_AGENT_POD


def test_missing_image_on_node_does_not_delete(cluster: Cluster) -> None:
    _setup(cluster)
    cluster.put_object(_node(cluster.node(), ["something-else:1"]))
    assert _run(cluster, "--image-check-attempts", "3") == Exit.IMAGES_MISSING
    assert cluster.deletes() == []


def test_generation_skew_exits_19(cluster: Cluster) -> None:
    _setup(cluster)
    assert _run(cluster, "--expected-generation", "c" * 64) == Exit.GENERATION_SKEW
    assert cluster.deletes() == []


class FlakyProxy(http.server.ThreadingHTTPServer):
    """Plain HTTP on loopback in front of the real API server (HTTPS, as the admin: the
    client's own credentials are dropped), answering 503 to the first ``failures`` GETs of
    ``path`` — the fault a real server cannot be made to produce on demand."""

    def __init__(self, kube: KubeAPI, path: str, failures: int) -> None:
        self.upstream = urllib.parse.urlsplit(kube.server)
        self.context = kube.ssl_context()
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
        conn = http.client.HTTPSConnection(
            srv.upstream.hostname or "127.0.0.1", srv.upstream.port, timeout=10,
            context=srv.context,
        )  # fmt: skip
        drop = ("host", "connection", "authorization")
        headers = {k: v for k, v in self.headers.items() if k.lower() not in drop}
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
    cluster: Cluster, tmp_path: pathlib.Path, agent_health: str
) -> None:
    """The first 3 GETs of the DaemonSet answer 503 (the proxy); the update still succeeds."""
    _setup(cluster)
    ds_path = f"/apis/apps/v1/namespaces/{cluster.ns}/daemonsets/cilia-agent"
    proxy = FlakyProxy(cluster.kube, ds_path, failures=3)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    kubeconfig = write_kubeconfig(f"http://127.0.0.1:{proxy.server_address[1]}", tmp_path / "kc")
    try:
        with Controller(cluster, [cluster.node()]):
            code = main(
                [
                    "--mode",
                    "kubernetes",
                    "--kubeconfig",
                    str(kubeconfig),
                    "--namespace",
                    cluster.ns,
                    "--node-name",
                    cluster.node(),
                    "--agent-health-address",
                    agent_health,
                    *FAST,
                ]
            )
    finally:
        proxy.shutdown()
    assert proxy.failed == 3
    assert code == Exit.OK
    assert cluster.objects("Pod")[0]["metadata"]["annotations"][ANNOTATION] == NEW


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


def _lease(ns: str, holder: str, renewed: dt.datetime) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "cilia-safe-agent-updater-0", "namespace": ns},
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 60,
            "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        },
    }


def test_lease_held_by_another_node_blocks_the_update(cluster: Cluster) -> None:
    _setup(cluster)
    cluster.put_object(_lease(cluster.ns, "node-9", dt.datetime.now(dt.UTC)))
    code = _run(cluster, "--max-concurrent-updates", "1", "--lease-wait-timeout", "0.3")
    assert code == Exit.LOCK_TIMEOUT
    assert cluster.deletes() == []
    lease = cluster.get_object("Lease", "cilia-safe-agent-updater-0")
    assert lease["spec"]["holderIdentity"] == "node-9"


def test_expired_lease_is_taken_and_released(cluster: Cluster, agent_health: str) -> None:
    _setup(cluster)
    stale = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=120)
    cluster.put_object(_lease(cluster.ns, "node-9", stale))
    with Controller(cluster, [cluster.node()]):
        code = _run(cluster, "--max-concurrent-updates", "1", health_addr=agent_health)
    assert code == Exit.OK
    lease = cluster.get_object("Lease", "cilia-safe-agent-updater-0")
    assert lease["spec"].get("holderIdentity") is None
    assert lease["spec"]["leaseTransitions"] == 1


def test_lease_limit_of_one_serialises_three_nodes(cluster: Cluster, agent_health: str) -> None:
    nodes = [cluster.node(1), cluster.node(2), cluster.node(3)]
    cluster.put_object(_daemonset(cluster.ns, NEW))
    for node in nodes:
        cluster.put_object(_node(node, [AGENT_IMAGE]))
        cluster.put_object(_pod(cluster.ns, f"cilia-agent-{node}-old", node, OLD))
    controller = Controller(cluster, nodes)
    controller.start()
    # Three updaters at once (threads: one interpreter start instead of three).
    with futures.ThreadPoolExecutor(max_workers=3) as pool:
        running = [
            pool.submit(
                _run,
                cluster,
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
            controller.__exit__()
    assert codes == [0, 0, 0]
    assert controller.max_not_ready == 1
    pods = cluster.objects("Pod")
    assert sorted(p["metadata"]["annotations"][ANNOTATION] for p in pods) == [NEW] * 3


def test_exit_code_of_the_process(cluster: Cluster) -> None:
    _setup(cluster, pods=2)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "cilia_safe_agent_updater",
            "--mode",
            "kubernetes",
            "--kubeconfig",
            str(cluster.kube.kubeconfig),
            "--namespace",
            cluster.ns,
            "--node-name",
            cluster.node(),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 13
    assert f"2 agent pods on node {cluster.node()}" in out.stderr
    assert '"step": "UpdateFailed"' in out.stderr or '"exit_code": 13' in out.stderr


def test_missing_node_name_is_usage_error(cluster: Cluster) -> None:
    args = ["--mode", "kubernetes", "--kubeconfig", str(cluster.kube.kubeconfig), "--node-name", ""]
    assert main(args) == Exit.USAGE
