"""Label sets of identities: parsing, canonical order, reserved identities, records."""

import pytest

from cilia_operator.identity import records
from cilia_operator.identity.labels import InvalidLabels, LabelSet


def test_labels_are_sorted_and_deduplicated_so_order_does_not_change_the_digest() -> None:
    a = LabelSet.parse(["k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"])
    b = LabelSet.parse(["k8s:io.kubernetes.pod.namespace=default", "k8s:app=web", "k8s:app=web"])
    assert a == b and a.digest() == b.digest()
    assert a.strings() == ["k8s:app=web", "k8s:io.kubernetes.pod.namespace=default"]
    assert a.security_labels() == {"k8s:app": "web", "k8s:io.kubernetes.pod.namespace": "default"}
    assert LabelSet.parse(["k8s:app=db"]).digest() != a.digest()


@pytest.mark.parametrize(
    ("labels", "reason"),
    [
        ([], "empty label set"),
        (["app=web"], "expected source:key=value"),
        (["bogus:app=web"], "unknown source 'bogus'"),
        (["k8s:=web"], "empty key"),
        (["k8s:app=web", "k8s:app=db"], "given twice with different values"),
        (["reserved:host", "k8s:app=web"], "cannot be mixed"),
    ],
)
def test_invalid_label_sets_are_refused_with_the_reason(labels: list[str], reason: str) -> None:
    with pytest.raises(InvalidLabels, match=reason):
        LabelSet.parse(labels).reserved_identity()


def test_reserved_label_sets_map_to_upstream_reserved_ids() -> None:
    assert LabelSet.parse(["reserved:host"]).reserved_identity() == 1
    assert LabelSet.parse(["reserved:world"]).reserved_identity() == 2
    assert LabelSet.parse(["reserved:remote-node"]).reserved_identity() == 6
    assert (
        LabelSet.parse(["reserved:kube-apiserver", "reserved:remote-node"]).reserved_identity() == 7
    )
    assert LabelSet.parse(["k8s:app=web"]).reserved_identity() is None


def test_identity_record_is_shaped_like_upstream_cilium_identity() -> None:
    labels = LabelSet.parse(
        ["k8s:app=web", "container:id=x y", "k8s:io.kubernetes.pod.namespace=a"]
    )
    record = records.identity_record(300, labels, "node-a")
    assert record["apiVersion"] == "cilium.io/v2" and record["kind"] == "CiliumIdentity"
    assert record["metadata"]["name"] == "300"
    assert record["security-labels"] == {
        "container:id": "x y",
        "k8s:app": "web",
        "k8s:io.kubernetes.pod.namespace": "a",
    }
    # only k8s-source labels that are valid Kubernetes labels go to metadata.labels
    assert record["metadata"]["labels"] == {"app": "web", "io.kubernetes.pod.namespace": "a"}
    assert records.node_references(record) == {"node-a"}
    assert records.record_labels(record) == labels
    assert records.identity_id(record) == 300


def test_referencing_clears_the_gc_mark_and_releasing_keeps_it_unreferenced() -> None:
    import datetime as dt

    record = records.identity_record(300, LabelSet.parse(["k8s:app=web"]))
    marked = records.with_heartbeat(record, dt.datetime(2025, 1, 2, 3, 4, 5, 600000, dt.UTC))
    assert marked["metadata"]["annotations"]["io.cilium.heartbeat"] == "2025-01-02T03:04:05.600000Z"
    assert records.heartbeat(marked) == dt.datetime(2025, 1, 2, 3, 4, 5, 600000, dt.UTC)
    referenced = records.with_references(marked, ["b", "a"])
    assert records.heartbeat(referenced) is None
    assert referenced["metadata"]["annotations"] == {"cilia.io/node-references": "a,b"}
    assert "annotations" not in records.with_references(referenced, [])["metadata"]
