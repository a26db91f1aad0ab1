"""Service validation, allocation on a snapshot, the EndpointSlice shape and the join into
``Service`` messages (pure: no store)."""

from __future__ import annotations

import ipaddress
import random
from typing import Any

import pytest

from cilia_operator.controlplane.service import ServiceJoin, service_message
from cilia_operator.controlplane.streams import Changed, Listed
from cilia_operator.errors import InvalidResource
from cilia_operator.service import allocation, model
from cilia_operator.service.controller import desired_slices, endpoint_labels
from cilia_operator.store import ListResult, WatchEvent


def svc(name: str = "web", **spec: Any) -> dict[str, Any]:
    spec.setdefault("ports", [{"port": 80}])
    spec.setdefault("selector", {"app": name})
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default"}, "spec": spec}  # fmt: skip


def reasons(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(InvalidResource) as caught:
        model.validate_service(doc)
    return [str(e) for e in caught.value.errors]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"ports": [{"port": 0}]}, "spec.ports[0].port: 0 is out of range: must be 1-65535"),
        ({"ports": [{"port": 70000}]}, "spec.ports[0].port: 70000 is out of range"),
        ({"ports": [{"port": "80"}]}, "spec.ports[0].port: '80' is not an integer"),
        ({"ports": [{"port": 53, "protocol": "SCTP"}]}, "SCTP is not supported"),
        ({"ports": [{"port": 53, "protocol": "ICMP"}]}, "'ICMP': must be TCP or UDP"),
        ({"ports": [{"port": 80}, {"port": 81}]}, "spec.ports[0].name: required"),
        ({"ports": [{"name": "a", "port": 80}, {"name": "a", "port": 81}]}, "duplicate"),
        ({"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 80}]},
         "spec.ports[1]: duplicate port 80/TCP: same as spec.ports[0]"),
        ({"ports": [{"port": 80, "targetPort": "Not_A_Name"}]}, "is not a port name"),
        ({"ports": [{"port": 80, "targetPort": 0x10000}]}, "targetPort: 65536 is out of range"),
        ({"ports": [{"port": 80, "nodePort": 30001}]}, "only for type NodePort or LoadBalancer"),
        ({"ports": []}, "spec.ports: required"),
        ({"clusterIP": "fd00::1"}, "is not an IPv4 address"),
        ({"clusterIP": "10.96.0.5", "clusterIPs": ["10.96.0.6"]}, "must equal spec.clusterIP"),
        ({"type": "Foo"}, "spec.type: 'Foo'"),
        ({"sessionAffinity": "Cookie"}, "must be None or ClientIP"),
        ({"sessionAffinity": "ClientIP",
          "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86401}}}, "1-86400"),
        ({"externalTrafficPolicy": "Local"}, "only for type NodePort or LoadBalancer"),
        # found by a new user's try: accepted before
        ({"type": "ExternalName", "externalName": "example.com", "clusterIP": "10.96.0.50"},
         "spec.clusterIP: must not be set for type ExternalName"),
        ({"type": "ExternalName", "externalName": "not a name!"}, "is not a DNS-1123 subdomain"),
        ({"clusterIP": "127.0.0.5"}, "special-purpose range (loopback 127.0.0.0/8)"),
        ({"clusterIP": "224.0.0.1"}, "special-purpose range (multicast 224.0.0.0/4)"),
    ],
)  # fmt: skip
def test_invalid_services_are_refused_with_path_and_reason(
    spec: dict[str, Any], expected: str
) -> None:
    assert any(expected in r for r in reasons(svc(**spec))), reasons(svc(**spec))


def test_valid_services_pass() -> None:
    model.validate_service(svc(ports=[{"name": "dns", "port": 53, "protocol": "UDP",
                                       "targetPort": "dns"}]))  # fmt: skip
    model.validate_service(svc(type="NodePort", ports=[{"port": 80, "nodePort": 30080}]))
    model.validate_service(svc(clusterIP="None"))
    model.validate_service({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
                            "spec": {"type": "ExternalName", "externalName": "a.example"}})  # fmt: skip
    assert reasons({"metadata": {"name": "1bad"}, "spec": {"ports": [{"port": 1}]}}) == [
        "metadata.name: '1bad' is not a DNS-1035 label (a lower-case letter first, then "
        "letters, digits and '-', at most 63 characters)"
    ]


def snapshot(*objs: dict[str, Any]) -> dict[str, ListResult]:
    out: dict[str, ListResult] = {}
    for obj in objs:
        out.setdefault(obj["kind"], ListResult([], "1")).items.append(obj)
    return out


def doc(obj: dict[str, Any], index: int = 0) -> allocation.ServiceDoc:
    meta = obj["metadata"]
    return allocation.ServiceDoc(index, obj["kind"], meta.get("namespace", ""), meta["name"], obj)


def test_allocation_fills_a_range_then_moves_on_and_names_the_holder() -> None:
    settings = allocation.ServiceSettings(service_cidrs=(ipaddress.IPv4Network("10.0.0.0/30"),))
    extra = {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
             "metadata": {"name": "b"}, "spec": {"cidrs": ["10.1.0.0/30"]}}  # fmt: skip
    held = svc("a", clusterIP="10.0.0.1")
    new = [svc("b"), svc("c")]
    docs = [doc(o, i) for i, o in enumerate(new)]
    errors = allocation.prepare(docs, snapshot(held, extra), settings, rng=random.Random(1))
    assert errors == []
    assert [o["spec"]["clusterIP"] for o in new] == ["10.0.0.2", "10.1.0.1"]
    clash = svc("d", clusterIP="10.1.0.1")
    errors = allocation.prepare([doc(clash)], snapshot(held, extra, new[1]), settings)
    assert [str(e) for _, e in errors] == [
        "spec.clusterIP: 10.1.0.1 is already allocated to Service default/c"
    ]


def test_a_service_cidr_overlapping_a_pool_is_refused_naming_both() -> None:
    cidr = {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": "extra"}, "spec": {"cidrs": ["10.2.0.0/16"]}}  # fmt: skip
    pools = [allocation.PoolRanges("blue", (ipaddress.IPv4Network("10.2.3.0/24"),))]
    settings = allocation.ServiceSettings(pod_cidrs=(ipaddress.IPv4Network("10.2.128.0/17"),))
    errors = [str(e) for _, e in allocation.prepare([doc(cidr)], {}, settings, pools)]
    assert errors == [
        "spec.cidrs[0]: ServiceCIDR 'extra' 10.2.0.0/16 overlaps pod pool 'blue' CIDR "
        "10.2.3.0/24 (CiliumPodIPPool)",
        "spec.cidrs[0]: ServiceCIDR 'extra' 10.2.0.0/16 overlaps the cluster-pool pod CIDR "
        "10.2.128.0/17 (--cluster-pool-ipv4-cidr)",
    ]


def cep(name: str, ip: str, labels: list[str], ns: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2", "kind": "CiliumEndpoint",
        "metadata": {"name": name, "namespace": ns},
        "status": {"identity": {"id": 300, "labels": labels},
                   "networking": {"addressing": [{"ipv4": ip}], "node-name": "n1"}},
    }  # fmt: skip


def test_endpoint_slices_select_by_k8s_labels_and_skip_named_ports() -> None:
    assert endpoint_labels(cep("a", "10.0.0.1", ["k8s:app=web", "reserved:x", "k8s:t="])) == {
        "app": "web", "t": ""
    }  # fmt: skip
    service = svc(ports=[{"name": "http", "port": 80, "targetPort": 8080},
                         {"name": "named", "port": 81, "targetPort": "metrics"}])  # fmt: skip
    endpoints = [
        cep("a", "10.0.0.9", ["k8s:app=web"]),
        cep("b", "10.0.0.10", ["k8s:app=web", "k8s:extra=1"]),
        cep("c", "10.0.0.11", ["k8s:app=other"]),
        cep("d", "10.0.0.12", ["k8s:app=web"], ns="elsewhere"),
        cep("e", "10.0.0.13", ["container:app=web"]),
    ]
    slices = desired_slices(service, endpoints, max_per_slice=1)
    assert sorted(slices) == ["web-0", "web-1"]
    assert [s["endpoints"][0]["addresses"] for s in slices.values()] == [["10.0.0.9"],
                                                                       ["10.0.0.10"]]  # fmt: skip
    assert slices["web-0"]["ports"] == [{"name": "http", "port": 8080, "protocol": "TCP"}]
    assert desired_slices(svc(selector={}), endpoints, 100) == {}


def endpoint_slice(name: str, service: str, ports: list[dict[str, Any]],
                   endpoints: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default",
                     "labels": {model.SERVICE_NAME_LABEL: service}},
        "addressType": "IPv4", "ports": ports, "endpoints": endpoints,
    }  # fmt: skip


def test_service_message_joins_ports_by_name_and_protocol_with_condition_defaults() -> None:
    service = svc(clusterIP="10.96.0.10", clusterIPs=["10.96.0.10"], type="NodePort",
                  ports=[{"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053},
                         {"name": "dns-tcp", "port": 53, "protocol": "TCP"}])  # fmt: skip
    slices = [
        endpoint_slice("a", "web",
                       [{"name": "dns", "port": 5353, "protocol": "UDP"},
                        {"name": "dns-tcp", "port": 5354, "protocol": "TCP"}],
                       [{"addresses": ["10.0.0.2"]},
                        {"addresses": ["10.0.0.1"], "conditions": {"ready": False,
                                                                  "terminating": True}}]),
        endpoint_slice("b", "web", [{"name": "dns", "port": 5353, "protocol": "UDP"}],
                       [{"addresses": ["10.0.0.2"]}]),
    ]  # fmt: skip
    message = service_message(service, slices)
    assert message is not None
    assert (message.type, list(message.cluster_ips), message.ports[0].node_port) == (
        "NodePort", ["10.96.0.10"], 30053,
    )  # fmt: skip
    udp = [(b.ip, b.port, b.ready, b.serving, b.terminating) for b in message.ports[0].backends]
    assert udp == [("10.0.0.1", 5353, False, False, True), ("10.0.0.2", 5353, True, True, False)]
    assert [(b.ip, b.port) for b in message.ports[1].backends] == [("10.0.0.1", 5354),
                                                                  ("10.0.0.2", 5354)]  # fmt: skip
    assert service_message(svc(clusterIP="None"), []) is None
    assert service_message(svc(), []) is None  # no ClusterIP yet


def test_join_resends_a_service_when_its_slice_changes_and_deletes_headless_ones() -> None:
    join = ServiceJoin()
    service = svc(clusterIP="10.96.0.10")
    assert join.apply(Listed("Service", [service], False)) != []
    assert join.apply(Listed("EndpointSlice", [], True)) == []
    one = endpoint_slice("a", "web", [{"name": "", "port": 8080, "protocol": "TCP"}],
                         [{"addresses": ["10.0.0.1"]}])  # fmt: skip
    [(key, message)] = join.apply(Changed("EndpointSlice", WatchEvent("ADDED", one, "2")))
    assert key == ("default", "web") and message is not None
    assert [b.ip for b in message.ports[0].backends] == ["10.0.0.1"]
    # the same slice again: nothing to send
    assert join.apply(Changed("EndpointSlice", WatchEvent("MODIFIED", one, "3"))) == []
    headless = svc(clusterIP="None")
    assert join.apply(Changed("Service", WatchEvent("MODIFIED", headless, "4"))) == [
        (("default", "web"), None)
    ]


@pytest.mark.parametrize("cidr", ["127.0.0.0/24", "0.0.0.0/0", "169.254.0.0/24", "240.0.0.0/8"])
def test_a_service_cidr_in_a_special_purpose_range_is_refused(cidr: str) -> None:
    doc = {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
           "metadata": {"name": "odd"}, "spec": {"cidrs": [cidr]}}  # fmt: skip
    with pytest.raises(InvalidResource, match="special-purpose range"):
        model.validate_service_cidr(doc)


def test_an_external_name_service_with_a_valid_name_and_no_address_passes() -> None:
    model.validate_service(svc(type="ExternalName", externalName="db.example.com.", ports=[]))


def test_a_service_of_20000_ports_joins_each_port_to_its_slice_port() -> None:
    """A new user's try: 20,000 ports made the join quadratic and stalled the operator for
    minutes (the env's pytest-timeout ends such a run); each port still finds its slice port."""
    n = 20_000
    service = svc(ports=[{"name": f"p{i}", "port": i + 1} for i in range(n)],
                  clusterIP="10.96.0.9")  # fmt: skip
    slice_ = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
              "metadata": {"name": "web-1", "namespace": "default",
                           "labels": {"kubernetes.io/service-name": "web"}},
              "addressType": "IPv4",
              "ports": [{"name": f"p{i}", "port": 10_000 + i % 50_000, "protocol": "TCP"}
                        for i in range(n)],
              "endpoints": [{"addresses": ["10.0.0.1"]}]}  # fmt: skip
    message = service_message(service, [slice_])
    assert message is not None and len(message.ports) == n
    assert message.ports[-1].backends[0].port == 10_000 + (n - 1)


def test_a_service_recreated_by_a_migration_is_never_deleted_and_keeps_its_old_ip_as_alias() -> (
    None
):
    """Kubernetes-mode migration: with a migration copy of its slice present, the Service's
    DELETE is held (no event: the agents keep the old ClusterIP and backends), the
    re-created Service carries the old ClusterIP as alias, and once the copy goes the alias
    goes with it (the migration has written the annotation by then)."""
    join = ServiceJoin()
    old = svc(clusterIP="10.96.0.10")
    port = [{"name": "", "port": 8080, "protocol": "TCP"}]
    join.apply(Listed("Service", [old], False))
    join.apply(Listed("EndpointSlice", [endpoint_slice("web-1", "web", port,
                                                       [{"addresses": ["10.0.0.1"]}])], True))  # fmt: skip
    copy = endpoint_slice("web-mig-0", "web", port, [{"addresses": ["10.0.0.1"]}])
    copy["metadata"]["labels"][model.MANAGED_BY_LABEL] = model.MIGRATION_MANAGED_BY
    copy["metadata"]["annotations"] = {model.MIGRATING_FROM_ANNOTATION: "10.96.0.10"}
    join.apply(Changed("EndpointSlice", WatchEvent("ADDED", copy, "5")))
    assert join.apply(Changed("Service", WatchEvent("DELETED", old, "6"))) == []
    gone = endpoint_slice("web-1", "web", port, [{"addresses": ["10.0.0.1"]}])
    assert join.apply(Changed("EndpointSlice", WatchEvent("DELETED", gone, "7"))) == []
    new = svc(clusterIP="10.100.0.10")
    [(_, message)] = join.apply(Changed("Service", WatchEvent("ADDED", new, "8")))
    assert message is not None
    assert list(message.cluster_ips) == ["10.100.0.10"]
    assert list(message.alias_ips) == ["10.96.0.10"]
    assert [b.ip for b in message.ports[0].backends] == ["10.0.0.1"]
    [(_, message)] = join.apply(Changed("EndpointSlice", WatchEvent("DELETED", copy, "9")))
    assert message is not None and list(message.alias_ips) == []
    # without a copy, a DELETE is sent at once
    assert join.apply(Changed("Service", WatchEvent("DELETED", new, "10"))) == [
        (("default", "web"), None)
    ]


def test_a_migrating_service_is_held_even_when_the_slice_watch_lags() -> None:
    """The DELETE carries service.cilia.io/migrating-to: held before any copy was seen; the
    re-created Service (its alias in its own annotation) ends the hold."""
    join = ServiceJoin()
    port = [{"name": "", "port": 8080, "protocol": "TCP"}]
    old = svc(clusterIP="10.96.0.10")
    join.apply(Listed("Service", [old], False))
    join.apply(Listed("EndpointSlice", [endpoint_slice("web-1", "web", port,
                                                       [{"addresses": ["10.0.0.1"]}])], True))  # fmt: skip
    marked = svc(clusterIP="10.96.0.10")
    marked["metadata"]["annotations"] = {model.MIGRATING_TO_ANNOTATION: "10.100.0.10"}
    assert join.apply(Changed("Service", WatchEvent("MODIFIED", marked, "5"))) == []
    assert join.apply(Changed("Service", WatchEvent("DELETED", marked, "6"))) == []
    # a relist meanwhile keeps it too
    assert join.apply(Listed("Service", [], True)) == []
    new = model.with_aliases(
        svc(clusterIP="10.100.0.10"), {ipaddress.IPv4Address("10.96.0.10"): ""}
    )
    [(_, message)] = join.apply(Changed("Service", WatchEvent("ADDED", new, "7")))
    assert message is not None
    assert list(message.cluster_ips) == ["10.100.0.10"] and list(message.alias_ips) == [
        "10.96.0.10"
    ]
    assert [b.ip for b in message.ports[0].backends] == ["10.0.0.1"]
