"""Where the operator's Kubernetes store finds the API server (issue 27: no kube-proxy, so no
ClusterIP), on the session's REAL kube-apiserver:

- in-cluster: env ``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT`` (the chart's
  ``k8sServiceHost``/``k8sServicePort``) with the pod's service-account token; the loader's
  token and CA file names are pointed at a temporary directory (the test cannot write
  ``/var/run/secrets``);
- ``--k8s-api-server`` replaces the server of a kubeconfig (whose own server is dead);
- ``--k8s-kubeconfig-path`` is the upstream name of ``--kubeconfig``.
"""

from __future__ import annotations

import asyncio
import json
import pathlib

import pytest
from kubernetes.aio.config import incluster_config

from cilia_operator.__main__ import build_parser
from cilia_operator.store.kubernetes import KubernetesStore
from cilia_testkit.kubeapi import KubeAPI, unique_name


def test_in_cluster_env_and_service_account_token_reach_the_api_server(
    kube_apiserver: KubeAPI, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube, name = kube_apiserver, unique_name("op-env")
    kube.kubectl("create", "serviceaccount", name, "-n", "default")
    kube.kubectl("create", "clusterrole", name, "--verb=list", "--resource=nodes")
    kube.kubectl("create", "clusterrolebinding", name, f"--clusterrole={name}",
                 f"--serviceaccount=default:{name}")  # fmt: skip
    try:
        (tmp_path / "token").write_text(
            kube.kubectl("create", "token", name, "-n", "default").stdout.strip()
        )
        (tmp_path / "ca.crt").write_bytes(kube.ca_file.read_bytes())
        monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
        monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))

        async def listed() -> str:
            store = KubernetesStore(request_timeout=5)
            try:
                await store.list("Node")
                return store.url
            finally:
                await store.close()

        assert asyncio.run(listed()) == f"https://127.0.0.1:{kube.port}"
        lists = [r for r in kube.requests("list", "nodes")
                 if r["user"]["username"] == f"system:serviceaccount:default:{name}"]  # fmt: skip
        assert lists, "the service account's token was not used"
    finally:
        kube.kubectl("delete", "clusterrolebinding,clusterrole", name, check=False)
        kube.kubectl("delete", "serviceaccount", name, "-n", "default", check=False)


def test_k8s_api_server_replaces_the_kubeconfigs_server(
    kube_apiserver: KubeAPI, tmp_path: pathlib.Path
) -> None:
    kube = kube_apiserver
    doc = json.loads(kube.kubeconfig.read_text())
    doc["clusters"][0]["cluster"]["server"] = "https://127.0.0.1:9"  # nothing listens
    dead = tmp_path / "dead.kubeconfig"
    dead.write_text(json.dumps(doc))
    args = build_parser().parse_args(
        ["serve", "--store", "kubernetes", "--k8s-kubeconfig-path", str(dead),
         "--k8s-api-server", kube.server]
    )  # fmt: skip
    assert (args.kubeconfig, args.k8s_api_server) == (str(dead), kube.server)

    async def listed() -> str:
        store = KubernetesStore(kubeconfig=str(dead), api_server=args.k8s_api_server,
                                request_timeout=5)  # fmt: skip
        try:
            await store.list("Node")
            return store.url
        finally:
            await store.close()

    assert asyncio.run(listed()) == kube.server
