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
