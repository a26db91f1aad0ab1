"""Without kube-proxy the updater reaches the API server at ``k8sServiceHost:Port``: the chart
sets env ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT`` to them, and the updater's
in-cluster configuration (``kube.api_client(None, ...)``, the official client's loader) must
dial exactly that, with the pod's service-account token, never a ClusterIP.

Against the session's REAL kube-apiserver: a service account allowed to read DaemonSets in a
namespace of its own, its token and the cluster CA where the kubelet would mount them (the
loader's file names pointed at a temporary directory: the test cannot write
``/var/run/secrets``), the env naming the real server's loopback address.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
from kubernetes.config import incluster_config

from cilia_safe_agent_updater.kube import KubeAPI as UpdaterAPI
from cilia_safe_agent_updater.kube import api_client
from cilia_testkit.kubeapi import KubeAPI, unique_name


def _apply(kube: KubeAPI, doc: dict[str, Any]) -> None:
    out = kube.kubectl("apply", "-f", "-", input=json.dumps(doc), check=False)
    assert out.returncode == 0, out.stderr


def test_in_cluster_config_dials_the_kubernetes_service_env_with_the_pod_token(
    kube_apiserver: KubeAPI, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube, ns = kube_apiserver, unique_name("upd-env")
    _apply(kube, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    try:
        for doc in (
            {"apiVersion": "v1", "kind": "ServiceAccount",
             "metadata": {"name": "updater", "namespace": ns}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": "updater", "namespace": ns},
             "rules": [{"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": "updater", "namespace": ns},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                         "name": "updater"},
             "subjects": [{"kind": "ServiceAccount", "name": "updater", "namespace": ns}]},
            {"apiVersion": "apps/v1", "kind": "DaemonSet",
             "metadata": {"name": "cilia-agent", "namespace": ns},
             "spec": {"selector": {"matchLabels": {"app": "cilia-agent"}},
                      "template": {"metadata": {"labels": {"app": "cilia-agent"}},
                                   "spec": {"containers": [{"name": "a", "image": "x:1"}]}}}},
        ):  # fmt: skip
            _apply(kube, doc)
        token = kube.kubectl("create", "token", "updater", "-n", ns).stdout.strip()
        (tmp_path / "token").write_text(token)
        (tmp_path / "ca.crt").write_bytes(kube.ca_file.read_bytes())
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))
        monkeypatch.delenv("KUBECONFIG", raising=False)

        api = api_client(None, retries=0, backoff=0.0)
        try:
            assert api.configuration.host == f"https://127.0.0.1:{kube.port}"
            ds = UpdaterAPI(api, timeout=5).get_daemonset(ns, "cilia-agent")
        finally:
            api.close()
        assert ds["metadata"]["name"] == "cilia-agent"
        # it was the service account, not an admin, that read it
        reads = [
            r for r in kube.requests("get", "daemonsets", ns)
            if r["objectRef"].get("name") == "cilia-agent"
        ]  # fmt: skip
        assert reads and reads[-1]["user"]["username"] == f"system:serviceaccount:{ns}:updater"
    finally:
        kube.kubectl("delete", "namespace", ns, "--wait=false", check=False)
