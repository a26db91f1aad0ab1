"""The ``kube_apiserver`` fixture really serves: a real etcd + kube-apiserver answering the
official client (create, watch, optimistic concurrency) and kubectl, with TLS both ways."""

from __future__ import annotations

import ipaddress
import json
import pathlib
import ssl
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from cilia_testkit import kubeapi, skips
from cilia_testkit.kubeapi import KubeAPI, unique_name

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client, watch  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402


def test_namespace_configmap_watch_and_conflict(kube_apiserver: KubeAPI) -> None:
    ns = unique_name("testkit")
    with kube_apiserver.client() as api:
        core: Any = client.CoreV1Api(api)
        core.create_namespace({"metadata": {"name": ns, "labels": {"team": "cilia"}}})
        assert core.read_namespace(ns).metadata.labels["team"] == "cilia"

        w: Any = watch.Watch()  # type: ignore[no-untyped-call]
        stream = w.stream(core.list_namespaced_config_map, ns, timeout_seconds=20)
        created = core.create_namespaced_config_map(
            ns, {"metadata": {"name": "cm"}, "data": {"k": "v1"}}
        )
        seen = []
        for event in stream:
            seen.append((event["type"], event["object"].metadata.name))
            if event["object"].metadata.name == "cm":
                w.stop()
        assert ("ADDED", "cm") in seen

        # an update carrying a stale resourceVersion is refused with 409 Conflict
        fresh = core.patch_namespaced_config_map("cm", ns, {"data": {"k": "v2"}})
        assert fresh.metadata.resource_version != created.metadata.resource_version
        stale = created
        stale.data = {"k": "stale"}
        with pytest.raises(ApiException) as exc:
            core.replace_namespaced_config_map("cm", ns, stale)
        assert exc.value.status == 409
        assert core.read_namespaced_config_map("cm", ns).data == {"k": "v2"}

    # the audit log records every completed request, with its outcome
    codes = {
        verb: [e["responseStatus"]["code"] for e in kube_apiserver.requests(verb, "configmaps", ns)]
        for verb in ("create", "patch", "update")
    }
    assert codes == {"create": [201], "patch": [200], "update": [409]}


def test_tls_both_ways_and_kubectl(kube_apiserver: KubeAPI) -> None:
    assert kube_apiserver.server.startswith("https://127.0.0.1:")
    # the serving certificate verifies against the generated CA; without a client
    # certificate the request is anonymous and forbidden (RBAC, as in a cluster)
    anon = ssl.create_default_context(cafile=str(kube_apiserver.ca_file))
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(f"{kube_apiserver.server}/api/v1/namespaces", context=anon)
    assert exc.value.code in (401, 403)
    with urllib.request.urlopen(
        f"{kube_apiserver.server}/api/v1/namespaces/default", context=kube_apiserver.ssl_context()
    ) as resp:
        assert json.load(resp)["metadata"]["name"] == "default"

    out = kube_apiserver.kubectl("auth", "whoami", "-o", "json").stdout
    user = json.loads(out)["status"]["userInfo"]
    assert user["username"] == "cilia-test-admin"
    assert "system:masters" in user["groups"]


def test_missing_binary_reason_comes_from_the_build(tmp_path: pathlib.Path) -> None:
    assert kubeapi.binary_missing("etcd", tmp_path) is not None
    (tmp_path / "etcd.unavailable").write_text("cannot build etcd: `go build` failed: boom\n")
    assert kubeapi.binary_missing("etcd", tmp_path) == "cannot build etcd: `go build` failed: boom"
    with pytest.raises(FileNotFoundError, match="boom"):
        KubeAPI(tmp_path / "w", bin_dir=tmp_path).start()


def test_stop_reaps_everything_and_removes_its_directory() -> None:
    reason = kubeapi.binary_missing("etcd") or kubeapi.binary_missing("kube-apiserver")
    if reason:
        pytest.skip(reason)
    api = KubeAPI()
    with api:
        procs = list(api._procs.values())
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        workdir = api.workdir
        assert api._readyz() == "ok"
    assert all(p.returncode is not None for p in procs)
    assert not workdir.exists()


def test_controller_manager_allocates_node_pod_cidrs(kube_apiserver: KubeAPI) -> None:
    """kube-controller-manager with --allocate-node-cidrs gives a new Node a podCIDR of
    --cluster-cidr (what --ipam kubernetes reads)."""
    skips.require(kubeapi.binary_missing("kube-controller-manager"))
    name = unique_name("node")
    kube_apiserver.controller_manager(cluster_cidr="10.244.0.0/16", node_cidr_mask_size=24)
    try:
        with kube_apiserver.client() as api:
            core: Any = client.CoreV1Api(api)
            core.create_node({"metadata": {"name": name}})
            deadline = time.monotonic() + 60
            cidrs: list[str] = []
            while not cidrs and time.monotonic() < deadline:
                cidrs = core.read_node(name).spec.pod_cidrs or []
                time.sleep(0.2)
            core.delete_node(name)
    finally:
        kube_apiserver.stop_controller_manager()
    assert len(cidrs) == 1
    net = ipaddress.IPv4Network(cidrs[0])
    assert net.prefixlen == 24 and net.subnet_of(ipaddress.IPv4Network("10.244.0.0/16"))
