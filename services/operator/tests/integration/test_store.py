"""Store semantics against a real redis-server."""

import asyncio
from typing import Any

import pytest

from cilia_operator.store import AlreadyExists, Conflict, Expired, NotFound, WatchEvent
from cilia_operator.store.redis import RedisStore


def obj(name: str, value: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": "test/v1",
        "kind": "Thing",
        "metadata": {"name": name},
        "spec": {"v": value},
    }


async def test_create_get_update_delete_roundtrip_bumps_resource_version(redis_url: str) -> None:
    store = RedisStore(redis_url)
    try:
        created = await store.create(obj("a"))
        assert created["metadata"]["resourceVersion"] == "1" and created["metadata"]["uid"]
        got = await store.get("Thing", "a")
        assert got == created
        got["spec"]["v"] = 7
        updated = await store.update(got)
        assert updated["metadata"]["resourceVersion"] == "2"
        assert (await store.get("Thing", "a"))["spec"] == {"v": 7}
        deleted = await store.delete("Thing", "a")
        assert deleted["spec"] == {"v": 7}
        with pytest.raises(NotFound):
            await store.get("Thing", "a")
    finally:
        await store.close()


async def test_create_of_existing_raises_already_exists(redis_url: str) -> None:
    store = RedisStore(redis_url)
    try:
        await store.create(obj("a"))
        with pytest.raises(AlreadyExists):
            await store.create(obj("a", 1))
        assert (await store.get("Thing", "a"))["spec"] == {"v": 0}
    finally:
        await store.close()


async def test_update_with_stale_resource_version_raises_conflict_and_changes_nothing(
    redis_url: str,
) -> None:
    store = RedisStore(redis_url)
    try:
        first = await store.create(obj("a"))
        await store.update(first)
        stale = {**first, "spec": {"v": 99}}
        with pytest.raises(Conflict) as err:
            await store.update(stale)
        assert err.value.current == "2"
        assert (await store.get("Thing", "a"))["spec"] == {"v": 0}
        with pytest.raises(Conflict):
            await store.delete("Thing", "a", resource_version="1")
        with pytest.raises(NotFound):
            await store.update(obj("missing"))
    finally:
        await store.close()


async def test_concurrent_updates_from_the_same_version_let_exactly_one_win(redis_url: str) -> None:
    store = RedisStore(redis_url)
    try:
        base = await store.create(obj("a"))
        results = await asyncio.gather(
            *(store.update({**base, "spec": {"v": i}}) for i in range(10)), return_exceptions=True
        )
        assert sum(not isinstance(r, Exception) for r in results) == 1
        assert all(isinstance(r, Conflict) for r in results if isinstance(r, Exception))
    finally:
        await store.close()


async def test_list_returns_items_and_a_version_to_watch_from(redis_url: str) -> None:
    store = RedisStore(redis_url)
    try:
        await store.create(obj("b"))
        await store.create(obj("a"))
        await store.create({**obj("other"), "kind": "Other"})
        listed = await store.list("Thing")
        assert [o["metadata"]["name"] for o in listed.items] == ["a", "b"]
        assert listed.resource_version == "3"

        seen: list[WatchEvent] = []

        async def follow() -> None:
            async for event in store.watch("Thing", listed.resource_version):
                seen.append(event)
                if len(seen) == 3:
                    return

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.1)
        a = await store.get("Thing", "a")
        await store.update({**a, "spec": {"v": 5}})
        await store.create(obj("c"))
        await store.delete("Thing", "b")
        await asyncio.wait_for(task, 5)
        assert [(e.type, e.object["metadata"]["name"]) for e in seen] == [
            ("MODIFIED", "a"), ("ADDED", "c"), ("DELETED", "b"),
        ]  # fmt: skip
        assert [e.resource_version for e in seen] == ["4", "5", "6"]
        assert seen[0].object["spec"] == {"v": 5}
        assert seen[0].object["metadata"]["resourceVersion"] == "4"
    finally:
        await store.close()


async def test_watch_from_an_old_version_replays_history_in_order(redis_url: str) -> None:
    store = RedisStore(redis_url)
    try:
        for i in range(5):
            await store.create(obj(f"n{i}"))
        events = []
        async for event in store.watch("Thing", "2"):
            events.append(event.object["metadata"]["name"])
            if len(events) == 3:
                break
        assert events == ["n2", "n3", "n4"]
    finally:
        await store.close()


async def test_watch_from_a_trimmed_version_raises_expired(redis_url: str) -> None:
    store = RedisStore(redis_url, event_history=3)
    try:
        for i in range(6):
            await store.create(obj(f"n{i}"))
        with pytest.raises(Expired):
            async for _ in store.watch("Thing", "1"):
                pass
        # from the oldest kept event's predecessor the history is complete
        names = []
        async for event in store.watch("Thing", "3"):
            names.append(event.object["metadata"]["name"])
            if len(names) == 3:
                break
        assert names == ["n3", "n4", "n5"]
    finally:
        await store.close()
