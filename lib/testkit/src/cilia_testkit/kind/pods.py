"""What tests do with pods of a kind-style cluster: wait for them, and run a command in a
pod's network namespace from its node (the test image has no shell: ``nsenter`` into the
namespace of the pod's first container, found through its node's containerd).
"""

from __future__ import annotations

import json
import time
from typing import Any

from cilia_testkit.kind.api import KindError
from cilia_testkit.kind.cluster import KindCluster

#: Seconds a pod may take to be Ready (sandbox, CNI ADD, image present, probes).
POD_READY_SECONDS = 120.0


def pod(cluster: KindCluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The Pod object, or None."""
    got = cluster.kubectl("get", "pod", "-n", namespace, name, "-o", "json", check=False)
    return json.loads(got.stdout) if got.returncode == 0 else None


def _ready(obj: dict[str, Any] | None) -> bool:
    conditions = ((obj or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def wait_pods_ready(
    cluster: KindCluster,
    namespace: str,
    selector: str,
    count: int,
    timeout: float = POD_READY_SECONDS,
) -> list[dict[str, Any]]:
    """The pods matching label ``selector`` once at least ``count`` of them are Ready with a
    pod IP (the Ready ones).

    Raises:
        KindError: not in ``timeout`` seconds (their phases and events in the message).
    """
    deadline = time.monotonic() + timeout
    items: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        got = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json",
                              check=False, timeout=15)  # fmt: skip
        if got.returncode == 0:
            items = json.loads(got.stdout)["items"]
            ready = [p for p in items if _ready(p) and p["status"].get("podIP")]
            if len(ready) >= count:
                return ready
        time.sleep(0.5)
    events = cluster.kubectl("get", "events", "-n", namespace, check=False).stdout[-3000:]
    phases = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in items}
    raise KindError(f"{count} pods {selector} not Ready in {timeout:g}s: {phases}\n{events}")


def container_pid(cluster: KindCluster, namespace: str, name: str) -> tuple[str, int]:
    """(node name, PID) of the pod's first running container, from
    ``ctr task ls`` in its node (PIDs are the node container's: use them there).

    Raises:
        KindError: the pod is not running or its task is not found.
    """
    obj = pod(cluster, namespace, name)
    statuses = ((obj or {}).get("status") or {}).get("containerStatuses") or []
    cid = next(
        (s.get("containerID", "") for s in statuses if (s.get("state") or {}).get("running")), ""
    )
    node = ((obj or {}).get("spec") or {}).get("nodeName", "")
    if not cid or not node:
        raise KindError(f"pod {namespace}/{name} has no running container")
    cid = cid.split("://", 1)[-1]
    for line in cluster.exec(node, "ctr", "-n", "k8s.io", "tasks", "ls").splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 2 and fields[0] == cid:
            return node, int(fields[1])
    raise KindError(f"no task {cid[:12]} of pod {namespace}/{name} on {node}")


def in_pod_netns(
    cluster: KindCluster,
    namespace: str,
    name: str,
    *argv: str,
    check: bool = True,
    timeout: float = 30.0,
) -> str:
    """Run ``argv`` (a program of the node image: bash, curl, dig, ip, ...) in the pod's
    network namespace on its node; its stdout.

    Raises:
        KindError: the pod is not running. DockerError: non-zero exit with ``check``.
    """
    node, pid = container_pid(cluster, namespace, name)
    return cluster.exec(node, "nsenter", "-t", str(pid), "-n", "--", *argv, check=check,
                        timeout=timeout)  # fmt: skip


def echo_pod(
    name: str, namespace: str, node: str, *, port: int = 8080, app: str = "echo"
) -> dict[str, Any]:
    """A Pod of the sandbox image (``testpod serve``) pinned to ``node``, labelled
    ``app=<app>``, answering every TCP connection on ``port`` with
    ``hello from <pod name> on <port>``; Ready once the port accepts."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": app}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "echo", "image": "cilia.test/testpod:1", "args": ["serve", str(port)],
                "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 1},
            }],
        },
    }  # fmt: skip
