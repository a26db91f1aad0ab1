"""Node-local CIDR identities: labels, numbering, refcounting, and their place in the cache."""

from __future__ import annotations

import ipaddress

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_agent.identity.cache import IdentityCache, InvalidIdentity
from cilia_agent.identity.cidr import (
    LOCAL_SCOPE,
    CIDRError,
    CIDRIdentityAllocator,
    LocalIdentitiesExhausted,
    cidr_labels,
    is_local_identity,
    parse_ipv4_prefix,
)


def test_labels_are_the_prefix_its_super_prefixes_and_world() -> None:
    labels = cidr_labels(ipaddress.IPv4Network("10.0.0.0/8")).strings()
    assert labels[:3] == ("cidr:0.0.0.0/0", "cidr:0.0.0.0/1", "cidr:0.0.0.0/2")
    assert "cidr:8.0.0.0/6" in labels and "cidr:10.0.0.0/7" in labels
    assert "cidr:10.0.0.0/8" in labels and "cidr:10.0.0.0/9" not in labels
    assert labels[-1] == "reserved:world" and len(labels) == 8 + 1 + 1
    assert cidr_labels(ipaddress.IPv4Network("0.0.0.0/0")).strings() == ("reserved:world",)


def test_parse_masks_host_bits_and_refuses_ipv6_and_garbage() -> None:
    assert str(parse_ipv4_prefix("10.1.2.3/8")) == "10.0.0.0/8"
    assert str(parse_ipv4_prefix("192.0.2.7")) == "192.0.2.7/32"
    with pytest.raises(CIDRError, match="IPv6 CIDR 'fd00::/8' not supported by Cilia"):
        parse_ipv4_prefix("fd00::/8")
    with pytest.raises(CIDRError, match="not a valid CIDR"):
        parse_ipv4_prefix("10.0.0.300/8")


def test_numbers_are_local_scope_refcounted_by_users_and_reused() -> None:
    alloc = CIDRIdentityAllocator()
    first = alloc.update("p1", ["192.0.2.0/24", "192.0.2.128/25", "0.0.0.0/0"])
    assert [(a.prefix, a.identity) for a in first.added] == [
        ("192.0.2.0/24", LOCAL_SCOPE + 1),
        ("192.0.2.128/25", LOCAL_SCOPE + 2),
    ], "/0 is the world identity: no allocation"
    assert all(is_local_identity(a.identity) for a in first.added)
    assert not is_local_identity(LOCAL_SCOPE) and not is_local_identity(65535)

    second = alloc.update("p2", ["192.0.2.0/24"])
    assert not second and alloc.users("192.0.2.0/24") == 2

    gone = alloc.update("p1", [])
    assert [r.prefix for r in gone.removed] == ["192.0.2.128/25"]
    assert alloc.get("192.0.2.0/24") is not None and alloc.users("192.0.2.0/24") == 1

    last = alloc.update("p2", [])
    assert [r.identity for r in last.removed] == [LOCAL_SCOPE + 1] and len(alloc) == 0
    again = alloc.update("p3", ["198.51.100.0/24"])
    assert again.added[0].identity == LOCAL_SCOPE + 1, "the lowest free number is reused"


def test_errors_change_nothing() -> None:
    alloc = CIDRIdentityAllocator(max_index=2)
    alloc.update("p1", ["10.0.0.0/8"])
    with pytest.raises(CIDRError):
        alloc.update("p1", ["10.0.0.0/8", "fd00::/8"])
    with pytest.raises(LocalIdentitiesExhausted):
        alloc.update("p2", ["10.1.0.0/16", "10.2.0.0/16"])
    assert [a.prefix for a in alloc.allocations()] == ["10.0.0.0/8"]
    assert alloc.users("10.0.0.0/8") == 1 and alloc.users("10.1.0.0/16") == 0


def test_cache_keeps_local_identities_apart_from_the_stream() -> None:
    cache = IdentityCache()
    labels = cidr_labels(ipaddress.IPv4Network("192.0.2.0/24"))
    change = cache.upsert_local(LOCAL_SCOPE + 1, labels)
    assert change is not None and change.new == labels
    with pytest.raises(InvalidIdentity, match="node-local"):
        cache.upsert(LOCAL_SCOPE + 2, ["k8s:app=x"])
    with pytest.raises(InvalidIdentity, match="not a node-local"):
        cache.upsert_local(300, ["k8s:app=x"])
    assert LOCAL_SCOPE + 1 not in cache.cluster_identities()

    cache.begin_resync()
    delete_local = pb.IdentityEvent(
        type=pb.EVENT_TYPE_DELETE, identity=pb.Identity(id=LOCAL_SCOPE + 1)
    )
    changes = cache.apply(pb.WatchIdentitiesResponse(events=[delete_local], synced=True))
    assert changes == [] and cache.get(LOCAL_SCOPE + 1) == labels
    assert cache.local_identities() == {LOCAL_SCOPE + 1}


def test_restored_numbers_are_kept_for_prefixes_named_again() -> None:
    alloc = CIDRIdentityAllocator()
    alloc.restore("192.0.2.0/24", LOCAL_SCOPE + 7)
    alloc.restore("198.51.100.0/24", LOCAL_SCOPE + 3)
    alloc.restore("203.0.113.0/24", LOCAL_SCOPE + 7)  # number taken: ignored
    alloc.restore("10.0.0.0/8", 300)  # not local: ignored
    delta = alloc.update("p", ["192.0.2.0/24", "10.0.0.0/8"])
    assert {a.prefix: a.identity for a in delta.added} == {
        "192.0.2.0/24": LOCAL_SCOPE + 7,
        "10.0.0.0/8": LOCAL_SCOPE + 1,
    }, "a new prefix takes the lowest number no restored prefix keeps"
    stale = alloc.drop_restored()
    assert [(s.prefix, s.identity) for s in stale] == [("198.51.100.0/24", LOCAL_SCOPE + 3)]
    assert alloc.update("q", ["203.0.113.0/24"]).added[0].identity == LOCAL_SCOPE + 2
