"""Compile the policy of one endpoint: desired policy-map entries and enforcement flags.

``compile_endpoint(endpoint, policies, identities)`` is a pure function returning an
``EndpointPolicy``: ``entries`` maps ``PolicyEntry(peer, direction, protocol, port)``
(peer 0 = any identity, protocol 0 = any, port 0 = any) to ``Verdict.ALLOW`` or
``Verdict.DENY``; ``enforce_ingress``/``enforce_egress`` say whether the direction is
default-deny (some selecting rule has that direction and does not opt out through
``enableDefaultDeny``).

Deny wins (ISSUE3.md): identical keys merge to DENY; and because one LPM lookup returns
only the most specific entry, an ALLOW is turned into a DENY when a broader DENY for the
same (peer, direction) covers it (same protocol with port 0, or protocol 0). A DENY for
peer 0 against an ALLOW for an exact peer needs no conversion: the datapath looks both
up and a deny from either wins (bpf/bpf_lxc.c ``policy_check``).

Entities: world→2 and every CIDR identity (they carry ``reserved:world``: an address a
policy's prefix names is still outside the cluster, upstream selects it by the world
entity too), host→1, remote-node→6 and 7 (the kube-apiserver identity also carries the
``reserved:remote-node`` label, as upstream's), kube-apiserver→7 (the API server's
addresses, which the operator publishes with that identity), health→4, init→5,
ingress→8, unmanaged→3, cluster→every cluster identity (≥256) + host + remote-node +
kube-apiserver, all→peer 0.

CIDR peers resolve to the node-local CIDR identities their selector matches (prefix inside
the cidr, inside none of its excepts; ``rules.CIDRPeer``), plus world (2) for
``0.0.0.0/0``; the identities exist while some policy names their prefix (the engine
keeps them in the identity cache).

Source: upstream ``pkg/policy`` (``resolvePolicy``, ``mapstate.go`` deny precedence),
``pkg/policy/api/entity.go``; semantics fixed in /work/brief/ISSUE3.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from cilia_agent.identity.cache import IdentityCache
from cilia_agent.identity.labels import (
    IDENTITY_HEALTH,
    IDENTITY_HOST,
    IDENTITY_INGRESS,
    IDENTITY_INIT,
    IDENTITY_KUBE_APISERVER,
    IDENTITY_REMOTE_NODE,
    IDENTITY_UNMANAGED,
    IDENTITY_WORLD,
    POD_NAMESPACE_KEY,
    SOURCE_K8S,
    Label,
    LabelSet,
)
from cilia_agent.policy.rules import (
    PROTO_ANY,
    CompiledPolicy,
    Direction,
    Peers,
    PolicyRef,
)

ANY_PEER = 0
_PROTOCOL_NAMES = {6: "TCP", 17: "UDP", 132: "SCTP"}

ENTITY_IDENTITIES: Mapping[str, frozenset[int]] = {
    "world": frozenset({IDENTITY_WORLD}),
    "host": frozenset({IDENTITY_HOST}),
    "remote-node": frozenset({IDENTITY_REMOTE_NODE, IDENTITY_KUBE_APISERVER}),
    "kube-apiserver": frozenset({IDENTITY_KUBE_APISERVER}),
    "health": frozenset({IDENTITY_HEALTH}),
    "init": frozenset({IDENTITY_INIT}),
    "ingress": frozenset({IDENTITY_INGRESS}),
    "unmanaged": frozenset({IDENTITY_UNMANAGED}),
    "all": frozenset({ANY_PEER}),
}
"""Fixed entity → identities; ``cluster`` and ``world`` depend on the identity cache
(``entity_identities``)."""
CLUSTER_RESERVED = frozenset({IDENTITY_HOST, IDENTITY_REMOTE_NODE, IDENTITY_KUBE_APISERVER})


class Verdict(Enum):
    """Verdict of a policy-map entry."""

    ALLOW = "allow"
    DENY = "deny"


class PolicyEntry(NamedTuple):
    """Key of a desired entry of one endpoint (the map key minus ``ep_id``/prefix length).

    ``peer``: identity or 0 (any); ``direction``: 0 ingress / 1 egress; ``protocol``: IP
    protocol number or 0 (any); ``port``: host-order port or 0 (any), for ICMP 256 + the
    type; ``port_bits``: how many high-order bits of ``port`` match (16: exactly ``port``;
    n < 16: the 2**(16 - n) ports from ``port`` on, a block of an ``endPort`` range; kept 16
    when ``port`` is 0). A non-zero port needs a non-zero protocol.
    """

    peer: int
    direction: int
    protocol: int
    port: int
    port_bits: int = 16

    @property
    def last_port(self) -> int:
        """The highest port the entry covers (``port`` for an exact port, 65535 for any)."""
        if not self.port:
            return 65535
        return self.port + (1 << (16 - self.port_bits)) - 1


@dataclass(frozen=True)
class EndpointSubject:
    """The endpoint a policy is compiled for: identity labels (with its namespace label)
    and its pod's named container ports ``((name, protocol TCP|UDP|SCTP), port)``."""

    labels: LabelSet
    namespace: str
    named_ports: tuple[tuple[tuple[str, str], int], ...] = ()

    @classmethod
    def of(
        cls,
        labels: Iterable[str | Label] | LabelSet,
        namespace: str,
        named_ports: Mapping[tuple[str, str], int] | None = None,
    ) -> EndpointSubject:
        """Build from label strings (``"k8s:app=web"``) and the pod namespace; the
        ``k8s:io.kubernetes.pod.namespace=<namespace>`` label is added when missing.

        Raises:
            cilia_agent.identity.labels.LabelError: a malformed label string.
        """
        ls = labels if isinstance(labels, LabelSet) else LabelSet.of(labels)
        ns_label = Label(SOURCE_K8S, POD_NAMESPACE_KEY, namespace)
        if ns_label not in ls:
            ls = ls.with_labels([ns_label])
        return cls(ls, namespace, tuple(sorted((named_ports or {}).items())))

    def port_named(self, protocol: int, name: str) -> int:
        """The port a named port resolves to on this endpoint, 0 when it has none."""
        wanted = _PROTOCOL_NAMES.get(protocol, "")
        return next((port for (n, p), port in self.named_ports if n == name and p == wanted), 0)


@dataclass(frozen=True)
class EndpointPolicy:
    """Compiled policy of one endpoint (see the module docstring)."""

    entries: Mapping[PolicyEntry, Verdict]
    enforce_ingress: bool
    enforce_egress: bool
    selected_by: tuple[PolicyRef, ...] = ()


def entity_identities(entity: str, identities: IdentityCache) -> frozenset[int]:
    """Identities an entity stands for (peer 0 for ``all``); unknown names → empty."""
    if entity == "cluster":
        return identities.cluster_identities() | CLUSTER_RESERVED
    if entity == "world":
        return identities.local_identities() | {IDENTITY_WORLD}
    return ENTITY_IDENTITIES.get(entity, frozenset())


def resolve_peers(peers: Peers, identities: IdentityCache) -> frozenset[int]:
    """Identities (or 0 = any) a rule's peers resolve to with the current identities."""
    ids: set[int] = {ANY_PEER} if peers.any_peer else set()
    for selector in peers.selectors:
        ids |= identities.matching(selector)
    for entity in peers.entities:
        ids |= entity_identities(entity, identities)
    for cidr in peers.cidrs:
        ids |= identities.matching(cidr.selector)
        if cidr.selects_world:
            ids.add(IDENTITY_WORLD)
    return frozenset(ids)


def compile_endpoint(
    endpoint: EndpointSubject,
    policies: Iterable[CompiledPolicy],
    identities: IdentityCache,
) -> EndpointPolicy:
    """Desired map entries and enforcement flags of ``endpoint``.

    ``policies``: every policy of the cluster (non-selecting ones are skipped);
    ``identities``: the current identity cache (peer selectors are resolved against it).
    Pure: reads its arguments only.
    """
    entries: dict[PolicyEntry, Verdict] = {}
    enforce_in = enforce_eg = False
    selected_by: list[PolicyRef] = []
    for policy in policies:
        subjects = policy.selecting(endpoint.labels)
        if not subjects:
            continue
        selected_by.append(policy.ref)
        for subject in subjects:
            enforce_in |= subject.default_deny_ingress
            enforce_eg |= subject.default_deny_egress
            for rule in subject.rules:
                verdict = Verdict.DENY if rule.deny else Verdict.ALLOW
                ports = list(rule.ports)
                for protocol, name in rule.named:  # resolved on this endpoint's pod
                    number = endpoint.port_named(protocol, name)
                    if number:
                        ports.append((protocol, number, 16))
                for peer in resolve_peers(rule.peers, identities):
                    for protocol, port, bits in ports:
                        key = PolicyEntry(peer, int(rule.direction), protocol, port, bits)
                        if entries.get(key) is not Verdict.DENY:
                            entries[key] = verdict
    return EndpointPolicy(
        entries=apply_deny_precedence(entries),
        enforce_ingress=enforce_in,
        enforce_egress=enforce_eg,
        selected_by=tuple(sorted(selected_by)),
    )


def apply_deny_precedence(entries: Mapping[PolicyEntry, Verdict]) -> dict[PolicyEntry, Verdict]:
    """Turn every ALLOW covered by a broader DENY of the same (peer, direction) into a DENY.

    Covering DENYs: (protocol 0, port 0) covers everything; (protocol p, port 0) covers
    protocol p with any port; (protocol p, port block) covers the ports of protocol p
    inside the block (an ALLOW of a wider block that merely overlaps a DENY block needs
    nothing: the LPM lookup returns the narrower DENY for the ports they share).
    """
    denies: dict[tuple[int, int], list[PolicyEntry]] = {}
    for k, v in entries.items():
        if v is Verdict.DENY:
            denies.setdefault((k.peer, k.direction), []).append(k)
    out = dict(entries)
    for key, verdict in entries.items():
        if verdict is Verdict.DENY:
            continue
        for deny in denies.get((key.peer, key.direction), ()):
            if _covers(deny, key):
                out[key] = Verdict.DENY
                break
    return out


def _covers(broad: PolicyEntry, narrow: PolicyEntry) -> bool:
    """True when ``broad`` matches every packet ``narrow`` matches (and is not ``narrow``)."""
    if broad == narrow:
        return False
    if broad.protocol == PROTO_ANY:
        return True
    if broad.protocol != narrow.protocol:
        return False
    if not broad.port:
        return True
    return bool(narrow.port) and broad.port <= narrow.port and narrow.last_port <= broad.last_port


__all__ = [
    "ANY_PEER",
    "Direction",
    "EndpointPolicy",
    "EndpointSubject",
    "PolicyEntry",
    "Verdict",
    "apply_deny_precedence",
    "compile_endpoint",
    "entity_identities",
    "resolve_peers",
]
