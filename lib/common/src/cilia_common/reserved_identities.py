"""Reserved security identities: the one table of their numbers and names, shared by the
operator (allocation: label sets made only of ``reserved:`` labels resolve to these numbers and
are never stored) and the agent (ipcache, policy, Hubble, and the datapath, which mirrors
``IDENTITY_HOST``/``IDENTITY_WORLD`` of ``bpf/lib/common.h`` from it).

Numbers as upstream Cilium (``pkg/identity/numericidentity.go``)::

    0 unknown        3 unmanaged     6 remote-node       9 world-ipv4
    1 host           4 health        7 kube-apiserver   10 world-ipv6
    2 world          5 init          8 ingress

and the first cluster (operator-allocated) identity, 256 (``MinimalNumericIdentity``);
1..255 are reserved. An identity's labels are ``reserved:<name>``.

Cilia is IPv4-only, so ``world`` (2) stands for every address outside the cluster, as in an
upstream cluster without dual stack: 9 and 10 are listed for completeness and are never
given out or accepted (:data:`LABELLED` are the ones that are).

Like all of ``cilia_common`` it imports no service (``.importlinter``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

UNKNOWN: Final = 0
HOST: Final = 1
WORLD: Final = 2
UNMANAGED: Final = 3
HEALTH: Final = 4
INIT: Final = 5
REMOTE_NODE: Final = 6
KUBE_APISERVER: Final = 7
INGRESS: Final = 8
WORLD_IPV4: Final = 9
WORLD_IPV6: Final = 10

MINIMAL_CLUSTER_IDENTITY: Final = 256
"""First identity the operator allocates (upstream ``MinimalNumericIdentity``)."""

NAMES: Mapping[int, str] = {
    UNKNOWN: "unknown",
    HOST: "host",
    WORLD: "world",
    UNMANAGED: "unmanaged",
    HEALTH: "health",
    INIT: "init",
    REMOTE_NODE: "remote-node",
    KUBE_APISERVER: "kube-apiserver",
    INGRESS: "ingress",
    WORLD_IPV4: "world-ipv4",
    WORLD_IPV6: "world-ipv6",
}
"""Identity → its name (the ``<name>`` of its ``reserved:<name>`` label)."""

LABELLED: tuple[int, ...] = (
    HOST,
    WORLD,
    UNMANAGED,
    HEALTH,
    INIT,
    REMOTE_NODE,
    KUBE_APISERVER,
    INGRESS,
)
"""The reserved identities that carry labels, appear in flows and policies, and that a
``reserved:<name>`` label set resolves to (1..8)."""
