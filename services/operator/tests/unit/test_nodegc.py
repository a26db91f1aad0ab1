"""The pure parts of the node lifecycle (``ipam/nodegc.py``): what a CiliumNode takes from its
Kubernetes Node."""

from __future__ import annotations

from cilia_operator.ipam import node as nodes
from cilia_operator.ipam.nodegc import adopted, internal_ips, merged_addresses


def _k8s_node(uid: str, *addresses: tuple[str, str]) -> dict[str, object]:
    return {
        "metadata": {"name": "n1", "uid": uid},
        "status": {"addresses": [{"type": t, "address": a} for t, a in addresses]},
    }


def test_internal_ips_are_the_internalip_entries_ipv4_first() -> None:
    node = _k8s_node("u", ("Hostname", "n1"), ("InternalIP", "fd00::5"),
                     ("ExternalIP", "203.0.113.5"), ("InternalIP", "192.0.2.5"))  # fmt: skip
    assert internal_ips(node) == ["192.0.2.5", "fd00::5"]


def test_the_nodes_internalip_leads_and_registered_addresses_follow_once() -> None:
    assert merged_addresses(["192.0.2.5"], ["172.17.0.1", "192.0.2.5", "10.0.0.5"]) == [
        {"type": "InternalIP", "ip": ip} for ip in ("192.0.2.5", "172.17.0.1", "10.0.0.5")
    ]


def test_adopted_sets_the_owner_and_keeps_the_rest() -> None:
    record = nodes.new_node("n1")
    record["spec"]["addresses"] = [{"type": "InternalIP", "ip": "172.17.0.1"}]
    out = adopted(record, _k8s_node("uid-1", ("InternalIP", "192.0.2.5")))
    assert out["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "uid-1"}
    ]
    assert [a["ip"] for a in out["spec"]["addresses"]] == ["192.0.2.5", "172.17.0.1"]
    assert record["spec"]["addresses"] == [{"type": "InternalIP", "ip": "172.17.0.1"}]
    assert adopted(record, None) is record
