"""Cilia installed from its Helm chart on a kind-style cluster, as a platform team installs it.

Order of operations (:func:`install`):

1. the images: :func:`ensure_cilia_images` builds one image per service with
   ``scripts/images.py`` (the Docker engine's layer cache makes a rebuild of unchanged code a
   few seconds), :func:`~cilia_testkit.kind.thirdparty.ensure_kube_rbac_proxy_image` the
   metrics sidecar under upstream's name; :meth:`KindCluster.load_images` imports them into
   every node's containerd (no registry here; ``pullPolicy: IfNotPresent`` finds them);
2. ``helm install`` of ``deploy/helm/cilia`` with the upstream ``helm`` CLI
   (``scripts/helm-cli.sh``) and :func:`cluster_values`: the API server at the control-plane
   node's address (``k8sServiceHost``/``k8sServicePort``: there is no kube-proxy, so no
   ClusterIP works before the agents run), native routing with direct routes between the
   nodes (they share the Docker bridge), the cluster's pod CIDR as ``ipv4NativeRoutingCIDR``;
3. :func:`wait_ready`: every node's agent pod, the operator replicas, the relay and
   hubble-ui Ready, and every Node Ready (the kubelet reports NotReady until a CNI config
   exists: the agent writes it).

:func:`uninstall` runs ``helm uninstall`` and waits for the chart's post-delete cleanup
DaemonSet to finish on every node, then deletes it (helm does not wait for a DaemonSet hook;
deploy/README.md "Uninstall").
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

from cilia_testkit import ROOT
from cilia_testkit.kind.api import KindError
from cilia_testkit.kind.cluster import KindCluster
from cilia_testkit.kind.thirdparty import ensure_kube_rbac_proxy_image

CHART = ROOT / "deploy" / "helm" / "cilia"
#: The services whose images the chart runs (``cilia-<service>:<tag>``).
SERVICES = ("agent", "cni", "operator", "relay", "hubble-ui", "safe-agent-updater")
#: Seconds one helm command may take.
HELM_TIMEOUT = 180
#: Seconds an install (or a roll) may take until every Cilia pod is Ready.
READY_TIMEOUT = 300
#: Seconds building the images may take (a cold build of all six is ~3 min on 2 cores).
IMAGES_TIMEOUT = 1200


def helm_bin() -> pathlib.Path:
    """The upstream helm binary (``scripts/helm-cli.sh``, built once and cached).

    Raises:
        KindError: helm could not be built (the script's error in the message).
    """
    got = subprocess.run(
        [str(ROOT / "scripts" / "helm-cli.sh")], capture_output=True, text=True, check=False
    )
    path = pathlib.Path(got.stdout.strip())
    if got.returncode != 0 or not os.access(path, os.X_OK):
        raise KindError(f"helm is not available: {got.stderr.strip()[-500:]}")
    return path


def ensure_cilia_images(tag: str = "", *, label: str = "") -> list[str]:
    """Build ``cilia-<service>:<tag>`` for every service of :data:`SERVICES` (``tag`` ""
    = the version, the chart's default) and return the image names, the kube-rbac-proxy
    sidecar's included. ``label`` (e.g. ``"b"``) is stamped on the images as
    ``io.cilia.test`` so a second build of the same code has another image id (an upgrade
    test's "new" image).

    Raises:
        KindError: a build failed (the tail of its log in the message).
    """
    code = (
        "import sys; sys.path.insert(0, 'scripts'); import images\n"
        "tag, label = sys.argv[1], sys.argv[2]\n"
        "for svc in sys.argv[3:]:\n"
        "    images.build_service(svc, f'cilia-{svc}:{tag}' if tag else None, progress=None,\n"
        "                         extra_labels={'io.cilia.test': label} if label else None)\n"
    )
    python = ROOT / ".venv" / "bin" / "python"
    got = subprocess.run(
        [str(python if python.exists() else sys.executable), "-c", code, tag, label, *SERVICES],
        cwd=ROOT, capture_output=True, text=True, timeout=IMAGES_TIMEOUT, check=False,
    )  # fmt: skip
    if got.returncode != 0:
        raise KindError(f"building the Cilia images failed:\n{got.stderr[-3000:]}")
    version = tag or _chart_app_version()
    return [f"cilia-{svc}:{version}" for svc in SERVICES] + [ensure_kube_rbac_proxy_image()]


def _chart_app_version() -> str:
    for line in (CHART / "Chart.yaml").read_text().splitlines():
        if line.startswith("appVersion:"):
            return line.split(":", 1)[1].strip().strip('"')
    raise KindError(f"{CHART / 'Chart.yaml'} has no appVersion")


def cluster_values(cluster: KindCluster, **extra: Any) -> dict[str, Any]:
    """The values this cluster needs (see the module docstring), merged with ``extra``
    (top-level keys replace)."""
    host, port = cluster.api_server.rsplit(":", 1)
    values: dict[str, Any] = {
        "k8sServiceHost": host,
        "k8sServicePort": int(port),
        "kubeProxyReplacement": True,
        "routingMode": "native",
        "autoDirectNodeRoutes": True,
        "ipv4NativeRoutingCIDR": cluster.pod_cidr,
    }
    values.update(extra)
    return values


def helm(
    cluster: KindCluster, *args: str, values: Mapping[str, Any] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run ``helm ARGS`` against ``cluster`` (its admin kubeconfig, a private helm home);
    ``values`` go in as a values file (``-f``).

    Raises:
        KindError: helm failed and ``check`` (its stderr in the message).
    """
    with tempfile.TemporaryDirectory(prefix="cilia-helm.") as home:
        argv = [str(helm_bin()), *args, "--kubeconfig", str(cluster.kubeconfig)]
        if values is not None:
            vf = pathlib.Path(home) / "values.json"  # JSON is YAML
            vf.write_text(json.dumps(values))
            argv += ["-f", str(vf)]
        env = {**os.environ, "HELM_CONFIG_HOME": home, "HELM_CACHE_HOME": home,
               "HELM_DATA_HOME": home}  # fmt: skip
        got = subprocess.run(argv, capture_output=True, text=True, env=env,
                             timeout=HELM_TIMEOUT, check=False)  # fmt: skip
    if check and got.returncode != 0:
        raise KindError(f"helm {' '.join(args[:2])} failed: {got.stderr.strip()[-2000:]}")
    return got


def install(
    cluster: KindCluster,
    values: Mapping[str, Any] | None = None,
    *,
    images: Iterable[str] | None = None,
    namespace: str = "kube-system",
    release: str = "cilia",
) -> float:
    """Build and load the images (or load ``images``), ``helm install`` the chart and wait
    until every Cilia pod and Node is Ready; returns the seconds from ``helm install`` to
    Ready.

    Raises:
        KindError: a build, the install or the wait failed.
    """
    cluster.load_images(list(images) if images is not None else ensure_cilia_images())
    started = time.monotonic()
    helm(cluster, "install", release, str(CHART), "-n", namespace,
         values=values if values is not None else cluster_values(cluster))  # fmt: skip
    wait_ready(cluster, namespace)
    return time.monotonic() - started


def _pods(cluster: KindCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    got = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json",
                          check=False, timeout=20)  # fmt: skip
    return json.loads(got.stdout)["items"] if got.returncode == 0 else []


def _ready(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def not_ready(cluster: KindCluster, namespace: str = "kube-system") -> list[str]:
    """What is not Ready yet: one line per missing agent/operator/relay/hubble-ui pod or
    NotReady Node (empty = all Ready)."""
    nodes = cluster.get("nodes")["items"]
    missing = [f"node {n['metadata']['name']} NotReady" for n in nodes
               if not any(c["type"] == "Ready" and c["status"] == "True"
                          for c in n["status"].get("conditions", []))]  # fmt: skip
    agents = {p["spec"].get("nodeName") for p in _pods(cluster, namespace, "app=cilia-agent")
              if _ready(p)}  # fmt: skip
    missing += [f"agent on {n['metadata']['name']} not Ready" for n in nodes
                if n["metadata"]["name"] not in agents]  # fmt: skip
    for app, want in (("cilia-operator", 1), ("cilia-relay", 1), ("hubble-ui", 1)):
        have = sum(_ready(p) for p in _pods(cluster, namespace, f"app={app}"))
        if have < want:
            missing.append(f"{app}: {have} of {want} Ready")
    return missing


def wait_ready(
    cluster: KindCluster, namespace: str = "kube-system", timeout: float = READY_TIMEOUT
) -> None:
    """Wait until :func:`not_ready` is empty.

    Raises:
        KindError: not in ``timeout`` seconds (what is missing, and the pods, in the message).
    """
    deadline = time.monotonic() + timeout
    missing: list[str] = []
    while time.monotonic() < deadline:
        missing = not_ready(cluster, namespace)
        if not missing:
            return
        time.sleep(1)
    pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
    raise KindError(f"Cilia not Ready in {timeout:g} s: {missing}\n{pods}")


def uninstall(
    cluster: KindCluster,
    namespace: str = "kube-system",
    release: str = "cilia",
    timeout: float = READY_TIMEOUT,
) -> None:
    """``helm uninstall``, then wait for the post-delete ``cilia-node-cleanup`` DaemonSet to
    have run on every node (each pod Ready = its cleanup done), delete it, and wait until no
    pod of the release is left (they terminate with their grace periods).

    Raises:
        KindError: helm failed, or the cleanup did not finish in ``timeout`` seconds.
    """
    helm(cluster, "uninstall", release, "-n", namespace)
    deadline = time.monotonic() + timeout
    nodes = len(cluster.get("nodes")["items"])
    while True:
        done = [p for p in _pods(cluster, namespace, "app=cilia-node-cleanup") if _ready(p)]
        if len(done) >= nodes:
            break
        if time.monotonic() > deadline:
            pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout
            raise KindError(f"node cleanup not done on {nodes} nodes in {timeout:g} s\n{pods}")
        time.sleep(1)
    cluster.kubectl("delete", "daemonset", "-n", namespace, "cilia-node-cleanup", "--wait=true")
    # the release's pods (agents, operators, the cleanup's) terminate with their grace period
    while _pods(cluster, namespace, "app.kubernetes.io/part-of=cilia"):
        if time.monotonic() > deadline:
            pods = cluster.kubectl("get", "pods", "-n", namespace, "-o", "wide").stdout
            raise KindError(f"Cilia's pods still there {timeout:g} s after uninstall\n{pods}")
        time.sleep(1)
