"""Label model, the upstream default label filter, pod identity labels, reserved identities."""

from __future__ import annotations

import pytest

from cilia_agent.identity.labels import (
    DEFAULT_FILTER,
    RESERVED_BY_NAME,
    RESERVED_IDENTITIES,
    Label,
    LabelError,
    LabelFilter,
    LabelSet,
    is_cluster_identity,
    pod_identity_labels,
)


@pytest.mark.parametrize(
    ("text", "expected", "formatted"),
    [
        ("k8s:app=web", Label("k8s", "app", "web"), "k8s:app=web"),
        ("reserved:host", Label("reserved", "host", ""), "reserved:host"),
        ("$world", Label("reserved", "world", ""), "reserved:world"),
        ("app=web", Label("unspec", "app", "web"), "unspec:app=web"),
        ("k8s:url=http://x", Label("k8s", "url", "http://x"), "k8s:url=http://x"),
        ("a=b:c", Label("unspec", "a", "b:c"), "unspec:a=b:c"),
        (
            "k8s:io.kubernetes.pod.namespace=prod",
            Label("k8s", "io.kubernetes.pod.namespace", "prod"),
            "k8s:io.kubernetes.pod.namespace=prod",
        ),
    ],
)
def test_label_strings_parse_and_format_round_trip(
    text: str, expected: Label, formatted: str
) -> None:
    assert Label.parse(text) == expected
    assert str(expected) == formatted


@pytest.mark.parametrize("text", ["k8s:", ":app=x", "=x", ""])
def test_malformed_label_strings_are_rejected(text: str) -> None:
    with pytest.raises(LabelError):
        Label.parse(text)


def test_label_set_canonical_form_is_sorted_strings() -> None:
    ls = LabelSet.of(["k8s:b=2", "k8s:a=1", "reserved:host"])
    assert ls.strings() == ("k8s:a=1", "k8s:b=2", "reserved:host")
    assert ls == LabelSet.of(["reserved:host", "k8s:a=1", "k8s:b=2"])
    assert hash(ls) == hash(LabelSet.of(["reserved:host", "k8s:a=1", "k8s:b=2"]))


@pytest.mark.parametrize(
    ("label", "kept"),
    [
        ("k8s:app=foo", True),  # built-in includes do not turn on whitelist mode
        ("k8s:io.kubernetes.pod.namespace=prod", True),  # include 27 > ignore io.kubernetes 13
        ("k8s:io.kubernetes.pod.name=x", False),
        ("k8s:io.cilium.k8s.namespace.labels.team=a", True),
        ("k8s:io.cilium.k8s.policy.cluster=default", True),
        ("k8s:app.kubernetes.io/name=web", True),
        ("k8s:kubernetes.io/hostname=n1", False),
        ("k8s:statefulset.kubernetes.io/pod-name=db-0", False),
        ("k8s:apps.kubernetes.io/pod-index=0", False),
        ("k8s:batch.kubernetes.io/job-completion-index=1", False),
        ("k8s:beta.kubernetes.io/arch=amd64", False),
        ("k8s:failure-domain.beta.kubernetes.io/zone=z", False),
        ("k8s:k8s.io/x=1", False),
        ("k8s:pod-template-hash=abc", False),
        ("k8s:pod-template-generation=1", False),
        ("k8s:controller-revision-hash=abc", False),
        ("k8s:annotation.foo=bar", False),
        ("k8s:etcd_node=x", False),
        ("reserved:host", True),
        ("k8s:my.kubernetes.io/x=1", True),  # ignore regexes are anchored at the key start
    ],
)
def test_default_filter_keeps_identity_relevant_labels_only(label: str, kept: bool) -> None:
    assert DEFAULT_FILTER.keep(Label.parse(label)) is kept


def test_user_include_turns_on_whitelist_mode() -> None:
    flt = LabelFilter.default(["k8s:app"])
    assert flt.keep(Label.parse("k8s:app=web"))
    assert not flt.keep(Label.parse("k8s:team=a"))  # not included any more
    assert flt.keep(Label.parse("k8s:io.kubernetes.pod.namespace=prod"))
    assert flt.keep(Label.parse("reserved:host"))
    assert not flt.keep(Label.parse("container:app=web"))  # include is limited to k8s source


def test_user_ignore_drops_label_without_whitelist_mode() -> None:
    flt = LabelFilter.default(["!team"])
    assert not flt.keep(Label.parse("k8s:team=a"))
    assert flt.keep(Label.parse("k8s:app=web"))


def test_pod_identity_labels_add_namespace_and_k8s_source_and_filter() -> None:
    labels = pod_identity_labels(
        "prod", {"app": "web", "pod-template-hash": "abc", "app.kubernetes.io/name": "web"}
    )
    assert labels.strings() == (
        "k8s:app.kubernetes.io/name=web",
        "k8s:app=web",
        "k8s:io.kubernetes.pod.namespace=prod",
    )


def test_pod_identity_labels_refuse_empty_namespace() -> None:
    with pytest.raises(LabelError, match="namespace"):
        pod_identity_labels("", {"app": "web"})


@pytest.mark.parametrize(
    ("identity", "name", "labels"),
    [
        (1, "host", ("reserved:host",)),
        (2, "world", ("reserved:world",)),
        (3, "unmanaged", ("reserved:unmanaged",)),
        (4, "health", ("reserved:health",)),
        (5, "init", ("reserved:init",)),
        (6, "remote-node", ("reserved:remote-node",)),
        (7, "kube-apiserver", ("reserved:kube-apiserver", "reserved:remote-node")),
        (8, "ingress", ("reserved:ingress",)),
    ],
)
def test_reserved_identities_match_upstream_numbers_and_labels(
    identity: int, name: str, labels: tuple[str, ...]
) -> None:
    assert RESERVED_IDENTITIES[identity].name == name
    assert RESERVED_IDENTITIES[identity].labels.strings() == labels
    assert RESERVED_BY_NAME[name].id == identity


@pytest.mark.parametrize(("identity", "cluster"), [(255, False), (256, True), (65535, True)])
def test_cluster_identities_start_at_256(identity: int, cluster: bool) -> None:
    assert is_cluster_identity(identity) is cluster
