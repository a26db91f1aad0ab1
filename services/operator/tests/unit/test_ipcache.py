"""The ipcache view: endpoint and node entries, claim priority, incremental dirty sets."""

from typing import Any

import pytest

from cilia_operator.endpoint.ipcache import Entry, IPCache
from cilia_operator.endpoint.records import InvalidEndpoint, endpoint_record


def node(name: str, *ips: str, rv: int = 1) -> dict[str, Any]:
    return {
        "kind": "CiliumNode",
        "metadata": {"name": name, "resourceVersion": str(rv)},
        "spec": {"addresses": [{"type": "InternalIP", "ip": ip} for ip in ips]},
    }


def cep(name: str, ip: str, identity: int, node_name: str, rv: int = 1) -> dict[str, Any]:
    record = endpoint_record(
        namespace="ns", name=name, node_name=node_name, node_ip="", ipv4=ip,
        identity=identity, labels=["k8s:app=x"], endpoint_id=7, container_id="c",
    )  # fmt: skip
    record["metadata"]["resourceVersion"] = str(rv)
    return record


def test_endpoints_carry_their_nodes_host_ip_and_nodes_are_remote_node_identity() -> None:
    cache = IPCache()
    cache.set_node(node("n1", "192.0.2.1", "fd00::1"))
    dirty = cache.set_endpoint(cep("web", "10.1.0.5", 300, "n1"))
    assert dirty == {"10.1.0.5/32"}
    assert cache.entries() == {
        "192.0.2.1/32": Entry("192.0.2.1/32", 6, "n1", "192.0.2.1", ""),
        "fd00::1/128": Entry("fd00::1/128", 6, "n1", "fd00::1", ""),
        "10.1.0.5/32": Entry("10.1.0.5/32", 300, "n1", "192.0.2.1", "ns/web"),
    }


def test_endpoint_before_its_node_gets_the_host_ip_once_the_node_registers() -> None:
    cache = IPCache()
    cache.set_endpoint(cep("web", "10.1.0.5", 300, "n1"))
    assert cache.entry("10.1.0.5/32") == Entry("10.1.0.5/32", 300, "n1", "", "ns/web")
    dirty = cache.set_node(node("n1", "192.0.2.1"))
    assert dirty == {"192.0.2.1/32", "10.1.0.5/32"}
    assert cache.entry("10.1.0.5/32").host_ip == "192.0.2.1"  # type: ignore[union-attr]
    assert cache.delete_node("n1") == {"192.0.2.1/32", "10.1.0.5/32"}
    assert set(cache.entries()) == {"10.1.0.5/32"}


def test_reused_ip_goes_to_the_newest_endpoint_and_falls_back_when_it_is_deleted() -> None:
    cache = IPCache()
    cache.set_endpoint(cep("old", "10.1.0.5", 300, "n1", rv=5))
    cache.set_endpoint(cep("new", "10.1.0.5", 301, "n1", rv=9))
    assert cache.entry("10.1.0.5/32").owner == "ns/new"  # type: ignore[union-attr]
    cache.delete_endpoint("ns/new")
    assert cache.entry("10.1.0.5/32").owner == "ns/old"  # type: ignore[union-attr]
    cache.delete_endpoint("ns/old")
    assert cache.entry("10.1.0.5/32") is None


def test_endpoint_moving_ip_dirties_old_and_new_address() -> None:
    cache = IPCache()
    cache.set_endpoint(cep("web", "10.1.0.5", 300, "n1"))
    assert cache.set_endpoint(cep("web", "10.1.0.6", 300, "n1", rv=2)) == {
        "10.1.0.5/32",
        "10.1.0.6/32",
    }
    assert set(cache.entries()) == {"10.1.0.6/32"}


def test_relist_replaces_everything_and_reports_what_vanished() -> None:
    cache = IPCache()
    cache.replace_nodes([node("n1", "192.0.2.1"), node("n2", "192.0.2.2")])
    cache.replace_endpoints([cep("a", "10.1.0.1", 300, "n1"), cep("b", "10.1.0.2", 301, "n2")])
    dirty = cache.replace_nodes([node("n1", "192.0.2.1")])
    assert "192.0.2.2/32" in dirty and "10.1.0.2/32" in dirty
    dirty = cache.replace_endpoints([cep("a", "10.1.0.1", 300, "n1")])
    assert "10.1.0.2/32" in dirty
    assert set(cache.entries()) == {"192.0.2.1/32", "10.1.0.1/32"}


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("ipv4", "10.1.0", "not an IPv4 address"),
        ("identity", 0, "identity: must be > 0"),
        ("namespace", "Bad_NS", "not a valid namespace"),
        ("name", "", "not a valid name"),
    ],
)
def test_invalid_endpoint_records_are_refused_naming_the_field(
    field: str, value: Any, reason: str
) -> None:
    fields: dict[str, Any] = {
        "namespace": "ns", "name": "web", "node_name": "n1", "node_ip": "", "ipv4": "10.1.0.5",
        "identity": 300, "labels": [], "endpoint_id": 1, "container_id": "",
    }  # fmt: skip
    fields[field] = value
    with pytest.raises(InvalidEndpoint, match=reason):
        endpoint_record(**fields)


def test_endpoint_record_is_shaped_like_upstream_cilium_endpoint() -> None:
    record = endpoint_record(
        namespace="", name="web", node_name="n1", node_ip="192.0.2.1", ipv4="10.1.0.5",
        identity=300, labels=["k8s:b=2", "k8s:a=1"], endpoint_id=42, container_id="abc",
    )  # fmt: skip
    assert record["metadata"] == {"name": "web", "namespace": "default"}
    status = record["status"]
    assert status["id"] == 42
    assert status["identity"] == {"id": 300, "labels": ["k8s:a=1", "k8s:b=2"]}
    assert status["networking"] == {
        "addressing": [{"ipv4": "10.1.0.5"}],
        "node": "192.0.2.1",
        "node-name": "n1",
    }
    assert status["external-identifiers"]["container-id"] == "abc"


def apiserver_slice(
    *endpoints: tuple[str, bool | None], name: str = "kubernetes", namespace: str = "default",
    service: str = "kubernetes", rv: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """An EndpointSlice; each endpoint ``(address, ready)`` (None: condition absent)."""
    return {
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace, "resourceVersion": str(rv),
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [ip], "conditions": {} if ready is None else {"ready": ready}}
            for ip, ready in endpoints
        ],
        "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}],
    }  # fmt: skip


def test_apiserver_addresses_get_the_kube_apiserver_identity_off_cluster_and_on_a_node() -> None:
    cache = IPCache()
    cache.set_node(node("cp", "192.0.2.1"))
    dirty = cache.set_slice(apiserver_slice(("192.0.2.1", True), ("198.51.100.7", None)))
    assert dirty == {"192.0.2.1/32", "198.51.100.7/32"}
    assert cache.entries() == {
        # hostNetwork API server on node cp: identity 7, the node's name and host IP kept
        "192.0.2.1/32": Entry("192.0.2.1/32", 7, "cp", "192.0.2.1", ""),
        # off-cluster API server: identity 7, no node, no tunnel
        "198.51.100.7/32": Entry("198.51.100.7/32", 7, "", "", ""),
    }
    # the API server leaves the node: the node's own identity comes back
    dirty = cache.set_slice(apiserver_slice(("198.51.100.7", True), rv=2))
    assert dirty == {"192.0.2.1/32", "198.51.100.7/32"}
    assert cache.entry("192.0.2.1/32") == Entry("192.0.2.1/32", 6, "cp", "192.0.2.1", "")
    assert cache.delete_slice("default/kubernetes") == {"198.51.100.7/32"}
    assert set(cache.entries()) == {"192.0.2.1/32"}


def test_only_ready_endpoints_of_default_kubernetes_slices_count() -> None:
    cache = IPCache()
    assert cache.set_slice(apiserver_slice(("10.9.0.1", False))) == set()
    assert cache.set_slice(apiserver_slice(("10.9.0.2", True), service="web", name="w")) == set()
    other_ns = apiserver_slice(("10.9.0.3", True), namespace="kube-system", name="k")
    assert cache.set_slice(other_ns) == set()
    fqdn = apiserver_slice(("api.example", True), name="f")
    assert cache.set_slice(fqdn) == set()
    assert cache.entries() == {}
    # a slice relabelled away from default/kubernetes gives its addresses back
    cache.set_slice(apiserver_slice(("10.9.0.4", True), name="x"))
    assert cache.entry("10.9.0.4/32").identity == 7  # type: ignore[union-attr]
    assert cache.set_slice(apiserver_slice(("10.9.0.4", True), name="x", service="web")) == {
        "10.9.0.4/32"
    }
    assert cache.entries() == {}


def test_pod_claim_beats_apiserver_claim_and_relist_drops_vanished_slices() -> None:
    cache = IPCache()
    cache.replace_slices([apiserver_slice(("10.1.0.5", True)),
                          apiserver_slice(("10.1.0.6", True), name="kubernetes-2")])  # fmt: skip
    cache.set_endpoint(cep("web", "10.1.0.5", 300, "n1"))
    assert cache.entry("10.1.0.5/32").identity == 300  # type: ignore[union-attr]
    cache.delete_endpoint("ns/web")
    assert cache.entry("10.1.0.5/32").identity == 7  # type: ignore[union-attr]
    dirty = cache.replace_slices([apiserver_slice(("10.1.0.5", True))])
    assert "10.1.0.6/32" in dirty and set(cache.entries()) == {"10.1.0.5/32"}
