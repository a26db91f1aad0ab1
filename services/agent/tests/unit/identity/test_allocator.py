"""The agent's identity allocator: local cache of held identities, reference counts,
ordering of Allocate and Release at the operator, stream-driven re-allocation.

The operator is a fake that keeps what the real one keeps (label set -> number, this node's
reference per identity) and records every call; concurrency is real asyncio tasks, with
gates holding the fake's answers so the interleavings are forced, not hoped for.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.controlplane import OperatorUnavailable, RetryQueue
from cilia_agent.identity.allocator import IdentityAllocator
from cilia_agent.identity.cache import IdentityCache
from cilia_agent.identity.fake import FakeOperator
from cilia_agent.identity.watcher import consume_identities

WEB = ("k8s:app=web", "k8s:io.kubernetes.pod.namespace=default")
DB = ("k8s:app=db", "k8s:io.kubernetes.pod.namespace=default")


class Sink:
    def __init__(self) -> None:
        self.identities = IdentityCache()

    def on_identities(self, response: cp.WatchIdentitiesResponse) -> object:
        return self.identities.apply(response)


def make(backoff: float = 0.01) -> tuple[IdentityAllocator, FakeOperator, RetryQueue]:
    op = FakeOperator()
    retry = RetryQueue(min_backoff=backoff, max_backoff=backoff)
    return IdentityAllocator(op, retry, Sink()), op, retry  # type: ignore[arg-type]


async def settle(retry: RetryQueue, timeout: float = 2.0) -> None:
    """Wait until the retry queue is empty (releases and re-allocations done)."""
    async with asyncio.timeout(timeout):
        while retry.pending:
            await asyncio.sleep(0.005)


async def wait_until(cond: Any, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.002)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_concurrent_adds_of_one_label_set_make_one_operator_call() -> None:
    async def main() -> None:
        alloc, op, _ = make()
        got = await asyncio.gather(*(alloc.allocate(WEB, ep) for ep in range(1, 11)))
        assert set(got) == {256} and op.allocations() == 1
        assert alloc.users(256) == 10
        assert alloc.stats.cache_hits == 9 and alloc.stats.operator_allocations == 1
        # later ADDs: served from the cache, no call
        assert await alloc.allocate(WEB, 11) == 256 and op.allocations() == 1

    run(main())


def test_different_label_sets_are_allocated_concurrently() -> None:
    async def main() -> None:
        alloc, op, _ = make()
        got = await asyncio.gather(alloc.allocate(WEB, 1), alloc.allocate(DB, 2))
        assert sorted(got) == [256, 257] and op.max_in_flight == 2, "no global lock"

    run(main())


def test_one_del_of_two_keeps_the_identity_the_last_releases_it_once() -> None:
    async def main() -> None:
        alloc, op, retry = make()
        ident = await alloc.allocate(WEB, 1)
        assert await alloc.allocate(WEB, 2) == ident
        alloc.release(ident, 1)
        await settle(retry)
        assert op.releases() == [] and ident in op.referenced
        assert await alloc.allocate(WEB, 3) == ident and op.allocations() == 1
        alloc.release(ident, 2)
        alloc.release(ident, 3)
        await settle(retry)
        assert op.releases() == [ident] and ident not in op.referenced
        assert alloc.held(WEB) is None and alloc.users(ident) == 0
        assert ident not in alloc.local_identities()
        # labels back after the release: the operator is asked again
        assert await alloc.allocate(WEB, 4) == ident and op.allocations() == 2
        assert ident in op.referenced

    run(main())


def test_a_user_back_before_the_release_is_sent_keeps_it_without_any_call() -> None:
    async def main() -> None:
        alloc, op, retry = make()
        ident = await alloc.allocate(WEB, 1)
        alloc.release(ident, 1)  # the pod's DEL ...
        assert await alloc.allocate(WEB, 2) == ident  # ... and its new sandbox's ADD
        await settle(retry)
        assert op.calls == [("allocate", ident)], "no Release, no second Allocate"
        assert alloc.stats.skipped_releases == 1 and ident in op.referenced

    run(main())


def test_an_add_during_a_release_in_flight_waits_and_allocates_after_it() -> None:
    async def main() -> None:
        alloc, op, retry = make()
        ident = await alloc.allocate(WEB, 1)
        op.release_gate = asyncio.Event()
        alloc.release(ident, 1)
        assert alloc.held(WEB) == (ident, True), "still handed out until the Release is sent"
        # the Release is sent and held at the operator: not handed out any more
        await wait_until(lambda: alloc.held(WEB) == (ident, False))
        add = asyncio.create_task(alloc.allocate(WEB, 2))
        await asyncio.sleep(0.02)
        assert not add.done(), "the ADD waits for the Release"
        op.release_gate.set()
        assert await add == ident
        await settle(retry)
        assert op.calls == [("allocate", ident), ("release", ident), ("allocate", ident)]
        assert ident in op.referenced, "the operator's last word is the ADD's reference"
        assert alloc.users(ident) == 1 and alloc.held(WEB) == (ident, True)

    run(main())


def test_failed_allocation_takes_no_reference_and_caches_nothing() -> None:
    async def main() -> None:
        alloc, op, _ = make()
        op.fail_allocate = 1
        results = await asyncio.gather(
            alloc.allocate(WEB, 1), alloc.allocate(WEB, 2), return_exceptions=True
        )
        # the first failed; the waiter behind it asked again (the operator is back)
        assert isinstance(results[0], OperatorUnavailable) and results[1] == 256
        assert alloc.users(256) == 1 and op.allocations() == 1

    run(main())


def test_failed_release_is_retried_and_skipped_when_a_user_came_back() -> None:
    async def main() -> None:
        alloc, op, retry = make(backoff=0.3)
        ident = await alloc.allocate(WEB, 1)
        op.fail_release = 1
        alloc.release(ident, 1)
        # the first attempt failed (it may have reached the operator): unconfirmed
        await wait_until(lambda: op.fail_release == 0)
        assert alloc.held(WEB) == (ident, False)
        assert await alloc.allocate(WEB, 2) == ident
        assert op.allocations() == 2, "unconfirmed after a failed Release: the operator is asked"
        await settle(retry)
        assert op.releases() == [] and ident in op.referenced

    run(main())


def test_relabel_moves_the_reference() -> None:
    async def main() -> None:
        alloc, op, retry = make()
        web = await alloc.allocate(WEB, 1)
        assert await alloc.allocate(WEB, 2) == web
        db = await alloc.allocate(DB, 1)  # endpoint 1 relabelled web -> db
        alloc.release(web, 1)
        await settle(retry)
        assert alloc.users(web) == 1 and alloc.users(db) == 1 and op.releases() == []
        db2 = await alloc.allocate(DB, 2)  # endpoint 2 follows
        alloc.release(web, 2)
        await settle(retry)
        assert db2 == db and op.releases() == [web] and op.allocations() == 2

    run(main())


def test_restored_identities_are_confirmed_once_by_the_operator_before_reuse() -> None:
    async def main() -> None:
        alloc, op, retry = make()
        op.numbers[WEB] = 300  # the operator's record from before the restart
        op.referenced.add(300)
        for ep in (1, 2):  # Regeneration.restore: seed + register
            alloc.seed(WEB, 300)
            alloc.acquire(300, ep)
        assert alloc.held(WEB) == (300, False)
        assert await alloc.allocate(WEB, 3) == 300 and op.allocations() == 1
        assert await alloc.allocate(WEB, 4) == 300 and op.allocations() == 1
        for ep in (1, 2, 3, 4):
            alloc.release(300, ep)
        await settle(retry)
        assert op.releases() == [300] and alloc.held(WEB) is None

    run(main())


async def stream(*items: cp.WatchIdentitiesResponse) -> Any:
    for item in items:
        yield item


def event(kind: cp.EventType, identity: int, labels: tuple[str, ...]) -> cp.IdentityEvent:
    return cp.IdentityEvent(type=kind, identity=cp.Identity(id=identity, labels=list(labels)))


def test_a_held_identity_deleted_at_the_operator_is_allocated_again() -> None:
    async def main() -> None:
        alloc, op, retry = make()
        sink = alloc.sink
        web = await alloc.allocate(WEB, 1)
        alloc.learn(web, WEB)
        # the record is lost and its number given to other labels; the stream says so
        op.forget(WEB)
        await consume_identities(
            sink,
            alloc,
            stream(
                cp.WatchIdentitiesResponse(
                    events=[event(cp.EVENT_TYPE_UPSERT, web, WEB)], synced=True
                ),
                cp.WatchIdentitiesResponse(events=[event(cp.EVENT_TYPE_DELETE, web, WEB)]),
            ),
            lambda: None,
        )
        assert alloc.held(WEB) is not None and alloc.held(WEB) != (web, True), (
            "a stale cache must not hand the freed number out"
        )
        await settle(retry)
        moved, confirmed = alloc.held(WEB) or (0, False)
        assert confirmed and moved != web and moved in op.referenced
        assert await alloc.allocate(WEB, 2) == moved and op.allocations() == 2
        assert sink.identities.get(moved) is not None, "learned again"

    run(main())


def test_a_held_identity_missing_from_a_resync_listing_or_relabelled_is_reasserted() -> None:
    async def main() -> None:
        alloc, op, retry = make()
        web = await alloc.allocate(WEB, 1)
        db = await alloc.allocate(DB, 2)
        op.referenced.clear()  # the store lost this node's references
        await consume_identities(
            alloc.sink,
            alloc,
            stream(
                cp.WatchIdentitiesResponse(events=[event(cp.EVENT_TYPE_UPSERT, db, DB)]),
                cp.WatchIdentitiesResponse(synced=True),  # web not listed
                cp.WatchIdentitiesResponse(events=[event(cp.EVENT_TYPE_UPSERT, db, ("k8s:x=y",))]),
            ),
            lambda: None,
        )
        await settle(retry)
        assert op.referenced == {web, db}, "both references written again"
        assert alloc.held(WEB) == (web, True) and alloc.held(DB) == (db, True)
        assert op.allocations() == 4

    run(main())


@pytest.mark.parametrize("rounds", [30])
def test_churn_of_concurrent_adds_and_dels_never_leaks_or_drops_a_reference(rounds: int) -> None:
    async def main() -> None:
        alloc, op, retry = make()
        live: set[int] = set()

        async def add(ep: int) -> None:
            await alloc.allocate(WEB, ep)
            live.add(ep)

        for r in range(rounds):
            eps = range(r * 4, r * 4 + 4)
            await asyncio.gather(*(add(ep) for ep in eps))
            for ep in list(live)[: 3 + r % 2]:
                live.discard(ep)
                alloc.release(256, ep)
            await asyncio.sleep(0.001 * (r % 3))  # sometimes before, sometimes after a release
            assert alloc.users(256) == len(live)
            if live:
                assert 256 in op.referenced, "a used identity is referenced at the operator"
        for ep in list(live):
            alloc.release(256, ep)
        await settle(retry)
        assert 256 not in op.referenced and alloc.held(WEB) is None

    run(main())


def test_release_of_a_leftover_endpoints_identity_is_ordered_with_adds_of_its_labels() -> None:
    async def main() -> None:
        alloc, op, retry = make()
        op.numbers[WEB] = 300  # an endpoint of the previous run (crashed mid-ADD) held it
        op.referenced.add(300)
        op.allocate_gate, op.release_gate = asyncio.Event(), asyncio.Event()
        add = asyncio.create_task(alloc.allocate(WEB, 1))
        await wait_until(lambda: op.in_flight == 1)
        alloc.release_if_unused(300, WEB)  # Regeneration.forget of the leftover record
        await asyncio.sleep(0.02)
        op.allocate_gate.set()
        assert await add == 300
        op.release_gate.set()
        await settle(retry)
        assert op.releases() == [] and 300 in op.referenced, "the ADD's reference survives"

    run(main())


def test_a_user_restored_while_the_release_is_in_flight_gets_the_reference_back() -> None:
    async def main() -> None:
        alloc, op, retry = make()
        ident = await alloc.allocate(WEB, 1)
        op.release_gate = asyncio.Event()
        alloc.release(ident, 1)
        await wait_until(lambda: alloc.held(WEB) == (ident, False))  # Release sent
        alloc.acquire(ident, 2)  # Regeneration.restore registers an endpoint (no lock)
        op.release_gate.set()
        await settle(retry)
        assert op.calls == [("allocate", ident), ("release", ident), ("allocate", ident)]
        assert ident in op.referenced and alloc.held(WEB) == (ident, True)

    run(main())
