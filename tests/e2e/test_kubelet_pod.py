"""Real Pods: a kubelet with containerd (CRI) runs them, ``cilia-cni`` networks them.

The session's real kube-apiserver (``kube_apiserver``) with Cilia's CRDs; a Stack whose
operator runs with ``--store kubernetes`` and whose agent is node ``cilia-kl-<pid>``; and a
real node of that name (:class:`cilia_testkit.kubelet.KubeletNode`: the kubelet built from
k8s.io/kubernetes by ``scripts/kubelet-tools.sh``, a private containerd whose CRI plugin
calls the agent's conflist and ``cilia-cni``). Nothing here calls the CNI plugin: the test
only creates Pod objects (``spec.nodeName`` set, there being no scheduler) and the kubelet
does the rest — sandbox, CNI ADD through CRI, container start, and on deletion CNI DEL.

One test, several outcomes (one node start):

- the three Pods get Running with an IP from the agent's pool, the kubelet reports it as
  ``status.podIP``, and the agent has an endpoint per pod with that IP;
- each pod's identity is built from its Pod and Namespace labels (the CiliumIdentity in the
  API server), though containerd sends no labels in the CNI call;
- real TCP from inside the pods' network namespaces: before any policy every pod reaches the
  backend; a CiliumNetworkPolicy created through the API lets only ``app=frontend`` in;
- deleting a Pod through the API makes the kubelet tear its sandbox down: CNI DEL reaches
  the agent, whose endpoint and CiliumEndpoint go.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import traffic

from cilia_testkit import ROOT, VENV_BIN, host, kubelet, skips
from cilia_testkit.kubeapi import KubeAPI, binary_missing, unique_name
from cilia_testkit.kubelet import KubeletNode
from cilia_testkit.ociimage import IMAGE
from cilia_testkit.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

PORT = 8080
#: Seconds the CNP may take to be enforced after it is created.
POLICY_WAIT_SECONDS = 15.0
#: Seconds a deleted Pod's endpoint may take to leave the agent and the API server.
TEARDOWN_WAIT_SECONDS = 60.0
ROLES = ("frontend", "backend", "other")


def _pod(name: str, namespace: str, node: str, app: str) -> dict[str, Any]:
    args = ["serve", str(PORT)] if app == "backend" else ["pause"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": app}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 2,
            "containers": [
                {"name": "main", "image": IMAGE, "imagePullPolicy": "Never", "args": args}
            ],
        },
    }


def _connect(netns: str, address: str, port: int) -> str | None:
    """TCP connect from inside ``netns`` (a path); the greeting read, or None."""
    out = subprocess.run(
        ["nsenter", f"--net={netns}", sys.executable, "-c", traffic.CONNECT,
         address, str(port), "1.0"],
        capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    return (out.stdout.strip() or None) if out.returncode == 0 else None


class World:
    """The running node, stack, namespace and pods (role -> name, IP, netns)."""

    def __init__(self, kube: KubeAPI, stack: Stack, node: KubeletNode, namespace: str) -> None:
        self.kube = kube
        self.stack = stack
        self.node = node
        self.namespace = namespace
        self.names: dict[str, str] = {}
        self.ips: dict[str, str] = {}
        self.netns: dict[str, str] = {}
        self.startup: dict[str, float] = {}

    def reaches(self, src: str, dst: str) -> bool:
        got = _connect(self.netns[src], self.ips[dst], PORT)
        return got == f"hello from {self.names[dst]} on {PORT}"


@pytest.fixture(scope="module")
def world(kube_apiserver: KubeAPI) -> Iterator[World]:
    skips.require(kubelet.missing())
    kube = kube_apiserver
    kube.install_crds(ROOT / "deploy" / "helm" / "cilia" / "files" / "crds")
    node_name = f"cilia-kl-{os.getpid()}"
    namespace = unique_name("kl")
    stack = Stack(
        "e2e-kubelet",
        agents=0,
        relay=False,
        operator_args=("--store", "kubernetes", "--kubeconfig", str(kube.kubeconfig)),
    )
    stack.start()
    node: KubeletNode | None = None
    try:
        agent = stack.add_agent(node_name=node_name)
        agent.start()
        node = KubeletNode(kube, node_name, cni_conf_dir=agent.conf_dir, images=(IMAGE, NEW_IMAGE))
        t0 = time.monotonic()
        node.start()
        w = World(kube, stack, node, namespace)
        w.startup["node_ready"] = time.monotonic() - t0
        ns = {"apiVersion": "v1", "kind": "Namespace",
              "metadata": {"name": namespace, "labels": {"team": "shop"}}}  # fmt: skip
        node.kubectl("apply", "-f", "-", input=json.dumps(ns))
        node.prepare_namespace(namespace)
        t0 = time.monotonic()
        pods = []
        for role in ROLES:
            w.names[role] = f"{role}-{os.getpid()}"
            pods.append(_pod(w.names[role], namespace, node_name, role))
        node.kubectl(
            "apply", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}),
        )  # fmt: skip
        for role in ROLES:
            pod = node.wait_running(namespace, w.names[role])
            w.ips[role] = pod["status"]["podIP"]
            w.netns[role] = node.pod_netns(namespace, w.names[role])
        w.startup["pods_running"] = time.monotonic() - t0
        print(f"kubelet node: {w.startup}")
        yield w
    finally:
        if node is not None:
            node.stop()
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        stack.stop()


def test_a_kubelet_runs_pods_networked_by_cilia_cni_and_a_cnp_applies(world: World) -> None:
    w = world
    # Running with the agent's addresses, as the kubelet reports them
    pool = w.stack.pool_cidr.rsplit(".", 2)[0]
    for role in ROLES:
        assert w.ips[role].startswith(pool + "."), (role, w.ips[role], w.stack.pool_cidr)
    listed = w.stack.agent.endpoint_list().stdout
    for role in ROLES:
        assert f"{w.namespace}/{w.names[role]}" in listed and w.ips[role] in listed, listed

    # identities from the Pod and Namespace labels (containerd sent none)
    identities = json.loads(w.kube.kubectl("get", "ciliumidentities", "-o", "json").stdout)
    label_sets = [i.get("security-labels", {}) for i in identities["items"]]
    for role in ROLES:
        wanted = {
            "k8s:app": role,
            "k8s:io.cilium.k8s.namespace.labels.team": "shop",
            "k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name": w.namespace,
            "k8s:io.cilium.k8s.policy.cluster": "default",
            "k8s:io.cilium.k8s.policy.serviceaccount": "default",
            "k8s:io.kubernetes.pod.namespace": w.namespace,
        }
        assert wanted in label_sets, (role, label_sets)
    ceps = json.loads(w.kube.kubectl("get", "ciliumendpoints", "-n", w.namespace,
                                     "-o", "json").stdout)["items"]  # fmt: skip
    assert {c["metadata"]["name"]: c["status"]["networking"]["addressing"][0]["ipv4"]
            for c in ceps} == {w.names[r]: w.ips[r] for r in ROLES}  # fmt: skip

    # real TCP between the pods; then the CNP admits only app=frontend
    assert w.reaches("other", "backend") and w.reaches("frontend", "backend")
    policy = traffic.backend_from_frontend("backend-from-frontend", w.namespace, PORT)
    w.node.kubectl("apply", "-f", "-", input=json.dumps(policy))
    assert host.wait_for(lambda: not w.reaches("other", "backend"), POLICY_WAIT_SECONDS), (
        "app=other still reaches the backend"
    )
    assert w.reaches("frontend", "backend")

    # a Pod deleted through the API: the kubelet stops its sandbox, CNI DEL reaches the agent
    other = w.names["other"]
    w.node.kubectl("delete", "pod", other, "-n", w.namespace, "--wait=false")

    def gone() -> bool:
        if other in w.stack.agent.endpoint_list().stdout:
            return False
        got = w.kube.kubectl("get", "ciliumendpoint", other, "-n", w.namespace, check=False)
        return got.returncode != 0 and "NotFound" in got.stderr

    assert host.wait_for(gone, TEARDOWN_WAIT_SECONDS), "the deleted pod's endpoint stayed"
    assert not os.path.exists(w.netns["other"]), "its network namespace stayed"


CHART = ROOT / "deploy" / "helm" / "cilia"
#: The chart's templates of the two workloads these tests reshape.
OPERATOR_DEPLOYMENT = "templates/operator/deployment.yaml"
AGENT_DAEMONSET = "templates/agent/daemonset.yaml"


def _helm() -> pathlib.Path:
    """The upstream helm scripts/helm-cli.sh built (version from tools/helm/go.mod); skips
    (fails in CI) when it is missing."""
    gomod = (ROOT / "tools" / "helm" / "go.mod").read_text()
    version = next(w.split()[-1] for w in gomod.splitlines() if "helm.sh/helm/v4 " in w)
    cache = pathlib.Path(
        os.environ.get("CILIA_CACHE_DIR") or pathlib.Path.home() / ".cache" / "cilia"
    )
    path = cache / "helm" / version / "bin" / "helm"
    if not os.access(path, os.X_OK):
        skips.require(f"{path} is missing: run scripts/helm-cli.sh (make test-setup builds it)")
    return path


def _render(template: str, directory: pathlib.Path) -> pathlib.Path:
    """One template of the chart rendered by the real helm (default values) into a file."""
    out = subprocess.run(
        [str(_helm()), "template", "cilia", str(CHART), "--namespace", "cilia-system",
         "--show-only", template],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    path = directory / template.replace("/", "_")
    path.write_text(out.stdout)
    return path


#: Seconds a rollout (kubectl rollout status) or the updater's replacement may take.
ROLLOUT_SECONDS = 120
#: The pod-template annotation the updater compares (cilia_safe_agent_updater.generation).
ANNOTATION = "safe-agent-updater-daemonset-generation"
#: The second name of the test image: what an overlay's image change points the agent at.
NEW_IMAGE = "cilia.test/testpod:2"


def _documents(kube: KubeAPI, path: pathlib.Path, kind: str) -> list[dict[str, Any]]:
    """The ``kind`` objects of a manifest file, as JSON (kubectl parses the YAML: the e2e
    environment has no YAML library)."""
    text = kube.kubectl("create", "--dry-run=client", "-o", "json", "-f", str(path)).stdout
    decoder, at = json.JSONDecoder(), 0
    items: list[dict[str, Any]] = []
    while text[at:].strip():  # one JSON object per document, back to back
        at += len(text[at:]) - len(text[at:].lstrip())
        item, at = decoder.raw_decode(text, at)
        items.extend(item["items"] if item.get("kind") == "List" else [item])
    return [i for i in items if i.get("kind") == kind]


def _operator_like(kube: KubeAPI, namespace: str) -> dict[str, Any]:
    """The chart's operator Deployment (rendered by helm) with what this node cannot run swapped out.

    Kept: replicas (2), the RollingUpdate strategy (maxSurge 0, maxUnavailable 1), the
    tolerations, the operator container's ports, env, resources, securityContext and its
    probes (readiness: gRPC health on 4251; liveness: TCP 4250) — served here by the test
    image (``testpod serve 4250 grpc:4251``). Swapped or dropped: the image and args, the
    TLS volume and the kube-rbac-proxy sidecar (no such image here), hostNetwork (both
    replicas share this one node, and a ``make up`` operator may hold 4250 on the host;
    pod networking is cilia-cni's instead), the required anti-affinity (one node) and the
    priority class."""
    [deployment] = _documents(kube, _render(OPERATOR_DEPLOYMENT, kube.workdir), "Deployment")
    deployment["metadata"]["namespace"] = namespace
    spec = deployment["spec"]["template"]["spec"]
    for key in ("hostNetwork", "dnsPolicy", "priorityClassName", "affinity", "volumes"):
        spec.pop(key, None)
    operator = spec["containers"][0]
    operator.pop("volumeMounts", None)
    operator.update(image=IMAGE, imagePullPolicy="Never", args=["serve", "4250", "grpc:4251"])
    spec["containers"] = [operator]
    result: dict[str, Any] = deployment
    return result


def _agent_like(kube: KubeAPI, namespace: str, generation: str) -> dict[str, Any]:
    """The chart's agent DaemonSet (rendered by helm) reduced to what the updater reads: its name,
    selector, OnDelete strategy, tolerations and the generation annotation, with one
    container of the test image (Ready once it answers TCP)."""
    [source] = _documents(kube, _render(AGENT_DAEMONSET, kube.workdir), "DaemonSet")
    template = source["spec"]["template"]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": source["metadata"]["name"], "namespace": namespace},
        "spec": {
            "selector": source["spec"]["selector"],
            "updateStrategy": source["spec"]["updateStrategy"],
            "template": {
                "metadata": {
                    "labels": template["metadata"]["labels"],
                    "annotations": {ANNOTATION: generation},
                },
                "spec": {
                    "tolerations": template["spec"]["tolerations"],
                    "terminationGracePeriodSeconds": 2,
                    "containers": [
                        {
                            "name": "cilia-agent",
                            "image": IMAGE,
                            "imagePullPolicy": "Never",
                            "args": ["serve", "9876"],
                            "readinessProbe": {"tcpSocket": {"port": 9876}, "periodSeconds": 1},
                        }
                    ],
                },
            },
        },
    }


def _agent_pods(w: World, namespace: str, selector: str) -> list[dict[str, Any]]:
    out = w.kube.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
    pods: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def test_an_operator_shaped_deployment_rolls_and_the_updater_rolls_a_changed_agent(
    world: World,
) -> None:
    """With kube-controller-manager and kube-scheduler, on the real node: the operator's
    Deployment (2 replicas, maxSurge 0, maxUnavailable 1, gRPC readiness) completes a
    rollout; an agent DaemonSet whose image an overlay changed (OnDelete: nothing happens
    by itself) is rolled on this node by the safe-agent-updater (kubernetes mode): the
    DaemonSet controller and the kubelet make the replacement, Running the new image."""
    w = world
    kube = w.kube
    skips.require(binary_missing("kube-controller-manager", kube.bin_dir))
    skips.require(binary_missing("kube-scheduler", kube.bin_dir))
    namespace = unique_name("klroll")
    kube.kubectl("create", "namespace", namespace)
    w.node.prepare_namespace(namespace)
    w.node.kubectl("create", "serviceaccount", "cilia-operator", "-n", namespace)
    kube.controller_manager()
    w.node.start_scheduler()
    health_server: subprocess.Popen[str] | None = None
    try:
        # the operator's Deployment: created, Available, then a rollout that completes
        t0 = time.monotonic()
        w.node.kubectl("apply", "-f", "-", input=json.dumps(_operator_like(kube, namespace)))
        status = ("rollout", "status", "deployment/cilia-operator", "-n", namespace,
                  f"--timeout={ROLLOUT_SECONDS}s")  # fmt: skip
        w.node.kubectl(*status)
        first = {p["metadata"]["name"] for p in _agent_pods(w, namespace, "app=cilia-operator")}
        assert len(first) == 2
        w.node.kubectl("rollout", "restart", "deployment/cilia-operator", "-n", namespace)
        w.node.kubectl(*status)
        pods = _agent_pods(w, namespace, "app=cilia-operator")
        assert len(pods) == 2 and all(_ready(p) for p in pods), pods
        assert first.isdisjoint(p["metadata"]["name"] for p in pods), "not replaced"
        for pod in pods:  # on this node, networked by cilia-cni
            assert pod["spec"]["nodeName"] == w.node.node_name
            assert pod["status"]["podIP"] in w.stack.agent.endpoint_list().stdout
        rolled = time.monotonic() - t0

        # the agent DaemonSet (OnDelete) on this node, then an overlay changes its image
        t0 = time.monotonic()
        ds = _agent_like(kube, namespace, "a" * 64)
        selector = ",".join(f"{k}={v}" for k, v in ds["spec"]["selector"]["matchLabels"].items())
        w.node.kubectl("apply", "-f", "-", input=json.dumps(ds))

        def agent_ready() -> dict[str, Any] | None:
            pods = _agent_pods(w, namespace, selector)
            return pods[0] if len(pods) == 1 and _ready(pods[0]) else None

        assert host.wait_for(lambda: agent_ready() is not None, ROLLOUT_SECONDS)
        agent_up = time.monotonic() - t0
        old = agent_ready()
        assert old is not None
        ds["spec"]["template"]["spec"]["containers"][0]["image"] = NEW_IMAGE
        w.node.kubectl("apply", "-f", "-", input=json.dumps(ds))
        time.sleep(2.0)  # OnDelete: the DaemonSet controller leaves the running pod alone
        still = agent_ready()
        assert still is not None and still["metadata"]["uid"] == old["metadata"]["uid"]

        # the agent's gRPC health (step 9 of the updater): testpod's, on a port it binds
        health_server = subprocess.Popen(
            [str(kube.bin_dir / "testpod"), "serve", "grpc:0"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert health_server.stdout is not None
        line = health_server.stdout.readline()  # "grpc health on [::]:PORT"
        address = "127.0.0.1:" + line.strip().rsplit(":", 1)[-1]
        updater = subprocess.run(
            [str(VENV_BIN / "cilia-safe-agent-updater"), "--mode", "kubernetes",
             "--kubeconfig", str(kube.kubeconfig), "--namespace", namespace,
             "--node-name", w.node.node_name, "--agent-health-address", address,
             "--poll-interval", "0.5", "--pod-replace-attempts", "240",
             "--ready-attempts", "240", "--image-check-attempts", "120"],
            capture_output=True, text=True, timeout=ROLLOUT_SECONDS + 60, check=False,
        )  # fmt: skip
        assert updater.returncode == 0, updater.stdout + updater.stderr
        steps = [
            json.loads(x).get("step") for x in updater.stdout.splitlines() if x.startswith("{")
        ]
        steps += [
            json.loads(x).get("step") for x in updater.stderr.splitlines() if x.startswith("{")
        ]
        assert "AgentPodDeleted" in steps and "AgentUpdated" in steps, steps
        new = agent_ready()
        assert new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]
        assert new["spec"]["containers"][0]["image"] == NEW_IMAGE
        assert new["status"]["phase"] == "Running"
        assert (
            new["metadata"]["labels"]["controller-revision-hash"]
            != old["metadata"]["labels"]["controller-revision-hash"]
        )
        print(
            f"operator created + rolled: {rolled:.1f} s; agent DaemonSet pod Ready: "
            f"{agent_up:.1f} s; then replaced by the updater: {time.monotonic() - t0:.1f} s"
        )
    finally:
        if health_server is not None:
            health_server.kill()
            health_server.wait()
        kube.kubectl("delete", "deployment,daemonset", "--all", "-n", namespace, check=False)
        kube.stop_controller_manager()
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
