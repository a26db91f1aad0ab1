"""The pure parts of a Kubernetes-mode ServiceCIDR migration (service/recreate.py)."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from cilia_operator.service import migration, model, recreate

Net = ipaddress.IPv4Network
Addr = ipaddress.IPv4Address


def service(ns: str, name: str, ip: str, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "uid": "u1", "resourceVersion": "7",
                         "creationTimestamp": "2026-12-07T00:00:00Z", **meta},
            "spec": {"clusterIP": ip, "clusterIPs": [ip], "type": "NodePort",
                     "selector": {"app": name},
                     "ports": [{"name": "http", "port": 80, "nodePort": 30080}]},
            "status": {"loadBalancer": {}}}  # fmt: skip


def cidr(name: str, net: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"cidrs": [net]}}


def test_recreated_keeps_name_labels_annotations_and_spec_with_the_new_ip_and_the_alias() -> None:
    old = service("shop", "web", "10.96.0.20", labels={"a": "b"},
                  annotations={"team": "x", recreate._LAST_APPLIED: "{}"})  # fmt: skip
    new = recreate.recreated(old, Addr("10.100.0.20"), {Addr("10.96.0.20"): "t0"})
    assert new["metadata"] == {
        "name": "web", "namespace": "shop", "labels": {"a": "b"},
        "annotations": {"team": "x", model.ALIAS_ANNOTATION: '{"10.96.0.20": "t0"}'},
    }  # fmt: skip
    assert new["spec"]["clusterIP"] == "10.100.0.20" and new["spec"]["clusterIPs"] == [
        "10.100.0.20"
    ]
    assert new["spec"]["ports"] == old["spec"]["ports"] and "status" not in new
    assert old["spec"]["clusterIP"] == "10.96.0.20"  # the input is not changed


def test_copies_have_no_owner_the_migration_manager_and_the_old_address() -> None:
    original = {
        "metadata": {"name": "web-x1", "namespace": "shop",
                     "labels": {model.SERVICE_NAME_LABEL: "web",
                                model.MANAGED_BY_LABEL: "endpointslice-controller.k8s.io"},
                     "ownerReferences": [{"kind": "Service", "name": "web"}]},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
        "endpoints": [{"addresses": ["10.244.1.5"], "conditions": {"ready": True}},
                      {"addresses": ["10.244.2.5"], "conditions": {"ready": False}}],
    }  # fmt: skip
    [copy] = recreate.copy_slices([original], Addr("10.96.0.20"))
    assert copy["metadata"]["name"] == "web-x1-cilia-migration"
    assert "ownerReferences" not in copy["metadata"]
    assert model.migration_slice(copy) and model.migrating_from(copy) == Addr("10.96.0.20")
    assert model.slice_service(copy) == ("shop", "web")
    assert recreate.ready_endpoints([copy]) == {"10.244.1.5"}
    assert recreate.copy_slices([copy], Addr("10.96.0.20")) == []  # never a copy of a copy


def test_the_plan_leaves_the_first_address_to_the_kubernetes_service() -> None:
    services = [service("default", "kubernetes", "10.96.0.1"),
                service("shop", "web", "10.96.0.40"),
                service("shop", "odd", "10.96.200.1")]  # fmt: skip
    plan, api = recreate.plan_k8s(services, [cidr("kubernetes", "10.96.0.0/16")],
                                  Net("10.100.0.0/24"), "new")  # fmt: skip
    assert api is not None and model.key_of(api) == ("default", "kubernetes")
    moves = {m.service: str(m.new) for m in plan.moves}
    assert moves == {"shop/odd": "10.100.0.2", "shop/web": "10.100.0.40"}  # .1 is kept free


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("10.244.0.0/16", "overlaps node n1 podCIDR 10.244.1.0/24"),
        ("192.168.50.0/28", "holds node n1's address 192.168.50.11"),
        ("172.16.0.0/24", "overlaps the node network 172.16.0.0/16"),
        ("10.245.0.0/24", "overlaps pod pool 'blue' 10.245.0.0/16"),
    ],
)
def test_a_target_over_pods_or_nodes_is_refused(target: str, reason: str) -> None:
    nodes = [{"metadata": {"name": "n1"}, "spec": {"podCIDRs": ["10.244.1.0/24"]},
              "status": {"addresses": [{"type": "InternalIP", "address": "192.168.50.11"},
                                       {"type": "Hostname", "address": "n1"}]}}]  # fmt: skip
    pools = [{"metadata": {"name": "blue"}, "spec": {"ipv4": {"cidrs": ["10.245.0.0/16"]}}}]
    with pytest.raises(migration.MigrationRefused, match=reason):
        recreate.check_target_k8s(Net(target), recreate.pod_ranges(nodes, [], pools),
                                  recreate.node_addresses(nodes), [Net("172.16.0.0/16")])  # fmt: skip
