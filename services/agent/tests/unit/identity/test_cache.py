"""Identity cache fed by WatchIdentities messages (real controlplane_pb2 messages)."""

from __future__ import annotations

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_agent.identity.cache import IdentityCache, IdentityChange
from cilia_agent.identity.labels import LabelSet
from cilia_agent.policy.selector import Requirement, Selector

UPSERT, DELETE = pb.EVENT_TYPE_UPSERT, pb.EVENT_TYPE_DELETE


def event(kind: pb.EventType, id_: int, *labels: str) -> pb.IdentityEvent:
    return pb.IdentityEvent(type=kind, identity=pb.Identity(id=id_, labels=list(labels)))


def msg(*events: pb.IdentityEvent, synced: bool = False) -> pb.WatchIdentitiesResponse:
    return pb.WatchIdentitiesResponse(events=list(events), synced=synced)


WEB = ("k8s:app=web", "k8s:io.kubernetes.pod.namespace=prod")
DB = ("k8s:app=db", "k8s:io.kubernetes.pod.namespace=prod")


def test_cache_starts_with_reserved_identities_only() -> None:
    cache = IdentityCache()
    assert list(cache) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert cache.get(1) == LabelSet.of(["reserved:host"])
    assert not cache.synced


def test_initial_listing_fills_cache_and_reports_changes() -> None:
    cache = IdentityCache()
    changes = cache.apply(msg(event(UPSERT, 256, *WEB), event(UPSERT, 257, *DB), synced=True))

    assert [c.id for c in changes] == [256, 257]
    assert changes[0] == IdentityChange(256, None, LabelSet.of(WEB))
    assert cache.get(257) == LabelSet.of(DB)
    assert cache.synced


def test_unchanged_upsert_reports_nothing_and_keeps_revision() -> None:
    cache = IdentityCache()
    cache.apply(msg(event(UPSERT, 256, *WEB)))
    revision = cache.revision
    assert cache.apply(msg(event(UPSERT, 256, *reversed(WEB)))) == []
    assert cache.revision == revision


def test_delete_reports_old_labels_and_unknown_delete_is_ignored() -> None:
    cache = IdentityCache()
    cache.apply(msg(event(UPSERT, 256, *WEB)))
    changes = cache.apply(msg(event(DELETE, 256), event(DELETE, 999)))
    assert changes == [IdentityChange(256, LabelSet.of(WEB), None)]
    assert 256 not in cache


def test_invalid_events_are_skipped_and_the_rest_applies() -> None:
    cache = IdentityCache()
    changes = cache.apply(
        msg(
            event(UPSERT, 0, "k8s:app=x"),  # id 0 is "unknown"
            event(UPSERT, 2, "k8s:app=x"),  # reserved world cannot be relabelled
            event(UPSERT, 300, "k8s:"),  # malformed label
            event(DELETE, 1),  # reserved host is never removed
            event(UPSERT, 256, *WEB),
        )
    )
    assert [c.id for c in changes] == [256]
    assert cache.get(2) == LabelSet.of(["reserved:world"])
    assert 1 in cache and 300 not in cache


def test_resync_removes_identities_the_new_stream_does_not_list() -> None:
    cache = IdentityCache()
    cache.apply(msg(event(UPSERT, 256, *WEB), event(UPSERT, 257, *DB), synced=True))

    cache.begin_resync()
    first = cache.apply(msg(event(UPSERT, 256, *WEB)))
    assert first == [] and not cache.synced
    last = cache.apply(msg(synced=True))

    assert last == [IdentityChange(257, LabelSet.of(DB), None)]
    assert list(cache) == [1, 2, 3, 4, 5, 6, 7, 8, 256]


def test_matching_returns_identities_selected_and_follows_changes() -> None:
    cache = IdentityCache()
    cache.apply(msg(event(UPSERT, 256, *WEB), event(UPSERT, 257, *DB)))
    web = Selector.match_labels(app="web")
    host = Selector(frozenset({Requirement.parse("reserved:host", "Exists")}))

    assert cache.matching(web) == {256}
    assert cache.matching(host) == {1}
    assert cache.matching(Selector()) == {1, 2, 3, 4, 5, 6, 7, 8, 256, 257}

    cache.apply(msg(event(UPSERT, 258, "k8s:app=web", "k8s:io.kubernetes.pod.namespace=dev")))
    assert cache.matching(web) == {256, 258}
    assert cache.cluster_identities() == {256, 257, 258}
