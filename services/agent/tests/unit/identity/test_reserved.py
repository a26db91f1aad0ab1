"""The agent's reserved identities table holds upstream Cilium's numbers, and is the only one."""

from __future__ import annotations

from cilia_agent.datapath import layout
from cilia_agent.hubble import enrich
from cilia_agent.identity import labels
from cilia_common import reserved_identities as reserved

UPSTREAM = {
    "unknown": 0,
    "host": 1,
    "world": 2,
    "unmanaged": 3,
    "health": 4,
    "init": 5,
    "remote-node": 6,
    "kube-apiserver": 7,
    "ingress": 8,
    "world-ipv4": 9,
    "world-ipv6": 10,
}


def test_numbers_and_names_are_upstream_ones() -> None:
    assert {name: number for number, name in reserved.NAMES.items()} == UPSTREAM
    assert reserved.MINIMAL_CLUSTER_IDENTITY == 256
    assert reserved.LABELLED == (1, 2, 3, 4, 5, 6, 7, 8)


def test_every_user_reads_the_table() -> None:
    assert (layout.IDENTITY_HOST, layout.IDENTITY_WORLD) == (reserved.HOST, reserved.WORLD)
    assert labels.MINIMAL_CLUSTER_IDENTITY == reserved.MINIMAL_CLUSTER_IDENTITY
    assert {r.id: r.name for r in labels.RESERVED_IDENTITIES.values()} == {
        i: reserved.NAMES[i] for i in reserved.LABELLED
    }
    assert labels.RESERVED_IDENTITIES[reserved.KUBE_APISERVER].labels == labels.LabelSet.of(
        ["reserved:kube-apiserver", "reserved:remote-node"]
    )
    assert enrich.RESERVED_IDENTITY_LABELS == {
        1: ("reserved:host",),
        2: ("reserved:world",),
        3: ("reserved:unmanaged",),
        4: ("reserved:health",),
        5: ("reserved:init",),
        6: ("reserved:remote-node",),
        7: ("reserved:kube-apiserver",),
        8: ("reserved:ingress",),
    }
