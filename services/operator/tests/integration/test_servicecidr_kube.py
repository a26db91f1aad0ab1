"""``servicecidr migrate --kubernetes`` on a real kube-apiserver (a private one: the test
deletes its default ServiceCIDR; the tests run in file order, each on the state the one
before left): bad input refused with nothing changed, each Service
re-created in the new range with the same name, labels, selector and ports and its old
ClusterIP as alias, the copies of its EndpointSlices gone, the old ServiceCIDR terminating
with Cilia's finalizer; a second migration and a second run refused; a run interrupted
between a Service's delete and its create finished by the next; ``--apiserver-updated``
against an API server still on the old range refused with the kubernetes Service intact.

The traffic side (the operator's hold, the agents' aliases, 0 failed requests) is
tests/k8s/test_seed_story.py.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import json
from collections.abc import Iterator
from typing import Any

import pytest
from stores import CRD_DIR

from cilia_operator.cli import CommandError
from cilia_operator.cli.servicecidr_k8s import (
    LEASE_NAME,
    LEASE_NAMESPACE,
    RECORD_KINDS,
    K8sMigration,
)
from cilia_operator.cli.servicecidr_k8s_cmd import (
    servicecidr_migrate_k8s,
)
from cilia_operator.service import migration, model, recreate
from cilia_operator.store.kubernetes import KubernetesStore
from cilia_testkit import skips
from cilia_testkit.kubeapi import KubeAPI, binary_missing

TARGET = "10.100.0.0/16"


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAPI]:
    skips.require(binary_missing("etcd") or binary_missing("kube-apiserver"))
    api = KubeAPI(tmp_path_factory.mktemp("kubeapi-servicecidr"))
    api.start()
    try:
        api.install_crds(CRD_DIR)
        _apply(api, [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}},
            {"apiVersion": "v1", "kind": "Node",
             "metadata": {"name": "n1"}, "spec": {"podCIDRs": ["10.244.1.0/24"]}},
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "kube-dns", "namespace": "kube-system",
                          "labels": {"k8s-app": "kube-dns"}},
             "spec": {"clusterIP": "10.96.0.10", "selector": {"k8s-app": "kube-dns"},
                      "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                                {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}},
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "late", "namespace": "shop"},
             "spec": {"clusterIP": "10.96.0.77", "ports": [{"port": 81}]}},
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "web", "namespace": "shop", "labels": {"tier": "front"},
                          "annotations": {"team": "shop"}},
             "spec": {"type": "NodePort", "selector": {"app": "web"},
                      "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                 "nodePort": 30080}]}},
            # as kube-controller-manager mirrors the API server's Endpoints (none runs here)
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": "kubernetes", "namespace": "default",
                          "labels": {"kubernetes.io/service-name": "kubernetes",
                                     "endpointslice.kubernetes.io/managed-by": "test"}},
             "addressType": "IPv4", "ports": [{"name": "https", "port": 6443}],
             "endpoints": [{"addresses": ["192.168.50.11"]}]},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": "web-manual", "namespace": "shop",
                          "labels": {"kubernetes.io/service-name": "web",
                                     "endpointslice.kubernetes.io/managed-by": "test"}},
             "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
             "endpoints": [{"addresses": ["10.244.1.7"]}]},
        ])  # fmt: skip
        api.kubectl("patch", "node", "n1", "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"addresses": [
                        {"type": "InternalIP", "address": "192.168.50.11"}]}}))  # fmt: skip
        yield api
    finally:
        api.stop()


def _apply(api: KubeAPI, items: list[dict[str, Any]]) -> None:
    api.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                      "items": items}))  # fmt: skip


def _get(api: KubeAPI, *argv: str) -> Any:
    return json.loads(api.kubectl("get", *argv, "-o", "json").stdout)


def _snapshot(api: KubeAPI) -> Any:
    cidrs = [(c["metadata"]["name"], c["spec"]["cidrs"], c["metadata"].get("deletionTimestamp"))
             for c in _get(api, "servicecidrs")["items"]]  # fmt: skip
    services = [(s["metadata"]["name"], s["metadata"]["uid"], s["spec"].get("clusterIP"))
                for s in _get(api, "services", "-A")["items"]]  # fmt: skip
    return cidrs, services


def _run(api: KubeAPI, to: str, **kw: Any) -> str:
    out = io.StringIO()
    servicecidr_migrate_k8s(to, kw.pop("dry_run", False), kw.pop("grace", "1s"), out,
                            kubeconfig=str(api.kubeconfig), settle=0.05, endpoints_timeout=5,
                            **kw)  # fmt: skip
    return out.getvalue()


@pytest.mark.parametrize(
    ("to", "reason"),
    [
        ("10.244.0.0/16", "overlaps node n1 podCIDR 10.244.1.0/24"),
        ("192.168.50.0/24", "holds node n1's address 192.168.50.11"),
        ("10.96.128.0/17", "overlaps ServiceCIDR kubernetes 10.96.0.0/16"),
        ("127.0.0.0/16", "special-purpose range"),
        ("10.100.0.1/16", "is not an IPv4 CIDR"),
    ],
)
def test_a_bad_target_is_refused_in_one_line_with_nothing_changed(
    kube: KubeAPI, to: str, reason: str
) -> None:
    before = _snapshot(kube)
    with pytest.raises(CommandError) as caught:
        _run(kube, to)
    assert reason in str(caught.value) and "\n" not in str(caught.value)
    assert _snapshot(kube) == before


_WEB_BEFORE: dict[str, Any] = {}


def test_the_dry_run_prints_the_plan_and_changes_nothing(kube: KubeAPI) -> None:
    _WEB_BEFORE.update(_get(kube, "service", "-n", "shop", "web"))
    before = _snapshot(kube)
    text = _run(kube, TARGET, dry_run=True)
    assert "dry run: nothing was changed" in text
    assert "kube-system/kube-dns  10.96.0.10 -> 10.100.0.10" in text
    assert "default/kubernetes (10.96.0.1) belongs to kube-apiserver" in text
    assert _snapshot(kube) == before


def test_a_run_interrupted_between_delete_and_create_is_finished_by_the_next(
    kube: KubeAPI,
) -> None:
    """What a run killed right after deleting Service shop/late leaves: the record (phase
    Moving) with the entry and what to create, the Service gone. The next run creates it."""
    late = _get(kube, "service", "-n", "shop", "late")
    manifest = recreate.recreated(late, ipaddress.ip_address("10.100.0.77"),
                                  {ipaddress.ip_address("10.96.0.77"): ""})  # fmt: skip
    record = {
        "apiVersion": migration.API_VERSION, "kind": migration.KIND,
        "metadata": {"name": migration.NAME},
        "spec": {"to": TARGET, "serviceCIDRName": migration.default_cidr_name(
            ipaddress.ip_network(TARGET)), "aliasGracePeriodSeconds": 1},
        "status": {"phase": "Moving", "sources": ["kubernetes"], "services": {
            "shop/late": {"old": "10.96.0.77", "new": "10.100.0.77", "state": "recreating",
                          "manifest": manifest}}},
    }  # fmt: skip
    got = kube.kubectl("create", "-f", "-", input=json.dumps(record), check=False)
    assert got.returncode == 0, got.stderr
    kube.kubectl("delete", "service", "-n", "shop", "late")
    text = _run(kube, TARGET)
    assert "resuming the migration" in text
    assert "finishing shop/late, interrupted while it was re-created" in text
    moved = _get(kube, "service", "-n", "shop", "late")
    assert moved["spec"]["clusterIP"] == "10.100.0.77"
    assert set(model.alias_ips(moved)) == {ipaddress.ip_address("10.96.0.77")}


def test_services_are_recreated_in_the_new_range_and_a_second_migration_is_refused(
    kube: KubeAPI,
) -> None:
    old_web = _WEB_BEFORE
    record = _get(kube, "ciliaservicecidrmigrations", migration.NAME)
    assert record["status"]["services"]["kube-system/kube-dns"]["new"] == "10.100.0.10"
    assert "--apiserver-updated" in _run(kube, TARGET)
    web = _get(kube, "service", "-n", "shop", "web")
    assert web["metadata"]["uid"] != old_web["metadata"]["uid"]
    assert web["spec"]["clusterIP"].startswith("10.100.")
    assert web["metadata"]["labels"] == {"tier": "front"}
    assert web["metadata"]["annotations"]["team"] == "shop"
    assert web["spec"]["selector"] == old_web["spec"]["selector"]
    assert web["spec"]["ports"] == old_web["spec"]["ports"]  # nodePort 30080 kept
    assert set(model.alias_ips(web)) == {ipaddress.ip_address(old_web["spec"]["clusterIP"])}
    slices = _get(kube, "endpointslices", "-n", "shop")["items"]
    assert [s["metadata"]["name"] for s in slices] == ["web-manual"]  # copies gone
    old = _get(kube, "servicecidr", "kubernetes")
    assert old["metadata"].get("deletionTimestamp")
    assert recreate.ALIAS_FINALIZER in old["metadata"]["finalizers"]
    assert _get(kube, "servicecidr", migration.default_cidr_name(
        ipaddress.ip_network(TARGET)))["spec"]["cidrs"] == [TARGET]  # fmt: skip
    record = _get(kube, "ciliaservicecidrmigrations", migration.NAME)
    assert record["status"]["phase"] == "AwaitingAPIServer"
    assert record["status"]["services"]["shop/web"]["state"] == "moved"
    # a migration to another range while this one is unfinished
    before = _snapshot(kube)
    with pytest.raises(CommandError, match=f"a migration to {TARGET} is AwaitingAPIServer"):
        _run(kube, "10.101.0.0/16")
    assert _snapshot(kube) == before
    # kube-apiserver still runs with 10.96.0.0/16: it cannot re-create the kubernetes
    # Service (that ServiceCIDR is terminating); the command says so and the copies of its
    # EndpointSlices stay, so Cilia keeps serving the old address
    with pytest.raises(CommandError, match="an API server still on the old"):
        _run(kube, TARGET, apiserver_updated=True, apiserver_timeout=3)
    copies = [s for s in _get(kube, "endpointslices", "-n", "default")["items"]
              if model.migration_slice(s)]  # fmt: skip
    assert copies and copies[0]["metadata"]["annotations"][
        model.MIGRATING_FROM_ANNOTATION] == "10.96.0.1"  # fmt: skip
    # a run without --apiserver-updated stops at the same step again
    assert "--apiserver-updated" in _run(kube, TARGET)


def test_a_second_run_is_refused_while_the_first_holds_the_lease(kube: KubeAPI) -> None:
    async def hold() -> None:
        store = KubernetesStore(kubeconfig=str(kube.kubeconfig), kinds=RECORD_KINDS)
        try:
            first = K8sMigration(store, io.StringIO())
            first.identity = "elsewhere/1"
            await first.acquire()
        finally:
            await store.close()

    asyncio.run(hold())
    try:
        with pytest.raises(CommandError, match=r"another 'servicecidr migrate' \(elsewhere/1\)"):
            _run(kube, TARGET)
    finally:
        kube.kubectl("delete", "lease", "-n", LEASE_NAMESPACE, LEASE_NAME, check=False)
