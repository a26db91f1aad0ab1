"""Metrics behind RBAC, end to end with the real pieces: the REAL kube-rbac-proxy (built by
scripts/kube-rbac-proxy.sh at the release the manifests' image names) in front of a REAL
cilia-operator metrics endpoint on loopback, authenticating scrapers against the REAL test
kube-apiserver (the testkit's ``kube_apiserver``) with the RBAC objects of the chart
deploy/helm/cilia (rendered by the real helm into cilia-system) applied for real.

What is taken from the rendered manifests, not restated here: each sidecar's resource
attributes (ConfigMap ``cilia-kube-rbac-proxy``, keys ``agent.yaml``/``operator.yaml``), the
proxy's identity and its rights (ServiceAccount ``cilia-agent`` / ``cilia-operator`` bound to
ClusterRole ``cilia:kube-rbac-proxy``: the proxy here calls the API server with that account's
token, so a missing TokenReview/SubjectAccessReview right fails the test), the scraper's
rights (Role/RoleBinding ``cilia:prometheus-metrics`` → ServiceAccount
``cilia-metrics-scraper``), and the sidecar's ``--allow-paths``.

Outcomes, per sidecar (agent-style: daemonsets/prometheus-metrics ``cilia-agent``;
operator-style: deployments/prometheus-metrics ``cilia-operator``; both proxy the one operator
endpoint — what is checked is the authorization, not whose metrics they are):

- no token → 401; a token the API server does not know → 401;
- a ServiceAccount with no Role → 403;
- a ServiceAccount allowed only the *other* sidecar's subresource → 403 (the attributes are
  really those of the config file);
- the scraper's token → 200, and the body parses with ``prometheus_client.parser`` and holds
  an upstream-named operator metric (``cilium_operator_…``);
- a path other than ``/metrics`` → 404 even with the scraper's token.

kube-rbac-proxy binds ``--secure-listen-address=127.0.0.1:0`` but logs the configured
address, not the bound one: the bound port is read from the kernel (the process's listening
socket in ``/proc``).
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cilia_testkit import procs
from cilia_testkit.kubeapi import KubeAPI, unique_name
from cilia_testkit.redis import RedisServer
from cilia_testkit.stack import read_listeners

NAMESPACE = "cilia-system"
#: Seconds a process (operator, kube-rbac-proxy) may take to listen.
START_TIMEOUT = 60.0
#: Seconds one scrape may take (two API server reviews on a cold cache included).
SCRAPE_TIMEOUT = 20.0
#: Lifetime asked of the test tokens (TokenRequest's minimum is 10 minutes).
TOKEN_DURATION = "10m"
#: The metric family the operator exports whatever its state (upstream's name).
OPERATOR_METRIC = "cilium_operator_identities_allocated"


def _proxy_container(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["template"]["spec"]["containers"]
                if c["name"] == "kube-rbac-proxy")  # fmt: skip


def _find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for d in docs:
        if d["kind"] == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"{kind}/{name} not rendered")


def _apply(kube: KubeAPI, docs: list[dict[str, Any]]) -> None:
    out = kube.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs), check=False)
    assert out.returncode == 0, out.stderr


def _token(kube: KubeAPI, sa: str, namespace: str = NAMESPACE) -> str:
    """A TokenRequest token of ServiceAccount ``namespace/sa``."""
    out = kube.kubectl("create", "token", sa, "-n", namespace, f"--duration={TOKEN_DURATION}")
    return out.stdout.strip()


@pytest.fixture(scope="module")
def rbac(kube_apiserver: KubeAPI, rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The release namespace and the chart's RBAC objects applied for real (the same objects
    test_server_dry_run applies: apply is idempotent on the shared server)."""
    kinds = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    docs = [d for d in rendered if d["kind"] in kinds]
    _apply(kube_apiserver, [{"apiVersion": "v1", "kind": "Namespace",
                             "metadata": {"name": NAMESPACE}}])  # fmt: skip
    _apply(kube_apiserver, docs)
    return docs


@pytest.fixture(scope="module")
def operator_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real cilia-operator (redis store on a unix socket, plaintext gRPC on a loopback port
    0, metrics on 127.0.0.1:0); its metrics address ``127.0.0.1:PORT``."""
    workdir = tmp_path_factory.mktemp("operator")
    log = workdir / "operator.log"
    with RedisServer() as redis, log.open("wb") as out:
        argv = [str(Path(sys.executable).parent / "cilia-operator"), "serve",
                "--store", redis.url, "--listen", "127.0.0.1:0", "--disable-tls",
                "--prometheus-serve-addr", "127.0.0.1:0"]  # fmt: skip
        proc = procs.spawn(argv, stdout=out, stderr=subprocess.STDOUT, default_signals=True)
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while "metrics" not in (found := read_listeners(log)):
                assert proc.poll() is None, f"cilia-operator exited:\n{log.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"no metrics listener:\n{log.read_text()}"
                time.sleep(0.1)
            yield found["metrics"]
        finally:
            procs.stop(proc)


def _listening_port(pid: int) -> int | None:
    """The TCP port a process listens on, from the kernel: its socket inodes
    (``/proc/PID/fd``) matched against the LISTEN rows (state 0A) of ``/proc/PID/net/tcp``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:
            return int(fields[1].split(":")[1], 16)
    return None


class Proxy:
    """A running kube-rbac-proxy: ``url`` is ``https://127.0.0.1:PORT``."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path, url: str) -> None:
        self.proc, self.log, self.url = proc, log, url


@pytest.fixture(scope="module")
def proxies(
    kube_apiserver: KubeAPI,
    kube_rbac_proxy_bin: Path,
    rendered: list[dict[str, Any]],
    rbac: list[dict[str, Any]],
    operator_metrics: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Proxy]]:
    """One kube-rbac-proxy per sidecar of the manifests ("agent", "operator"), each with its
    ConfigMap file and its flags but listening on 127.0.0.1:0, proxying the operator's
    metrics, and calling the API server as its pod's ServiceAccount."""
    config = _find(rendered, "ConfigMap", "cilia-kube-rbac-proxy")["data"]
    started: list[subprocess.Popen[bytes]] = []
    out: dict[str, Proxy] = {}
    try:
        for name, kind, workload in (("agent", "DaemonSet", "cilia-agent"),
                                     ("operator", "Deployment", "cilia-operator")):  # fmt: skip
            pod = _find(rendered, kind, workload)
            workdir = tmp_path_factory.mktemp(f"krp-{name}")
            (workdir / "config.yaml").write_text(config[f"{name}.yaml"])
            sa = pod["spec"]["template"]["spec"]["serviceAccountName"]
            kubeconfig = workdir / "kubeconfig"
            kubeconfig.write_text(json.dumps({
                "apiVersion": "v1", "kind": "Config",
                "clusters": [{"name": "test", "cluster": {
                    "server": kube_apiserver.server,
                    "certificate-authority": str(kube_apiserver.ca_file)}}],
                "users": [{"name": sa, "user": {"token": _token(kube_apiserver, sa)}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": sa}}],
                "current-context": "test",
            }))  # fmt: skip
            # the manifest's flags, but the listen address, upstream, config file and the
            # API server are this test's
            kept = [a for a in _proxy_container(pod)["args"]
                    if not a.startswith(("--secure-listen-address=", "--upstream=",
                                         "--config-file="))]  # fmt: skip
            argv = [str(kube_rbac_proxy_bin), "--secure-listen-address=127.0.0.1:0",
                    f"--upstream=http://{operator_metrics}/",
                    f"--config-file={workdir / 'config.yaml'}",
                    f"--kubeconfig={kubeconfig}", *kept]  # fmt: skip
            log = workdir / "kube-rbac-proxy.log"
            with log.open("wb") as f:
                proc = procs.spawn(argv, stdout=f, stderr=subprocess.STDOUT)
            started.append(proc)
            deadline = time.monotonic() + START_TIMEOUT
            while (port := _listening_port(proc.pid)) is None:
                assert proc.poll() is None, f"kube-rbac-proxy exited:\n{log.read_text()}"
                assert time.monotonic() < deadline, (
                    f"kube-rbac-proxy not listening:\n{log.read_text()}"
                )
                time.sleep(0.1)
            out[name] = Proxy(proc, log, f"https://127.0.0.1:{port}")
        yield out
    finally:
        for proc in started:
            procs.stop(proc)


def _scrape(proxy: Proxy, token: str | None, path: str = "/metrics") -> tuple[int, str]:
    """GET ``path`` through the proxy (its self-signed certificate is not verified, as the
    monitors' ``insecureSkipVerify``); (status, body)."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    req = urllib.request.Request(proxy.url + path, headers=headers)
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=SCRAPE_TIMEOUT) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_scrapes_are_authorized_as_the_manifests_say(
    kube_apiserver: KubeAPI, proxies: dict[str, Proxy]
) -> None:
    kube = kube_apiserver
    scraper = _token(kube, "cilia-metrics-scraper")
    # a ServiceAccount of its own namespace, bound to nothing
    ns = unique_name("metrics-rbac")
    kube.kubectl("create", "namespace", ns)
    kube.kubectl("create", "serviceaccount", "nobody", "-n", ns)
    nobody = _token(kube, "nobody", ns)
    # a ServiceAccount allowed the agent's metrics only
    agent_only = unique_name("agent-only")
    kube.kubectl("create", "serviceaccount", agent_only, "-n", ns)
    kube.kubectl("create", "role", agent_only, "-n", NAMESPACE, "--verb=get",
                 "--resource=daemonsets.apps/prometheus-metrics",
                 "--resource-name=cilia-agent")  # fmt: skip
    kube.kubectl("create", "rolebinding", agent_only, "-n", NAMESPACE, f"--role={agent_only}",
                 f"--serviceaccount={ns}:{agent_only}")  # fmt: skip
    agent_token = _token(kube, agent_only, ns)
    try:
        for name, proxy in proxies.items():
            status, body = _scrape(proxy, None)
            assert status == 401, (name, status, body)
            status, body = _scrape(proxy, "not-a-token")
            assert status == 401, (name, status, body)
            status, body = _scrape(proxy, nobody)
            assert status == 403, (name, status, body)
            status, body = _scrape(proxy, agent_token)
            assert status == (200 if name == "agent" else 403), (name, status, body)
            status, body = _scrape(proxy, scraper, "/debug")
            assert status == 404, (name, status, body)
            status, body = _scrape(proxy, scraper)
            assert status == 200, (name, status, body, proxy.log.read_text()[-2000:])
            families = {f.name: f for f in text_string_to_metric_families(body)}
            assert OPERATOR_METRIC in families, (name, sorted(families))
            assert families[OPERATOR_METRIC].type == "counter"
    finally:
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        kube.kubectl("delete", "role,rolebinding", agent_only, "-n", NAMESPACE, check=False)
    # each decision was the API server's: the proxies' accounts asked it
    reviews = kube.requests("create", "subjectaccessreviews")
    users = {r["user"]["username"] for r in reviews}
    for sa in ("cilia-agent", "cilia-operator"):
        assert f"system:serviceaccount:{NAMESPACE}:{sa}" in users, users
