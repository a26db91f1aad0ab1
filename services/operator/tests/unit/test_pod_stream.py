"""PodService's per-node view: which Pod events one node's stream sends."""

from __future__ import annotations

from typing import Any

from cilia_operator.controlplane.pod import NAMESPACE_KIND, POD_KIND, NodePods, pod_message
from cilia_operator.controlplane.streams import Changed, Listed
from cilia_operator.store import WatchEvent


def _pod(name: str, node: str, labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "shop", "name": name, "uid": f"u-{name}", "labels": labels},
        "spec": {"nodeName": node, **spec},
        "status": {"podIPs": [{"ip": "10.0.0.7"}]},
    }


def _ns(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}}


def _names(events: list[tuple[tuple[str, str], Any]]) -> list[tuple[str, bool]]:
    return [(key[1], message is not None) for key, message in events]


def test_a_nodes_stream_sends_its_own_pods_with_namespace_labels_and_their_changes() -> None:
    view = NodePods("node-a")
    assert view.apply(Listed(NAMESPACE_KIND, [_ns("shop", {"team": "web"})], False)) == []
    listed = view.apply(
        Listed(
            POD_KIND,
            [
                _pod("mine", "node-a", {"app": "web"}, serviceAccountName="web-sa"),
                _pod("theirs", "node-b", {"app": "web"}),
                _pod("unscheduled", "", {"app": "web"}),
                _pod("host", "node-a", {"app": "web"}, hostNetwork=True),
            ],
            True,
        )
    )
    assert _names(listed) == [("mine", True)]
    message = listed[0][1]
    assert dict(message.labels) == {"app": "web"}
    assert dict(message.namespace_labels) == {"team": "web"}
    assert message.service_account == "web-sa" and list(message.ips) == ["10.0.0.7"]

    # a label edit is sent; an identical update is not
    edited = _pod("mine", "node-a", {"app": "other"}, serviceAccountName="web-sa")
    assert _names(view.apply(Changed(POD_KIND, WatchEvent("MODIFIED", edited, "1")))) == [
        ("mine", True)
    ]
    assert view.apply(Changed(POD_KIND, WatchEvent("MODIFIED", edited, "1"))) == []
    # a Namespace label change re-sends the namespace's pods of this node
    events = view.apply(
        Changed(NAMESPACE_KIND, WatchEvent("MODIFIED", _ns("shop", {"team": "x"}), "1"))
    )
    assert _names(events) == [("mine", True)]
    assert dict(events[0][1].namespace_labels) == {"team": "x"}
    # another node's pod arriving is not this node's business; ours moving away is a delete
    other = _pod("new", "node-b", {})
    assert view.apply(Changed(POD_KIND, WatchEvent("ADDED", other, "1"))) == []
    assert _names(view.apply(Changed(POD_KIND, WatchEvent("DELETED", edited, "1")))) == [
        ("mine", False)
    ]


def test_service_account_defaults_as_the_api_server_defaults_it() -> None:
    assert pod_message(_pod("p", "n", {}), {}).service_account == "default"


def test_named_container_ports_are_sent_for_named_port_policies() -> None:
    containers = [
        {"name": "web", "ports": [{"name": "serve-80", "containerPort": 8080},
                                  {"containerPort": 9090},  # no name: not sent
                                  {"name": "dns", "containerPort": 53, "protocol": "UDP"}]},
        {"name": "side", "ports": [{"name": "sctp", "containerPort": 9000, "protocol": "SCTP"}]},
    ]  # fmt: skip
    msg = pod_message(_pod("p", "n", {}, containers=containers), {})
    assert [(p.name, p.port, p.protocol) for p in msg.container_ports] == [
        ("serve-80", 8080, "TCP"),
        ("dns", 53, "UDP"),
        ("sctp", 9000, "SCTP"),
    ]


def test_slicer_adopts_stored_slices_keeps_members_and_repairs_a_mixed_one() -> None:
    from cilia_operator.endpoint.slices import CoreEndpoint, Slicer

    slicer = Slicer(2, new_name=iter(f"ces-new{i}" for i in range(10)).__next__)
    member = {"networking": {"addressing": [{"ipv4": "10.0.0.1"}]}}
    slicer.adopt({"metadata": {"name": "ces-a"}, "namespace": "shop",
                  "endpoints": [{"name": "p1", "id": 300, **member}]})  # fmt: skip
    slicer.adopt({"metadata": {"name": "ces-b"}, "namespace": "shop",
                  "endpoints": [{"name": "p2", "id": 300, **member},
                                {"name": "p3", "id": 301, **member}]})  # fmt: skip
    slicer.adopt({"metadata": {}, "endpoints": []})  # nameless: ignored
    assert slicer.dirty == {"ces-b"}, "a mixed slice is rewritten"
    # p1 keeps its slice; p4 of the same group joins a slice with room; p3 goes elsewhere
    slicer.upsert(("shop", "p1"), ("shop", 300), CoreEndpoint("p1", 300, "10.0.0.1", ""))
    slicer.upsert(("shop", "p4"), ("shop", 300), CoreEndpoint("p4", 300, "10.0.0.4", ""))
    slicer.upsert(("shop", "p3"), ("shop", 301), CoreEndpoint("p3", 301, "10.0.0.3", ""))
    written = dict(slicer.take_dirty())
    names = {n: [e["name"] for e in (r or {}).get("endpoints", [])] for n, r in written.items()}
    assert names == {"ces-a": ["p1", "p4"], "ces-b": ["p2"], "ces-new0": ["p3"]}
    slicer.delete(("shop", "p3"))
    assert slicer.take_dirty() == [("ces-new0", None)], "an empty slice is deleted"
