"""The chart's life cycle with the real helm against a REAL kube-apiserver (the testkit's
``kube_apiserver``; no kubelet or controllers run, so pods never start — what is checked is
what helm and the API server do with the chart):

- ``helm install`` creates the release's objects; the certificates it generated
  (``hubble.tls.auto``, method helm) are in their Secrets;
- ``helm upgrade`` with an agent change keeps every certificate Secret byte for byte (the chart
  looks them up) and moves the agent's generation hash, on the agent and the updater alike;
- ``helm rollback`` brings the first generation back;
- bad values: ``helm install`` refused with the chart's one line, no release, no object;
- ``helm uninstall`` removes the workloads, keeps the CRDs (``helm.sh/resource-policy: keep``)
  and starts the post-delete node-cleanup DaemonSet.

The session's server is shared: the release goes into ``cilia-system`` (the namespace the
other deploy tests use) with ``--take-ownership`` for the cluster objects (CRDs, ClusterRoles)
another test may have applied first; what the others need they apply again themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helmrender import CHART, NAMESPACE, run_helm

from cilia_testkit.kubeapi import KubeAPI

ANNOTATION = "safe-agent-updater-daemonset-generation"
CERT_SECRETS = ("cilia-ca", "hubble-ca-secret", "cilia-operator-tls", "cilia-agent-tls",
                "hubble-server-certs", "hubble-relay-client-certs", "hubble-relay-server-certs",
                "hubble-ui-client-certs")  # fmt: skip


def _helm(helm: Path, kube: KubeAPI, *args: str) -> Any:
    return run_helm(helm, *args, "--kubeconfig", str(kube.kubeconfig), "--namespace", NAMESPACE)


def _get(kube: KubeAPI, kind: str, name: str, namespace: str | None = NAMESPACE) -> Any:
    ns = ["-n", namespace] if namespace else []
    out = kube.kubectl("get", kind, name, *ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def _generations(kube: KubeAPI) -> tuple[str, str]:
    agent = _get(kube, "daemonset", "cilia-agent")
    updater = _get(kube, "daemonset", "cilia-safe-agent-updater")
    return (agent["spec"]["template"]["metadata"]["annotations"][ANNOTATION],
            updater["spec"]["template"]["metadata"]["annotations"][ANNOTATION])  # fmt: skip


@pytest.fixture
def release(helm: Path, kube_apiserver: KubeAPI) -> Any:
    kube = kube_apiserver
    kube.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}))  # fmt: skip
    out = _helm(helm, kube, "install", "cilia", str(CHART), "--take-ownership")
    assert out.returncode == 0, out.stderr
    yield kube
    _helm(helm, kube, "uninstall", "cilia")
    kube.kubectl("delete", "daemonset", "cilia-node-cleanup", "-n", NAMESPACE,
                 "--ignore-not-found")  # fmt: skip


def test_install_upgrade_keeps_certificates_rollback_and_uninstall(
    helm: Path, release: KubeAPI
) -> None:
    kube = release
    secrets = {name: _get(kube, "secret", name) for name in CERT_SECRETS}
    assert all(secrets.values()), [n for n, s in secrets.items() if not s]
    assert set(secrets["hubble-server-certs"]["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    first, first_updater = _generations(kube)
    assert first == first_updater

    out = _helm(helm, kube, "upgrade", "cilia", str(CHART), "--set", "MTU=1450")
    assert out.returncode == 0, out.stderr
    for name, before in secrets.items():
        after = _get(kube, "secret", name)
        assert after["data"] == before["data"], f"{name} changed on upgrade"
    second, second_updater = _generations(kube)
    assert second == second_updater and second != first
    args = _get(kube, "daemonset", "cilia-agent")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert "--mtu=1450" in args

    out = _helm(helm, kube, "rollback", "cilia", "1")
    assert out.returncode == 0, out.stderr
    assert _generations(kube) == (first, first)
    for name, before in secrets.items():
        assert _get(kube, "secret", name)["data"] == before["data"], f"{name} changed on rollback"

    out = _helm(helm, kube, "uninstall", "cilia")
    assert out.returncode == 0, out.stderr
    for kind, name in (("daemonset", "cilia-agent"), ("deployment", "cilia-operator"),
                       ("secret", "cilia-operator-tls"), ("service", "cilia-operator")):  # fmt: skip
        assert _get(kube, kind, name) is None, f"{kind}/{name} left after uninstall"
    assert _get(kube, "crd", "ciliumnetworkpolicies.cilium.io", namespace=None), "CRD removed"
    cleanup = _get(kube, "daemonset", "cilia-node-cleanup")
    assert cleanup, "the post-delete node cleanup DaemonSet was not created"
    init = [c["name"] for c in cleanup["spec"]["template"]["spec"]["initContainers"]]
    assert init == ["clean-cilia-state", "remove-cni"]
    assert "--all-state" in cleanup["spec"]["template"]["spec"]["initContainers"][0]["args"]


def test_bad_values_install_nothing(helm: Path, kube_apiserver: KubeAPI) -> None:
    kube = kube_apiserver
    out = run_helm(helm, "install", "cilia-bad", str(CHART), "--kubeconfig", str(kube.kubeconfig),
                   "--namespace", "cilia-bad", "--create-namespace",
                   "--set", "kubeProxyReplacement=true")  # fmt: skip
    assert out.returncode != 0
    assert "kubeProxyReplacement=true needs k8sServiceHost" in out.stderr
    listed = run_helm(helm, "list", "-A", "-o", "json", "--kubeconfig", str(kube.kubeconfig))
    assert "cilia-bad" not in [r["name"] for r in json.loads(listed.stdout or "[]")]
    assert _get(kube, "namespace", "cilia-bad", namespace=None) is None
    assert kube.kubectl("get", "all", "-n", "cilia-bad", "-o", "name").stdout.strip() == ""
