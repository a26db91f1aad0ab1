"""Policy manifests → ``CompiledPolicy``: namespace-restricted selectors, port keys, entities.

A ``CompiledPolicy`` is the agent's normal form of one CiliumNetworkPolicy or
NetworkPolicy: a list of ``SubjectRule`` (who it applies to, which directions become
default-deny) each with ``DirectionalRule`` items (peers, (protocol, port) pairs,
allow or deny). It does not depend on identities; ``compiler`` resolves peers later.

Ports: ``TCP``→6, ``UDP``→17, ``SCTP``→132; port 0/absent = any port; ``ANY`` without a
port is protocol 0 (every protocol, prefix 72 in the map); ``ANY`` with a port becomes TCP
and UDP entries, since the LPM key cannot wildcard the protocol and match the port. A range
``port``..``endPort`` becomes the fewest port blocks aligned on their power-of-two size
that cover it exactly (upstream ``policy.PortRangeToMaskedPorts``): 80..90 is 80/13 (80-87),
88/15 (88-89), 90/16. ICMP rules (``icmps[].fields[].type``) become protocol 1 with port
256 + type (:data:`ICMP_TYPE_BASE`; the datapath looks ICMP packets up the same way).
A named port (``port: http``) stays a name here (``DirectionalRule.named``); the compiler
resolves it on each selected endpoint from its pod's container ports (upstream resolves
named ports per pod): a pod without that port name gets nothing from it.

CIDR peers (``toCIDR``/``toCIDRSet``/``fromCIDR``/``fromCIDRSet``, NetworkPolicy
``ipBlock``) become :class:`CIDRPeer` items: a ``cidr`` and its ``except`` prefixes; their
prefixes are what the policy asks the node to name with CIDR identities
(``CompiledPolicy.prefixes``, see ``identity.cidr``). A CIDR peer is never restricted to the
policy's namespace.

Source: upstream ``pkg/policy/api`` (rules, entities, ``cidr.go``), ``pkg/k8s/apis/cilium.io/utils``
(namespace restriction), ``pkg/k8s/network_policy.go`` (NetworkPolicy translation);
semantics fixed in /work/brief/ISSUE3.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from cilia_agent.identity.cidr import SOURCE_CIDR
from cilia_agent.identity.labels import (
    NAMESPACE_LABELS_PREFIX,
    POD_NAMESPACE_KEY,
    SOURCE_K8S,
    LabelSet,
)
from cilia_agent.policy.selector import Operator, Requirement, Selector
from cilia_common.policy.model import (
    CIDRRule,
    CiliumClusterwideNetworkPolicy,
    CiliumNetworkPolicy,
    EgressRule,
    ICMPRule,
    IngressRule,
    LabelSelector,
    NetworkPolicy,
    NetworkPolicyPeer,
    NetworkPolicyPort,
    Policy,
    PortRule,
    Rule,
)

PROTO_ANY = 0
PROTO_ICMP = 1
PROTO_TCP = 6
PROTO_UDP = 17
PROTO_SCTP = 132
PROTOCOLS = {"TCP": PROTO_TCP, "UDP": PROTO_UDP, "SCTP": PROTO_SCTP, "ANY": PROTO_ANY}
ICMP_TYPE_BASE = 256
"""An ICMP rule's map port is ``ICMP_TYPE_BASE + type`` (bpf/bpf_lxc.c ``policy_check``)."""
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Namespace label Kubernetes sets to the namespace's name (NetworkPolicy namespaceSelector)."""

PortKey = tuple[int, int, int]
"""(IP protocol number or 0 = any, port or 0 = any, matching high-order bits of the port:
16 = exactly that port, n < 16 = the block of 2**(16 - n) ports from it; 16 for port 0)."""
L3_ONLY: tuple[PortKey, ...] = ((PROTO_ANY, 0, 16),)


class Direction(IntEnum):
    """Policy direction as in the map key: 0 ingress (to the pod), 1 egress (from the pod)."""

    INGRESS = 0
    EGRESS = 1


@dataclass(frozen=True, order=True)
class PolicyRef:
    """Identity of a policy object: ``kind``, ``namespace``, ``name``."""

    kind: str
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.kind}/{self.namespace}/{self.name}"


@dataclass(frozen=True)
class CIDRPeer:
    """One CIDR peer: ``cidr`` minus its ``excepts`` (canonical IPv4 prefixes, each except
    inside ``cidr``; the model checked both).

    It selects the CIDR identities whose prefix lies inside ``cidr`` and inside none of
    the excepts: every CIDR identity carries ``cidr:`` labels for its prefix and all its
    super-prefixes, so that is the selector ``cidr:<cidr> Exists`` and ``cidr:<except>
    DoesNotExist`` for each except. A ``/0`` cidr also selects ``reserved:world`` (2): the
    addresses no prefix names (upstream ``CIDRSlice.GetAsEndpointSelectors`` adds the
    world selector for ``0.0.0.0/0``).
    """

    cidr: str
    excepts: tuple[str, ...] = ()

    @property
    def selector(self) -> Selector:
        """The label selector described above."""
        reqs = {Requirement(self.cidr, "Exists", source=SOURCE_CIDR)}
        reqs |= {Requirement(e, "DoesNotExist", source=SOURCE_CIDR) for e in self.excepts}
        return Selector(frozenset(reqs))

    @property
    def selects_world(self) -> bool:
        """True for ``0.0.0.0/0`` (the world identity is selected too)."""
        return self.cidr.endswith("/0")

    @property
    def prefixes(self) -> tuple[str, ...]:
        """``cidr`` and its excepts: the prefixes needing CIDR identities."""
        return (self.cidr, *self.excepts)


@dataclass(frozen=True)
class Peers:
    """Who a directional rule is about.

    ``selectors`` are already namespace-restricted; ``entities`` are upstream entity
    names; ``cidrs`` are CIDR peers; ``any_peer`` = every peer (sec_label 0), set for a
    rule with ``toPorts`` and no peer field (and for NetworkPolicy rules without
    ``from``/``to``).
    """

    selectors: tuple[Selector, ...] = ()
    entities: frozenset[str] = frozenset()
    any_peer: bool = False
    cidrs: tuple[CIDRPeer, ...] = ()

    def matches_labels(self, labels: LabelSet) -> bool:
        """True when one of the selectors (CIDR peers' included) selects ``labels``."""
        return any(s.matches(labels) for s in self.selectors) or any(
            c.selector.matches(labels) for c in self.cidrs
        )


@dataclass(frozen=True)
class DirectionalRule:
    """One ingress/egress (allow or deny) rule: peers x (protocol, port) pairs, plus the
    named ports ``(protocol, name)`` resolved on each selected endpoint from its pod's
    container ports (``compiler``; ingress only: the model refuses them in egress)."""

    direction: Direction
    deny: bool
    peers: Peers
    ports: tuple[PortKey, ...] = L3_ONLY
    named: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class SubjectRule:
    """Rules for the endpoints ``subject`` selects, and the directions they make default-deny."""

    subject: Selector
    default_deny_ingress: bool
    default_deny_egress: bool
    rules: tuple[DirectionalRule, ...]


@dataclass(frozen=True)
class CompiledPolicy:
    """Normal form of one policy object (independent of identities)."""

    ref: PolicyRef
    subjects: tuple[SubjectRule, ...]
    source: Policy | None = field(default=None, compare=False, repr=False)

    def selecting(self, labels: LabelSet) -> list[SubjectRule]:
        """The subject rules that select an endpoint with ``labels``."""
        return [s for s in self.subjects if s.subject.matches(labels)]

    def prefixes(self) -> frozenset[str]:
        """Every prefix the policy's CIDR peers name (excepts included)."""
        return frozenset(
            p
            for subject in self.subjects
            for rule in subject.rules
            for cidr in rule.peers.cidrs
            for p in cidr.prefixes
        )


def compile_policy(policy: Policy, namespace: str) -> CompiledPolicy:
    """Translate a parsed policy living in ``namespace`` into its normal form.

    Raises:
        cilia_agent.identity.labels.LabelError: a selector key is empty after its source.
    """
    if isinstance(policy, CiliumClusterwideNetworkPolicy):
        # cluster-wide: subjects and peers of every namespace (upstream: no namespace
        # requirement is added to a CCNP's selectors)
        ref = PolicyRef(policy.kind, "", policy.metadata.name)
        return CompiledPolicy(ref, tuple(_cnp_rule(r, None) for r in policy.rules), policy)
    ref = PolicyRef(policy.kind, namespace, policy.metadata.name)
    if isinstance(policy, CiliumNetworkPolicy):
        subjects = tuple(_cnp_rule(rule, namespace) for rule in policy.rules)
    else:
        subjects = (_np_spec(policy, namespace),)
    return CompiledPolicy(ref, subjects, policy)


# ------------------------------------------------------------------------------ CNP


def _cnp_rule(rule: Rule, namespace: str | None) -> SubjectRule:
    """One CNP rule living in ``namespace`` (None: a cluster-wide policy's rule)."""
    subject = Selector.from_model(rule.endpoint_selector)
    if namespace is not None:
        subject = subject.in_namespace(namespace)
    dd = rule.enable_default_deny
    has_in = bool(rule.ingress) or bool(rule.ingress_deny)
    has_eg = bool(rule.egress) or bool(rule.egress_deny)
    rules: list[DirectionalRule] = []
    for deny, ingress in ((False, rule.ingress), (True, rule.ingress_deny)):
        rules += [_cnp_ingress(r, deny, namespace) for r in ingress or ()]
    for deny, egress in ((False, rule.egress), (True, rule.egress_deny)):
        rules += [_cnp_egress(r, deny, namespace) for r in egress or ()]
    return SubjectRule(
        subject=subject,
        default_deny_ingress=has_in and (dd is None or dd.ingress is not False),
        default_deny_egress=has_eg and (dd is None or dd.egress is not False),
        rules=tuple(rules),
    )


def _peers(
    selectors: Sequence[LabelSelector] | None,
    entities: Sequence[str] | None,
    cidrs: tuple[CIDRPeer, ...],
    has_ports: bool,
    namespace: str | None,
) -> Peers:
    sels = tuple(
        Selector.from_model(s)
        if namespace is None
        else Selector.from_model(s).restricted_to(namespace)
        for s in selectors or ()
    )
    ents = frozenset(entities or ())
    any_peer = not sels and not ents and not cidrs and has_ports
    return Peers(sels, ents, any_peer=any_peer, cidrs=cidrs)


def _cidr_peers(
    plain: Sequence[str] | None, sets: Sequence[CIDRRule] | None
) -> tuple[CIDRPeer, ...]:
    """``toCIDR``/``fromCIDR`` items (no excepts) then ``…CIDRSet`` items, deduplicated."""
    peers = [CIDRPeer(c) for c in plain or ()]
    peers += [CIDRPeer(r.cidr, r.excepts) for r in sets or ()]
    return tuple(dict.fromkeys(peers))


def _cnp_ingress(rule: IngressRule, deny: bool, namespace: str | None) -> DirectionalRule:
    cidrs = _cidr_peers(rule.from_cidr, rule.from_cidr_set)
    l4 = bool(rule.to_ports) or bool(rule.icmps)
    peers = _peers(rule.from_endpoints, rule.from_entities, cidrs, l4, namespace)
    if rule.icmps:
        return DirectionalRule(Direction.INGRESS, deny, peers, _icmp_ports(rule.icmps))
    ports, named = _cnp_ports(rule.to_ports)
    return DirectionalRule(Direction.INGRESS, deny, peers, ports, named)


def _cnp_egress(rule: EgressRule, deny: bool, namespace: str | None) -> DirectionalRule:
    cidrs = _cidr_peers(rule.to_cidr, rule.to_cidr_set)
    l4 = bool(rule.to_ports) or bool(rule.icmps)
    peers = _peers(rule.to_endpoints, rule.to_entities, cidrs, l4, namespace)
    if rule.icmps:
        return DirectionalRule(Direction.EGRESS, deny, peers, _icmp_ports(rule.icmps))
    ports, named = _cnp_ports(rule.to_ports)
    return DirectionalRule(Direction.EGRESS, deny, peers, ports, named)


def port_blocks(first: int, last: int) -> list[tuple[int, int]]:
    """``first``..``last`` (inclusive, 1 ≤ first ≤ last ≤ 65535) as the fewest
    ``(start, bits)`` blocks aligned on their size 2**(16 - bits) that cover it exactly.

    Raises:
        ValueError: an empty or out-of-range range.
    """
    if not 1 <= first <= last <= 65535:
        raise ValueError(f"port range {first}..{last} is not within 1..65535")
    blocks = []
    while first <= last:
        size = first & -first  # the largest power of two ``first`` is aligned on
        while size > last - first + 1:
            size >>= 1
        blocks.append((first, 16 - size.bit_length() + 1))
        first += size
    return blocks


def port_keys(protocol: str, port: int, end_port: int | None = None) -> tuple[PortKey, ...]:
    """(protocol name, port, range end) → map (protocol, port, bits) keys; see the module
    docstring."""
    number = PROTOCOLS[protocol]
    protocols = (PROTO_TCP, PROTO_UDP) if number == PROTO_ANY else (number,)
    if port == 0:
        return L3_ONLY if number == PROTO_ANY else ((number, 0, 16),)
    ranged = end_port is not None and end_port > port
    blocks = port_blocks(port, end_port) if ranged and end_port else [(port, 16)]
    return tuple((p, start, bits) for p in protocols for start, bits in blocks)


Named = tuple[tuple[int, str], ...]
"""Named ports of a rule: ``(protocol number, port name)``."""


def _named_key(protocol: str, name: str) -> list[tuple[int, str]]:
    number = PROTOCOLS[protocol]
    return [(PROTO_TCP, name), (PROTO_UDP, name)] if number == PROTO_ANY else [(number, name)]


def _cnp_ports(to_ports: Sequence[PortRule] | None) -> tuple[tuple[PortKey, ...], Named]:
    """Numeric keys and named ports of ``toPorts`` (no ``toPorts``: every port)."""
    if not to_ports:
        return L3_ONLY, ()
    keys: list[PortKey] = []
    named: list[tuple[int, str]] = []
    for port_rule in to_ports:
        if not port_rule.ports:
            keys += L3_ONLY
        for pp in port_rule.ports or ():
            if isinstance(pp.port, str):
                named += _named_key(pp.protocol, pp.port)
            else:
                keys += port_keys(pp.protocol, pp.port, pp.end_port)
    return tuple(dict.fromkeys(keys)), tuple(dict.fromkeys(named))


def _icmp_ports(icmps: Sequence[ICMPRule]) -> tuple[PortKey, ...]:
    keys = [(PROTO_ICMP, ICMP_TYPE_BASE + f.type, 16) for rule in icmps for f in rule.fields]
    return tuple(dict.fromkeys(keys))


# ------------------------------------------------------------------------------ k8s NP


def _np_spec(policy: NetworkPolicy, namespace: str) -> SubjectRule:
    spec = policy.spec
    types = spec.effective_policy_types
    rules: list[DirectionalRule] = []
    if "Ingress" in types:
        for ing in spec.ingress or ():
            peers = _np_peers(ing.from_, namespace)
            ports, named = _np_ports(ing.ports)
            rules.append(DirectionalRule(Direction.INGRESS, False, peers, ports, named))
    if "Egress" in types:
        for eg in spec.egress or ():
            peers = _np_peers(eg.to, namespace)
            ports, named = _np_ports(eg.ports)
            rules.append(DirectionalRule(Direction.EGRESS, False, peers, ports, named))
    return SubjectRule(
        subject=Selector.from_model(spec.pod_selector).in_namespace(namespace),
        default_deny_ingress="Ingress" in types,
        default_deny_egress="Egress" in types,
        rules=tuple(rules),
    )


def _np_peers(peers: Sequence[NetworkPolicyPeer] | None, namespace: str) -> Peers:
    if not peers:
        return Peers(any_peer=True)
    selectors = tuple(_np_peer(p, namespace) for p in peers if p.ip_block is None)
    cidrs = tuple(
        dict.fromkeys(
            CIDRPeer(p.ip_block.cidr, p.ip_block.excepts) for p in peers if p.ip_block is not None
        )
    )
    return Peers(selectors, cidrs=cidrs)


def _np_peer(peer: NetworkPolicyPeer, namespace: str) -> Selector:
    pods = Selector.from_model(peer.pod_selector or LabelSelector())
    if peer.namespace_selector is None:
        return pods.in_namespace(namespace)
    ns_reqs = {Requirement(POD_NAMESPACE_KEY, "Exists", source=SOURCE_K8S)}
    sel = peer.namespace_selector
    pairs: list[tuple[str, Operator, list[str]]] = [
        (k, "In", [v]) for k, v in (sel.match_labels or {}).items()
    ]
    pairs += [(e.key, e.operator, e.values or []) for e in sel.match_expressions or ()]
    for key, op, values in pairs:
        target = POD_NAMESPACE_KEY if key == NAMESPACE_NAME_LABEL else NAMESPACE_LABELS_PREFIX + key
        ns_reqs.add(Requirement(target, op, frozenset(values), SOURCE_K8S))
    return Selector(pods.requirements | ns_reqs)


def _np_ports(ports: Sequence[NetworkPolicyPort] | None) -> tuple[tuple[PortKey, ...], Named]:
    """Numeric keys and named ports of NetworkPolicy ``ports`` (none: every port)."""
    if not ports:
        return L3_ONLY, ()
    keys = [
        k
        for p in ports
        if not isinstance(p.port, str)
        for k in port_keys(p.protocol, p.port, p.end_port)
    ]
    named = [n for p in ports if isinstance(p.port, str) for n in _named_key(p.protocol, p.port)]
    return tuple(dict.fromkeys(keys)), tuple(dict.fromkeys(named))
