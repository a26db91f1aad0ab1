"""The seed story (issue 30): a live three-node Kubernetes cluster without kube-proxy, Cilia
installed from its chart, changes its Service range from 10.96.0.0/16 to 10.100.0.0/16
while clients on every node send without pause -- and not one request fails.

Clients, one pod per node, started before the change (their ``KUBERNETES_SERVICE_HOST`` is
the old ``kubernetes`` address, their ``resolv.conf`` the old DNS address), each running
three loops in its network namespace:

- HTTP GET to a 3-replica Deployment behind a ClusterIP Service (the address resolved at
  the start: the old one, served as an alias after the move);
- DNS lookups (UDP) of that Service's name through the nameserver of the pod's resolv.conf;
- API calls (``GET /api`` with the pod's service-account token and CA) to
  ``$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`` from the pod's environment.

Steps: the dry run (nothing changes); bad input refused with nothing changed (the new range
over the pod CIDRs, over a node's address, over the old range); ``servicecidr migrate
--kubernetes`` started and killed (SIGKILL) after its first move; a second run while the
first one's lease is fresh, and a migration to another range, both refused; the resumed run
moves the rest and stops at the API server step; the control plane gets the new
``--service-cluster-ip-range`` (cilia_testkit.kind.servicerange: one API server restarted
behind a second one) and every kubelet the new ``clusterDNS``; ``--apiserver-updated``
moves ``default/kubernetes``; the clients stop (counts reported: 0 failed), pods that
still use an old address are restarted, the aliases go after the 20 s grace period and the
old ServiceCIDR is deleted. A Service created afterwards gets an address in the new range;
a new pod gets the new ``kubernetes`` and DNS addresses and uses both.

Marked ``long`` (about 6 minutes here): ``make seed-story`` runs it on a fresh cluster.
The CLI's rules without a cluster (refusals, re-creation, resume) are in
services/operator/tests (``make test``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cilia_testkit.kind import KindCluster
from cilia_testkit.kind.install import ensure_cilia_images, install
from cilia_testkit.kind.pods import container_pid, echo_pod, wait_pods_ready
from cilia_testkit.kind.servicerange import (
    set_cluster_dns,
    set_service_cluster_ip_range,
    stop_surge,
)

pytestmark = [pytest.mark.privileged, pytest.mark.long, pytest.mark.timeout(1800)]

OLD = "10.96.0.0/16"
NEW = "10.100.0.0/16"
GRACE = "20s"
NS = "seed"
ROOT = pathlib.Path(__file__).resolve().parents[2]
#: The operator's CLI from the worktree's venv (``make setup``; the k8s tox env installs no
#: service).
CLI = [str(ROOT / ".venv" / "bin" / "cilia-operator")]
STOP_FILE = "/tmp/cilia-seed-story-stop"


@pytest.fixture(scope="module")
def cluster(kind_cluster: Callable[..., KindCluster]) -> KindCluster:
    return kind_cluster(nodes=3, service_cidr=OLD)


@pytest.fixture(scope="module")
def installed(cluster: KindCluster) -> float:
    started = time.monotonic()
    install(cluster, images=ensure_cilia_images())
    # the images are tagged by version, shared by every worktree of this machine: make sure
    # the operator running is this code's (it holds Services re-created by a migration)
    pod = cluster.get("pods", "-n", "kube-system", "-l", "app=cilia-operator")["items"][0]
    cluster.kubectl("exec", "-n", "kube-system", pod["metadata"]["name"], "--", "python3", "-c",
                    "import cilia_operator.service.recreate")  # fmt: skip
    return time.monotonic() - started


def _operator_image(cluster: KindCluster) -> str:
    pods = cluster.get("pods", "-n", "kube-system", "-l", "app=cilia-operator")["items"]
    return str(pods[0]["spec"]["containers"][0]["image"])


@pytest.fixture(scope="module")
def workload(cluster: KindCluster, installed: float) -> dict[str, Any]:
    """Namespace ``seed``: Deployment ``web`` (3 replicas, a real HTTP server: Python's
    http.server in the operator image, already on every node) behind Service ``web``, and
    one client pod per node."""
    cluster.kubectl("create", "namespace", NS)
    image = _operator_image(cluster)
    items: list[dict[str, Any]] = [
        echo_pod(f"client-{i}", NS, n.name, app="client") for i, n in enumerate(cluster.nodes)
    ]
    items.append({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": NS},
        "spec": {
            "replicas": 3, "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{
                        "name": "web", "image": image, "imagePullPolicy": "IfNotPresent",
                        "command": ["python3", "-m", "http.server", "8080"],
                        "workingDir": "/tmp",
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                    }],
                },
            },
        },
    })  # fmt: skip
    items.append({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": NS, "labels": {"story": "seed"}},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080}]},
    })  # fmt: skip
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                          "items": items}))  # fmt: skip
    wait_pods_ready(cluster, NS, "app=client", len(cluster.nodes))
    wait_pods_ready(cluster, NS, "app=web", 3)
    return {"web": cluster.get("service", "-n", NS, "web")["spec"]["clusterIP"]}


# ------------------------------------------------------------------------------ clients


class Client:
    """The three loops of one client pod (module docstring), each a ``docker exec`` of
    ``nsenter -n`` into the pod's network namespace, in its own process group, until
    :data:`STOP_FILE` exists in the node. Each line: ``ok|fail <ms> <detail>``."""

    def __init__(self, cluster: KindCluster, pod: str, web_ip: str) -> None:
        node, pid = container_pid(cluster, NS, pod)
        self.name = pod
        self.node = cluster.node(node)
        root = f"/proc/{pid}/root"
        env = dict(
            kv.split("=", 1)
            for kv in cluster.exec(node, "cat", f"/proc/{pid}/environ").split("\0")
            if "=" in kv
        )
        self.api = f"{env['KUBERNETES_SERVICE_HOST']}:{env['KUBERNETES_SERVICE_PORT']}"
        resolv = cluster.exec(node, "cat", f"{root}/etc/resolv.conf")
        self.dns = next(ln.split()[1] for ln in resolv.splitlines() if ln.startswith("nameserver"))
        sa = f"{root}/var/run/secrets/kubernetes.io/serviceaccount"
        checks = {
            "http": f"c=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 2 http://{web_ip}/); "
                    '[ "$c" = 200 ]',
            "dns": f"a=$(dig +short +time=2 +tries=1 @{self.dns} web.{NS}.svc.cluster.local A); "
                   '[ -n "$a" ] && c=$(echo "$a" | head -1)',
            "api": f"c=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 3 --cacert {sa}/ca.crt "
                   f"-H \"Authorization: Bearer $(cat {sa}/token)\" https://{self.api}/api); "
                   '[ "$c" = 200 ]',
        }  # fmt: skip
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.out: dict[str, list[str]] = {}
        for kind, check in checks.items():
            script = (f"while [ ! -e {STOP_FILE} ]; do s=$(date +%s%N); c=; if {check}; then r=ok;"
                      f" else r=fail; fi; echo \"$r $(( ($(date +%s%N)-s)/1000000 )) $c $((s/1000000))\"; "
                      "sleep 0.2; done")  # fmt: skip
            proc = subprocess.Popen(
                ["docker", "exec", self.node.container_id or self.node.name, "nsenter", "-t",
                 str(pid), "-n", "--", "bash", "-c", script],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                start_new_session=True,
            )  # fmt: skip
            self.procs[kind], self.out[kind] = proc, []
            threading.Thread(target=self._read, args=(kind, proc), daemon=True).start()

    def _read(self, kind: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.out[kind].append(line.strip())

    def counts(self, kind: str) -> tuple[int, int, list[str]]:
        """(requests, failures, the failed lines) so far."""
        lines = [ln for ln in self.out[kind] if ln]
        failed = [ln for ln in lines if not ln.startswith("ok")]
        return len(lines), len(failed), failed

    def end(self) -> None:
        """Wait for the loops to see the stop file; then end their process groups."""
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def clients(cluster: KindCluster, workload: dict[str, Any]) -> Iterator[list[Client]]:
    for n in cluster.nodes:
        cluster.exec(n.name, "rm", "-f", STOP_FILE)
    made: list[Client] = []
    try:
        for i in range(len(cluster.nodes)):
            made.append(Client(cluster, f"client-{i}", workload["web"]))
        yield made
    finally:
        stop_clients(cluster, made)


def stop_clients(cluster: KindCluster, made: list[Client]) -> None:
    for n in cluster.nodes:
        cluster.exec(n.name, "touch", STOP_FILE, check=False)
    for c in made:
        c.end()


#: (wall-clock seconds, step) as the story goes: a failed request is reported with its step
MARKS: list[tuple[float, str]] = []


def mark(step: str) -> None:
    MARKS.append((time.time(), step))
    print(f"-- {time.strftime('%H:%M:%S')} {step}")


def step_of(line: str) -> str:
    """The step during which the request of ``line`` (``r ms code epoch_ms``) started."""
    try:
        when = int(line.split()[-1]) / 1000
    except (ValueError, IndexError):
        return "?"
    return next((step for t, step in reversed(MARKS) if t <= when), "before")


def report(made: list[Client], record_property: Any) -> dict[str, tuple[int, int]]:
    totals: dict[str, tuple[int, int]] = {}
    for kind in ("http", "dns", "api"):
        total = failed = 0
        for c in made:
            n, f, lines = c.counts(kind)
            total, failed = total + n, failed + f
            if f:
                print(
                    f"  {c.name} {kind}: {f} of {n} failed: "
                    + ", ".join(f"'{ln}' during '{step_of(ln)}'" for ln in lines)
                )
        totals[kind] = (total, failed)
        record_property(f"seed_{kind}_requests", total)
        record_property(f"seed_{kind}_failed", failed)
    print("\nseed story counts: " + "; ".join(
        f"{k.upper()} {t} requests, {f} failed" for k, (t, f) in totals.items()))  # fmt: skip
    return totals


# ------------------------------------------------------------------------------ the CLI


def cli(cluster: KindCluster, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    got = subprocess.run([*CLI, "servicecidr", *argv, "--kubernetes",
                          "--k8s-kubeconfig-path", str(cluster.kubeconfig)],
                         capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
    print(
        f"$ cilia-operator servicecidr {' '.join(argv)} --kubernetes -> {got.returncode}\n"
        f"{got.stdout}{got.stderr}"
    )
    return got


def snapshot(cluster: KindCluster) -> tuple[Any, Any]:
    cidrs = sorted((c["metadata"]["name"], c["spec"]["cidrs"], bool(c["metadata"].get(
        "deletionTimestamp"))) for c in cluster.get("servicecidrs")["items"])  # fmt: skip
    services = sorted((s["metadata"]["namespace"], s["metadata"]["name"], s["spec"].get("clusterIP"))
                      for s in cluster.get("services", "-A")["items"])  # fmt: skip
    return cidrs, services


def in_range(ip: str, cidr: str) -> bool:
    return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)


def test_service_range_changes_under_http_dns_and_api_clients_with_no_failure(
    cluster: KindCluster, workload: dict[str, Any], clients: list[Client], record_property: Any
) -> None:
    started = time.monotonic()
    time.sleep(5)
    assert all(in_range(c.api.split(":")[0], OLD) and in_range(c.dns, OLD) for c in clients)
    before = snapshot(cluster)

    # the plan, and bad input: one line each, nothing changed
    mark("dry run and refusals")
    plan = cli(cluster, "migrate", "--to", NEW, "--dry-run")
    assert plan.returncode == 0 and "dry run: nothing was changed" in plan.stdout
    assert re.search(r"kube-system/kube-dns +10\.96\.0\.10 -> 10\.100\.0\.10\n", plan.stdout)
    node_net = str(ipaddress.ip_network(f"{cluster.nodes[0].ip}/24", strict=False))
    for bad, why in [("10.244.0.0/16", "overlaps node"), (node_net, "holds node"),
                     ("10.96.128.0/17", "overlaps ServiceCIDR kubernetes")]:  # fmt: skip
        got = cli(cluster, "migrate", "--to", bad)
        assert got.returncode == 2, bad
        assert got.stderr.count("\n") == 1 and why in got.stderr, got.stderr
    assert snapshot(cluster) == before

    # started, killed after its first move
    mark("first run")
    proc = subprocess.Popen([*CLI, "servicecidr", "migrate", "--kubernetes", "--to", NEW,
                             "--alias-grace-period", GRACE, "--lease-duration", "10",
                             "--k8s-kubeconfig-path", str(cluster.kubeconfig)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            print("  first run:", line.rstrip())
            if line.startswith("moved "):
                break
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    mark("first run killed; second run and another range refused")
    second = cli(cluster, "migrate", "--to", NEW)
    assert second.returncode == 2 and "is running this migration" in second.stderr
    other = cli(cluster, "migrate", "--to", "10.101.0.0/16")
    assert other.returncode == 2 and f"a migration to {NEW} is Moving" in other.stderr
    time.sleep(10)
    mark("resumed run (moves)")
    resumed = cli(cluster, "migrate", "--to", NEW, "--alias-grace-period", GRACE)
    assert resumed.returncode == 0, resumed.stderr
    assert "taking over" in resumed.stdout and "--apiserver-updated" in resumed.stdout
    dns_ip = cluster.get("service", "-n", "kube-system", "kube-dns")["spec"]["clusterIP"]
    assert dns_ip == "10.100.0.10"
    assert in_range(cluster.get("service", "-n", NS, "web")["spec"]["clusterIP"], NEW)

    # the control plane and the kubelets (what no API can do: the runbook's steps)
    mark("API servers restarted with the new range")
    try:
        swap = set_service_cluster_ip_range(cluster, NEW)
    finally:
        stop_surge(cluster)
    print(f"API servers restarted with --service-cluster-ip-range={NEW}: {swap}")
    mark("kubelets' clusterDNS")
    for n in cluster.nodes:
        set_cluster_dns(cluster, n.name, dns_ip)
    mark("default/kubernetes moved")

    # default/kubernetes, then the clients stop and the aliases may go
    proc = subprocess.Popen([*CLI, "servicecidr", "migrate", "--kubernetes", "--to", NEW,
                             "--apiserver-updated", "--wait-timeout", "300",
                             "--k8s-kubeconfig-path", str(cluster.kubeconfig)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip())
            print("  last run:", line.rstrip())
            if line.startswith("moved default/kubernetes"):
                break
        assert any(ln.startswith("moved default/kubernetes") for ln in lines), lines
        mark("after the moves")
        time.sleep(5)
        stop_clients(cluster, clients)
        totals = report(clients, record_property)
        # pods that use an old address: the clients (deleted) and the kube-system
        # Deployments (CoreDNS, relay, UI) restarted to the new addresses
        cluster.kubectl("delete", "pod", "-n", NS, "-l", "app=client", "--wait=false")
        for dep in cluster.get("deployments", "-n", "kube-system")["items"]:
            name = dep["metadata"]["name"]
            if name != "cilia-operator":
                cluster.kubectl("rollout", "restart", "-n", "kube-system", f"deployment/{name}")
        for line in proc.stdout:
            lines.append(line.rstrip())
            print("  last run:", line.rstrip())
        assert proc.wait(timeout=360) == 0, lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        status = subprocess.run([*CLI, "servicecidr", "status", "--kubernetes",
                                 "--k8s-kubeconfig-path", str(cluster.kubeconfig)],
                                capture_output=True, text=True, check=False)  # fmt: skip
        print(status.stdout, status.stderr)
    # the end state
    cidrs = cluster.get("servicecidrs")["items"]
    assert not [c for c in cidrs if OLD in c["spec"]["cidrs"]], cidrs
    api_ip = cluster.get("service", "-n", "default", "kubernetes")["spec"]["clusterIP"]
    assert api_ip == "10.100.0.1"
    cluster.kubectl("create", "service", "clusterip", "after", "-n", NS, "--tcp=80:8080")
    assert in_range(cluster.get("service", "-n", NS, "after")["spec"]["clusterIP"], NEW)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(
        echo_pod("late", NS, cluster.nodes[1].name, app="late")))  # fmt: skip
    wait_pods_ready(cluster, NS, "app=late", 1)
    node, pid = container_pid(cluster, NS, "late")
    assert "KUBERNETES_SERVICE_HOST=10.100.0.1" in cluster.exec(node, "cat", f"/proc/{pid}/environ")
    resolv = cluster.exec(node, "cat", f"/proc/{pid}/root/etc/resolv.conf")
    assert "nameserver 10.100.0.10" in resolv
    sa = f"/proc/{pid}/root/var/run/secrets/kubernetes.io/serviceaccount"
    answer = cluster.exec(node, "nsenter", "-t", str(pid), "-n", "--", "dig", "+short",
                          "@10.100.0.10", f"web.{NS}.svc.cluster.local", "A")  # fmt: skip
    assert in_range(answer.split()[0], NEW), answer
    code = cluster.exec(node, "nsenter", "-t", str(pid), "-n", "--", "bash", "-c",
                        f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 --cacert {sa}/ca.crt "
                        f"-H \"Authorization: Bearer $(cat {sa}/token)\" https://10.100.0.1:443/api")  # fmt: skip
    assert code == "200"
    record_property("seed_story_seconds", round(time.monotonic() - started, 1))
    print(f"seed story: {time.monotonic() - started:.0f} s")
    # the counts last: a failed request does not hide the end state's checks
    for kind, (total, failed) in totals.items():
        assert total > 50, kind
        assert failed == 0, f"{kind}: {failed} of {total} failed"
