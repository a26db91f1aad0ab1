"""ONE Store test suite, run against every backend: a real redis-server and the Kubernetes
backend on a real kube-apiserver (``make_store``). resourceVersions are opaque (Kubernetes
API conventions: clients compare them for equality only, never order or count them): a test
compares the versions a watch reports with the ones its own writes returned. The one case a
real server cannot be made to show on demand, a watch from a version its history no longer
holds (410 Expired), runs on Redis with a history cut to three events. See stores.py."""

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import redis
from stores import make_store

from cilia_operator.store import AlreadyExists, Conflict, Expired, NotFound, Store, WatchEvent
from cilia_operator.store.redis import RedisStore

# the parametrized fixture: (redis, real kubernetes)
__all__ = ["make_store"]

StoreFactory = Callable[..., Store]


def obj(name: str, value: int = 0, kind: str = "Thing") -> dict[str, Any]:
    return {
        "apiVersion": "test.cilia.io/v1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": {"v": value},
    }


def version(stored: dict[str, Any]) -> str:
    """The object's resourceVersion: an opaque non-empty string."""
    rv = stored["metadata"]["resourceVersion"]
    assert isinstance(rv, str) and rv, stored
    return rv


async def test_create_get_update_delete_roundtrip_bumps_resource_version(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    try:
        created = await store.create(obj("a"))
        assert version(created) and created["metadata"]["uid"]
        got = await store.get("Thing", "a")
        assert got == created
        got["spec"]["v"] = 7
        updated = await store.update(got)
        assert version(updated) != version(created)
        assert (await store.get("Thing", "a"))["spec"] == {"v": 7}
        deleted = await store.delete("Thing", "a")
        assert deleted["spec"] == {"v": 7}
        with pytest.raises(NotFound):
            await store.get("Thing", "a")
        with pytest.raises(NotFound):
            await store.delete("Thing", "a")
    finally:
        await store.close()


async def test_create_of_existing_raises_already_exists(make_store: StoreFactory) -> None:
    store = make_store()
    try:
        await store.create(obj("a"))
        with pytest.raises(AlreadyExists):
            await store.create(obj("a", 1))
        assert (await store.get("Thing", "a"))["spec"] == {"v": 0}
    finally:
        await store.close()


async def test_update_with_stale_resource_version_raises_conflict_and_changes_nothing(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    try:
        first = await store.create(obj("a"))
        # a change: a real API server answers an update that changes nothing with the same
        # version (no write)
        second = await store.update({**first, "spec": {"v": 1}})
        stale = {**first, "spec": {"v": 99}}
        with pytest.raises(Conflict) as err:
            await store.update(stale)
        assert err.value.current == version(second) and err.value.expected == version(first)
        assert (await store.get("Thing", "a"))["spec"] == {"v": 1}
        with pytest.raises(Conflict):
            await store.delete("Thing", "a", resource_version=version(first))
        assert version(await store.get("Thing", "a")) == version(second)
        with pytest.raises(NotFound):
            await store.update(obj("missing"))
    finally:
        await store.close()


async def test_update_without_resource_version_is_unconditional(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    try:
        created = await store.create(obj("a"))
        second = await store.update(obj("a", 1))
        blind = await store.update(obj("a", 2))
        assert len({version(created), version(second), version(blind)}) == 3
        assert (await store.get("Thing", "a"))["spec"] == {"v": 2}
    finally:
        await store.close()


async def test_concurrent_updates_from_the_same_version_let_exactly_one_win(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    try:
        base = await store.create(obj("a"))
        # every update changes the object: a real API server answers an update that changes
        # nothing with success and the same resourceVersion (no write), so it cannot conflict
        results = await asyncio.gather(
            *(store.update({**base, "spec": {"v": i}}) for i in range(1, 11)),
            return_exceptions=True,
        )
        assert sum(not isinstance(r, Exception) for r in results) == 1
        assert all(isinstance(r, Conflict) for r in results if isinstance(r, Exception))
        winner = next(r for r in results if not isinstance(r, BaseException))
        assert (await store.get("Thing", "a"))["spec"] == winner["spec"]
    finally:
        await store.close()


async def test_concurrent_creates_of_one_name_let_exactly_one_win(make_store: StoreFactory) -> None:
    store = make_store()
    try:
        results = await asyncio.gather(
            *(store.create(obj("a", i)) for i in range(8)), return_exceptions=True
        )
        assert sum(not isinstance(r, Exception) for r in results) == 1
        assert all(isinstance(r, AlreadyExists) for r in results if isinstance(r, Exception))
    finally:
        await store.close()


async def test_namespaced_objects_are_keyed_by_namespace(make_store: StoreFactory) -> None:
    store = make_store()
    try:
        a = {**obj("x", 1, kind="Scoped"), "metadata": {"name": "x", "namespace": "a"}}
        b = {**obj("x", 2, kind="Scoped"), "metadata": {"name": "x", "namespace": "b"}}
        await store.create(a)
        await store.create(b)
        assert (await store.get("Scoped", "x", "a"))["spec"] == {"v": 1}
        assert (await store.get("Scoped", "x", "b"))["spec"] == {"v": 2}
        listed = await store.list("Scoped")
        assert [(o["metadata"]["namespace"], o["spec"]["v"]) for o in listed.items] == [
            ("a", 1), ("b", 2),
        ]  # fmt: skip
        await store.delete("Scoped", "x", "a")
        with pytest.raises(NotFound):
            await store.get("Scoped", "x", "a")
        assert (await store.get("Scoped", "x", "b"))["spec"] == {"v": 2}
    finally:
        await store.close()


async def test_list_returns_items_and_a_version_to_watch_from(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    try:
        await store.create(obj("b"))
        await store.create(obj("a"))
        await store.create(obj("other", kind="Other"))
        listed = await store.list("Thing")
        assert [o["metadata"]["name"] for o in listed.items] == ["a", "b"]
        assert isinstance(listed.resource_version, str) and listed.resource_version

        seen: list[WatchEvent] = []

        async def follow() -> None:
            async for event in store.watch("Thing", listed.resource_version):
                seen.append(event)
                if len(seen) == 3:
                    return

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.1)
        a = await store.get("Thing", "a")
        modified = await store.update({**a, "spec": {"v": 5}})
        added = await store.create(obj("c"))
        await store.create(obj("ignored", kind="Other"))
        await store.delete("Thing", "b")
        await asyncio.wait_for(task, 5)
        assert [(e.type, e.object["metadata"]["name"]) for e in seen] == [
            ("MODIFIED", "a"), ("ADDED", "c"), ("DELETED", "b"),
        ]  # fmt: skip
        # each event carries the version its write returned; the deletion's is a new one
        assert seen[0].resource_version == version(modified)
        assert seen[1].resource_version == version(added)
        assert seen[2].resource_version not in (version(modified), version(added))
        assert seen[0].object["spec"] == {"v": 5}
        assert version(seen[0].object) == version(modified)
        assert seen[2].object["spec"] == {"v": 0}
    finally:
        await store.close()


async def test_watch_from_an_old_version_replays_history_in_order(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    try:
        versions = [version(await store.create(obj(f"n{i}"))) for i in range(5)]
        events = []
        async for event in store.watch("Thing", versions[1]):
            events.append(event.object["metadata"]["name"])
            if len(events) == 3:
                break
        assert events == ["n2", "n3", "n4"]
    finally:
        await store.close()


async def test_watch_from_a_trimmed_version_raises_expired(redis_server: str) -> None:
    """Redis only: its history can be cut to three events on demand (a real API server's is
    etcd's, compacted on its own schedule)."""
    redis.Redis.from_url(redis_server).flushall()
    store = RedisStore(redis_server, event_history=3, watch_block_timeout=0.5)
    try:
        versions = [version(await store.create(obj(f"n{i}"))) for i in range(6)]
        with pytest.raises(Expired):
            async for _ in store.watch("Thing", versions[0]):
                pass
        # from the oldest kept event's predecessor the history is complete
        names = []
        async for event in store.watch("Thing", versions[2]):
            names.append(event.object["metadata"]["name"])
            if len(names) == 3:
                break
        assert names == ["n3", "n4", "n5"]
    finally:
        await store.close()


async def test_watch_from_a_seen_version_replays_what_followed(make_store: StoreFactory) -> None:
    """The replay above with versions as the store returned them (opaque on a real server):
    from the version of the 2nd create, the 3rd to 5th follow, in order."""
    store = make_store()
    try:
        made = [await store.create(obj(f"n{i}")) for i in range(5)]
        events = []
        async for event in store.watch("Thing", made[1]["metadata"]["resourceVersion"]):
            events.append((event.type, event.object["metadata"]["name"]))
            if len(events) == 3:
                break
        assert events == [("ADDED", "n2"), ("ADDED", "n3"), ("ADDED", "n4")]
    finally:
        await store.close()


async def test_a_stale_version_conflicts_and_changes_nothing(make_store: StoreFactory) -> None:
    """The conflict test above without counting versions: an update or delete carrying the
    version an object had before a change is refused; the change stays."""
    store = make_store()
    try:
        first = await store.create(obj("a"))
        changed = await store.update({**first, "spec": {"v": 1}})
        assert changed["metadata"]["resourceVersion"] != first["metadata"]["resourceVersion"]
        with pytest.raises(Conflict) as err:
            await store.update({**first, "spec": {"v": 99}})
        assert err.value.expected == first["metadata"]["resourceVersion"]
        with pytest.raises(Conflict):
            await store.delete("Thing", "a", resource_version=first["metadata"]["resourceVersion"])
        assert (await store.get("Thing", "a"))["spec"] == {"v": 1}
    finally:
        await store.close()


async def test_returned_objects_are_copies(make_store: StoreFactory) -> None:
    store = make_store()
    try:
        source = obj("a")
        created = await store.create(source)
        assert "resourceVersion" not in source["metadata"]
        created["spec"]["v"] = 42
        assert (await store.get("Thing", "a"))["spec"] == {"v": 0}
    finally:
        await store.close()


async def test_status_is_stored_with_the_object_even_behind_a_status_subresource(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    try:
        made = await store.create({**obj("a", kind="Statusful"), "status": {"phase": "new"}})
        assert made["status"] == {"phase": "new"}
        assert (await store.get("Statusful", "a"))["status"] == {"phase": "new"}
        changed = await store.update({**made, "spec": {"v": 1}, "status": {"phase": "done"}})
        got = await store.get("Statusful", "a")
        assert got["spec"] == {"v": 1} and got["status"] == {"phase": "done"}
        assert got["metadata"]["resourceVersion"] == changed["metadata"]["resourceVersion"]
        with pytest.raises(Conflict):
            await store.update({**made, "status": {"phase": "stale"}})
        assert (await store.get("Statusful", "a"))["status"] == {"phase": "done"}
    finally:
        await store.close()


async def test_kubernetes_store_unreachable_is_store_unavailable(tmp_path: Any) -> None:
    from cilia_operator.app import Operator, StartupError
    from cilia_operator.config import Config
    from cilia_operator.store import StoreUnavailable
    from cilia_operator.store.kubernetes import KubernetesStore
    from cilia_testkit.kubeconfig import write_kubeconfig

    kubeconfig = write_kubeconfig("http://127.0.0.1:9", tmp_path / "kc")
    store = KubernetesStore(kubeconfig=str(kubeconfig), request_timeout=2)
    try:
        with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:9"):
            await store.get("CiliumNode", "n1")
    finally:
        await store.close()
    missing = KubernetesStore(kubeconfig=str(tmp_path / "missing"))
    with pytest.raises(StoreUnavailable, match="missing"):
        await missing.list("CiliumNode")
    op = Operator(Config(store="kubernetes", kubeconfig=str(kubeconfig), prometheus_serve_addr=""))
    with pytest.raises(StartupError, match=r"127\.0\.0\.1:9"):
        await op.start()
    await op.stop()
    with pytest.raises(ValueError, match="no Kubernetes resource mapping"):
        await KubernetesStore(kubeconfig=str(kubeconfig)).get("Bogus", "x")


async def test_watch_spans_reconnects_without_gaps_or_duplicates(make_store: StoreFactory) -> None:
    store = make_store()
    try:
        since = (await store.list("Thing")).resource_version
        seen: list[str] = []

        async def follow() -> None:
            async for event in store.watch("Thing", since):
                seen.append(event.object["metadata"]["name"])
                if len(seen) == 3:
                    return

        task = asyncio.create_task(follow())
        for name in ("a", "b", "c"):
            await store.create(obj(name))
            await asyncio.sleep(1.2)  # longer than one watch request (kubernetes: 1 s)
        await asyncio.wait_for(task, 10)
        assert seen == ["a", "b", "c"]
    finally:
        await store.close()


async def test_redis_store_ping_of_a_server_that_is_not_redis_is_store_unavailable() -> None:
    """A --store URL naming a port where something else answers (an HTTP server) is a
    one-line StartupError, not redis-py's InvalidResponse traceback."""
    from cilia_operator.app import Operator, StartupError
    from cilia_operator.config import Config
    from cilia_operator.store import StoreUnavailable
    from cilia_operator.store.redis import RedisStore

    async def http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    try:
        store = RedisStore(url, connect_timeout=2, request_timeout=2)
        try:
            with pytest.raises(
                StoreUnavailable, match=r"does not answer as Redis: .*HTTP/1\.1 400"
            ):
                await store.ping()
        finally:
            await store.close()
        op = Operator(Config(store=url, prometheus_serve_addr=""))
        with pytest.raises(StartupError, match=f"redis store {url} does not answer as Redis"):
            await op.start()
        await op.stop()
    finally:
        server.close()
        await server.wait_closed()


async def test_redis_watch_waiting_at_the_head_gets_each_write_or_expired_when_trimmed_past(
    redis_server: str,
) -> None:
    """A redis watch that waits for new entries (the pipelined XREAD BLOCK + trimmed-marker
    read) yields every later write in order with its version; when one atomic batch of
    writes trims the history past where it waits, it raises Expired instead of skipping
    the trimmed events."""
    from cilia_operator.store import Write
    from cilia_operator.store.redis import RedisStore

    store = RedisStore(redis_server, prefix="watchhead/", event_history=3)
    try:
        start = (await store.create(obj("n0")))["metadata"]["resourceVersion"]
        seen: list[tuple[str, str]] = []

        async def follow(count: int) -> None:
            async for event in store.watch("Thing", start):
                seen.append((event.object["metadata"]["name"], event.resource_version))
                if len(seen) == count:
                    return

        task = asyncio.create_task(follow(2))
        await asyncio.sleep(0.3)  # the watch is waiting at the head
        first = await store.create(obj("n1"))
        await asyncio.sleep(0.1)
        second = await store.update({**first, "spec": {"v": 2}})
        await asyncio.wait_for(task, 10)
        assert seen == [
            ("n1", first["metadata"]["resourceVersion"]),
            ("n1", second["metadata"]["resourceVersion"]),
        ]

        start = second["metadata"]["resourceVersion"]
        task = asyncio.create_task(follow(100))
        await asyncio.sleep(0.3)

        async def six(_: Any) -> list[Write]:
            return [Write("create", obj(f"m{i}")) for i in range(6)]

        await store.transact(["Thing"], six)  # 6 events at once; 3 are kept
        with pytest.raises(Expired):
            await asyncio.wait_for(task, 10)
        assert len(seen) == 2
    finally:
        await store.close()
