"""The operator's reserved identities table holds upstream Cilium's numbers."""

from __future__ import annotations

from cilia_common import reserved_identities as reserved
from cilia_operator.identity import labels


def test_numbers_and_names_are_upstream_ones() -> None:
    assert dict(reserved.NAMES) == {
        0: "unknown",
        1: "host",
        2: "world",
        3: "unmanaged",
        4: "health",
        5: "init",
        6: "remote-node",
        7: "kube-apiserver",
        8: "ingress",
        9: "world-ipv4",
        10: "world-ipv6",
    }
    assert reserved.MINIMAL_CLUSTER_IDENTITY == 256


def test_labels_resolve_reserved_sets_from_the_table() -> None:
    assert labels.MINIMAL_NUMERIC_IDENTITY == 256
    assert dict(labels.RESERVED_IDENTITIES) == {
        "host": 1,
        "world": 2,
        "unmanaged": 3,
        "health": 4,
        "init": 5,
        "remote-node": 6,
        "kube-apiserver": 7,
        "ingress": 8,
    }
    assert labels.REMOTE_NODE_IDENTITY == 6
