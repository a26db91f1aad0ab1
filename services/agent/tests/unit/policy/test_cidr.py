"""CIDR peers: validation, selection (except, 0.0.0.0/0), refcounted identities and ipcache
prefixes, and what Hubble's resolver names an address by."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_agent.hubble.enrich import OwnerResolver
from cilia_agent.identity.cidr import LOCAL_SCOPE
from cilia_agent.ipcache import Entry, IPCache
from cilia_agent.policy.compiler import PolicyEntry, Verdict
from cilia_agent.policy.engine import PolicyEngine
from cilia_common.policy.model import CiliumNetworkPolicy, InvalidPolicy, parse_policy
from cilia_common.reserved_identities import WORLD

NS = "k8s:io.kubernetes.pod.namespace=prod"
CLIENT_ID = 300


def cnp(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": name, "namespace": "prod"},
        "spec": {"endpointSelector": {"matchLabels": {"app": "client"}}, **spec},
    }


def np_egress(name: str, cidr: str, excepts: Sequence[str]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "prod"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "client"}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"ipBlock": {"cidr": cidr, "except": list(excepts)}}]}],
        },
    }


def upserts(*manifests: dict[str, Any], synced: bool = False) -> Any:
    return pb.WatchPoliciesResponse(
        events=[
            pb.PolicyEvent(
                type=pb.EVENT_TYPE_UPSERT,
                kind=m["kind"],
                namespace="prod",
                name=m["metadata"]["name"],
                json=json.dumps(m),
            )
            for m in manifests
        ],
        synced=synced,
    )


def delete(kind: str, name: str) -> Any:
    event = pb.PolicyEvent(type=pb.EVENT_TYPE_DELETE, kind=kind, namespace="prod", name=name)
    return pb.WatchPoliciesResponse(events=[event])


class Table:
    """An ipcache listener keeping the table as the BPF map would hold it."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}

    def upsert(self, prefix: str, entry: Entry) -> None:
        self.rows[prefix] = entry.identity

    def delete(self, prefix: str) -> None:
        del self.rows[prefix]


def engine() -> tuple[PolicyEngine, IPCache, Table]:
    table = Table()
    ipcache = IPCache([table])
    eng = PolicyEngine(prefixes=ipcache)
    eng.on_identities(pb.WatchIdentitiesResponse(synced=True))
    eng.on_policies(pb.WatchPoliciesResponse(synced=True))
    eng.set_endpoint(1, ["k8s:app=client", NS], "prod")
    return eng, ipcache, table


def peers(eng: PolicyEngine, direction: int) -> set[int]:
    entries = eng.compiled[1].entries
    return {k.peer for k, v in entries.items() if k.direction == direction and v is Verdict.ALLOW}


def ident(eng: PolicyEngine, prefix: str) -> int:
    alloc = eng.cidr_identities.get(prefix)
    assert alloc is not None, prefix
    return alloc.identity


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("manifest", "path", "message"),
    [
        (
            np_egress("n", "192.0.2.0/24", ["192.0.2.128/25", "198.51.100.0/25"]),
            "spec.egress[0].to[0].ipBlock.except[1]",
            "198.51.100.0/25 is not strictly inside cidr 192.0.2.0/24",
        ),
        (
            cnp("c", {"egressDeny": [{"toCIDRSet": [{"cidr": "10.0.0.0/8", "except": ["::/0"]}]}]}),
            "spec.egressDeny[0].toCIDRSet[0].except[0]",
            "IPv6 CIDR '::/0' not supported by Cilia: the datapath is IPv4-only",
        ),
        (
            cnp("c", {"ingress": [{"fromCIDR": ["10.0.0.0/8", "10.0.0.0/33"]}]}),
            "spec.ingress[0].fromCIDR[1]",
            "'10.0.0.0/33' is not a valid CIDR (expected a.b.c.d/n)",
        ),
        (
            cnp("c", {"ingressDeny": [{"fromCIDRSet": [{"cidrGroupRef": "g"}]}]}),
            "spec.ingressDeny[0].fromCIDRSet[0].cidrGroupRef",
            "not supported by Cilia",
        ),
    ],
)
def test_bad_cidr_is_refused_with_its_path_and_fails_closed(
    manifest: dict[str, Any], path: str, message: str
) -> None:
    """The parser refuses the prefix with its path; an agent handed the manifest anyway
    (Kubernetes mode) makes the selected endpoint default-deny in that rule's direction:
    nothing the broken rule (or its earlier good version) allowed stays allowed."""
    with pytest.raises(InvalidPolicy) as info:
        parse_policy(manifest)
    assert {e.path: e.message for e in info.value.errors}.get(path) == message, info.value

    eng, _, _ = engine()
    good = np_egress("n", "192.0.2.0/24", []) if manifest["kind"] == "NetworkPolicy" else None
    if good is not None:
        eng.on_policies(upserts(good))
        assert peers(eng, 1), "the good version allows egress"
    result, _ = eng.on_policies(upserts(manifest))
    assert result.errors == []
    ((ref, judged),) = result.fail_closed
    assert path in {e.path for e in judged.errors}
    direction = 0 if ".ingress" in path else 1
    compiled = eng.compiled[1]
    assert (compiled.enforce_ingress, compiled.enforce_egress)[direction]
    assert peers(eng, direction) == set(), "nothing allowed in the broken rule's direction"
    assert ref in eng.repository.unenforced()


def test_host_bits_and_bare_addresses_are_canonical_prefixes() -> None:
    policy = parse_policy(cnp("c", {"egress": [{"toCIDR": ["192.0.2.77/24", "198.51.100.1"]}]}))
    assert isinstance(policy, CiliumNetworkPolicy)
    assert policy.spec is not None and policy.spec.egress is not None
    assert policy.spec.egress[0].to_cidr == ["192.0.2.0/24", "198.51.100.1/32"]


# ------------------------------------------------------------------ selection


def test_ipblock_selects_prefixes_inside_cidr_and_outside_except() -> None:
    eng, ipcache, table = engine()
    other = cnp(
        "others",
        {"ingress": [{"fromCIDR": ["192.0.2.64/26", "192.0.2.192/26", "198.51.100.0/24"]}]},
    )
    eng.on_policies(upserts(np_egress("n", "192.0.2.0/24", ["192.0.2.128/25"]), other))
    allowed = peers(eng, 1)
    assert allowed == {ident(eng, "192.0.2.0/24"), ident(eng, "192.0.2.64/26")}
    for outside in ("192.0.2.128/25", "192.0.2.192/26", "198.51.100.0/24"):
        assert ident(eng, outside) not in allowed, outside
    assert WORLD not in allowed
    named = ("192.0.2.0/24", "192.0.2.64/26", "192.0.2.128/25", "192.0.2.192/26")
    assert table.rows == {p: ident(eng, p) for p in (*named, "198.51.100.0/24")}
    # the datapath's longest match: X\Y → the /24's identity, Y → the except's
    assert ipcache.lookup("192.0.2.10") == Entry(ident(eng, "192.0.2.0/24"))
    assert ipcache.lookup("192.0.2.130") == Entry(ident(eng, "192.0.2.128/25"))


def test_all_addresses_except_a_block_also_selects_world() -> None:
    eng, _, table = engine()
    eng.on_policies(
        upserts(
            cnp(
                "c", {"egress": [{"toCIDRSet": [{"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}]}]}
            ),
            cnp("d", {"ingress": [{"fromCIDR": ["192.0.2.0/24", "10.1.0.0/16"]}]}),
        )
    )
    assert peers(eng, 1) == {WORLD, ident(eng, "192.0.2.0/24")}
    assert peers(eng, 0) == {ident(eng, "192.0.2.0/24"), ident(eng, "10.1.0.0/16")}
    assert "0.0.0.0/0" not in table.rows, "/0 is the world identity (an ipcache miss)"


def test_deny_variant_and_a_new_inner_prefix_recompiles_the_outer_rule() -> None:
    eng, _, _ = engine()
    deny = cnp("deny", {"egressDeny": [{"toCIDR": ["203.0.113.0/24"]}]})
    eng.on_policies(upserts(deny))
    outer = ident(eng, "203.0.113.0/24")
    assert eng.compiled[1].entries == {PolicyEntry(outer, 1, 0, 0): Verdict.DENY}
    # another policy names a /28 inside: its identity carries cidr:203.0.113.0/24, so the
    # deny rule covers it too (else that /28 would escape the deny)
    _, recompiled = eng.on_policies(
        upserts(cnp("inner", {"ingress": [{"fromCIDR": ["203.0.113.16/28"]}]}))
    )
    assert 1 in recompiled
    inner = ident(eng, "203.0.113.16/28")
    assert eng.compiled[1].entries[PolicyEntry(inner, 1, 0, 0)] is Verdict.DENY


# ------------------------------------------------------------------ refcounting


def test_prefixes_live_while_some_policy_names_them() -> None:
    eng, _, table = engine()
    eng.on_policies(
        upserts(
            np_egress("a", "192.0.2.0/24", ["192.0.2.128/25"]),
            cnp("b", {"egress": [{"toCIDR": ["192.0.2.0/24"]}]}),
        )
    )
    shared = ident(eng, "192.0.2.0/24")
    assert shared >= LOCAL_SCOPE and eng.cidr_identities.users("192.0.2.0/24") == 2

    eng.on_policies(delete("NetworkPolicy", "a"))
    assert table.rows == {"192.0.2.0/24": shared}, "the except prefix went with its only user"
    assert eng.identities.local_identities() == {shared}
    assert peers(eng, 1) == {shared}

    eng.on_policies(delete("CiliumNetworkPolicy", "b"))
    assert table.rows == {} and eng.identities.local_identities() == frozenset()
    assert eng.compiled[1].entries == {} and len(eng.cidr_identities) == 0


def test_changing_a_policy_swaps_its_prefixes() -> None:
    eng, _, table = engine()
    eng.on_policies(upserts(cnp("c", {"egress": [{"toCIDR": ["192.0.2.0/24"]}]})))
    eng.on_policies(upserts(cnp("c", {"egress": [{"toCIDR": ["198.51.100.0/24"]}]})))
    assert list(table.rows) == ["198.51.100.0/24"]
    assert peers(eng, 1) == {table.rows["198.51.100.0/24"]}
    assert eng.identities.local_identities() == {table.rows["198.51.100.0/24"]}


# ------------------------------------------------------------------ Hubble


class Labels:
    """Hubble's identity getter over the engine's cache (as ``IdentityAllocator.labels_of``)."""

    def __init__(self, eng: PolicyEngine) -> None:
        self.eng = eng

    def labels_of(self, identity: int) -> Sequence[str] | None:
        known = self.eng.identities.get(identity)
        return known.strings() if known is not None else None


def test_hubble_names_an_address_by_its_cidr_identity_and_pods_keep_theirs() -> None:
    eng, ipcache, _ = engine()
    ipcache.upsert_remote("192.0.2.5/32", Entry(CLIENT_ID + 1, "198.18.0.2", "prod/inside"))
    eng.on_policies(upserts(np_egress("n", "192.0.2.0/24", ["192.0.2.128/25"])))
    resolver = OwnerResolver(endpoints=None, ipcache=ipcache, identities=Labels(eng))

    ref = resolver.endpoint_by_ip("192.0.2.200")
    assert ref is not None and ref.identity == ident(eng, "192.0.2.128/25")
    labels = resolver.identity_labels(ref.identity)
    assert labels is not None
    assert "cidr:192.0.2.128/25" in labels and "cidr:192.0.2.0/24" in labels
    assert "reserved:world" in labels

    pod = resolver.endpoint_by_ip("192.0.2.5")
    assert pod is not None and (pod.identity, pod.pod_name) == (CLIENT_ID + 1, "inside")


def test_after_a_restart_pinned_cidr_identities_are_kept_or_removed_once_synced() -> None:
    table = Table()
    ipcache = IPCache([table])
    eng = PolicyEngine(prefixes=ipcache)
    kept, stale = LOCAL_SCOPE + 5, LOCAL_SCOPE + 9
    eng.restore_prefixes({"192.0.2.0/24": kept, "198.51.100.0/24": stale, "10.0.0.2/32": 300})
    assert table.rows == {"192.0.2.0/24": kept, "198.51.100.0/24": stale}
    eng.set_endpoint(1, ["k8s:app=client", NS], "prod")
    eng.on_identities(pb.WatchIdentitiesResponse(synced=True))
    assert table.rows["198.51.100.0/24"] == stale, "nothing is removed before both streams synced"
    eng.on_policies(upserts(cnp("c", {"egress": [{"toCIDR": ["192.0.2.0/24"]}]}), synced=True))
    assert table.rows == {"192.0.2.0/24": kept}
    assert eng.identities.local_identities() == {kept}
    assert peers(eng, 1) == {kept}, "the pinned policy entries stay right"


def test_world_entity_covers_cidr_identities_so_naming_a_prefix_breaks_no_world_rule() -> None:
    eng, _, _ = engine()
    eng.on_policies(upserts(cnp("w", {"egress": [{"toEntities": ["world"]}]})))
    assert peers(eng, 1) == {WORLD}
    _, recompiled = eng.on_policies(
        upserts(cnp("c", {"ingress": [{"fromCIDR": ["192.0.2.0/24"]}]}))
    )
    assert 1 in recompiled
    assert peers(eng, 1) == {WORLD, ident(eng, "192.0.2.0/24")}
    eng.on_policies(delete("CiliumNetworkPolicy", "c"))
    assert peers(eng, 1) == {WORLD}
