"""Store.transact on both backends (real redis-server; real kube-apiserver)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from stores import make_store

from cilia_operator.store import Conflict, Snapshot, Store, StoreError, Write

__all__ = ["make_store"]  # the parametrized fixture (redis, kubernetes)

StoreFactory = Callable[..., Store]


def thing(name: str, **extra: Any) -> dict[str, Any]:
    return {"apiVersion": "test.cilia.io/v1", "kind": "Thing", "metadata": {"name": name},
            **extra}  # fmt: skip


async def test_transact_reads_a_snapshot_and_writes_every_write(make_store: StoreFactory) -> None:
    store = make_store()
    try:
        first = await store.create(thing("a", spec={"n": 1}))
        seen: list[list[str]] = []

        async def plan(snapshot: Snapshot) -> list[Write]:
            seen.append([o["metadata"]["name"] for o in snapshot["Thing"].items])
            current = snapshot["Thing"].items[0]
            return [
                Write("update", {**current, "spec": {"n": 2}}),
                Write("create", thing("b")),
                Write("create", {"apiVersion": "test.cilia.io/v1", "kind": "Other",
                                 "metadata": {"name": "o"}}),
            ]  # fmt: skip

        out = await store.transact(["Thing", "Other"], plan)
        assert seen == [["a"]]
        assert [o["metadata"]["name"] for o in out] == ["a", "b", "o"]
        assert int(out[0]["metadata"]["resourceVersion"]) > int(
            first["metadata"]["resourceVersion"]
        )
        assert (await store.get("Thing", "a"))["spec"] == {"n": 2}
        assert (await store.get("Other", "o"))["metadata"]["name"] == "o"
    finally:
        await store.close()


async def test_transact_whose_plan_raises_writes_nothing(make_store: StoreFactory) -> None:
    store = make_store()
    try:

        async def plan(snapshot: Snapshot) -> list[Write]:
            raise ValueError("refused")

        with pytest.raises(ValueError, match="refused"):
            await store.transact(["Thing"], plan)
        assert (await store.list("Thing")).items == []
    finally:
        await store.close()


async def test_transact_refuses_a_write_of_a_kind_it_did_not_read(make_store: StoreFactory) -> None:
    store = make_store()
    try:

        async def plan(snapshot: Snapshot) -> list[Write]:
            return [Write("create", thing("x"))]

        with pytest.raises(ValueError, match="transaction writes Thing but reads only Other"):
            await store.transact(["Other"], plan)
        assert (await store.list("Thing")).items == []
    finally:
        await store.close()


async def test_transact_deletes_with_the_writes_and_a_changed_one_is_a_conflict(
    make_store: StoreFactory,
) -> None:
    store = make_store()
    try:
        await store.create(thing("x"))
        await store.create(thing("y"))

        async def plan(snapshot: Snapshot) -> list[Write]:
            return [Write("delete", o) for o in snapshot["Thing"].items]

        out = await store.transact(["Thing"], plan)
        assert sorted(o["metadata"]["name"] for o in out) == ["x", "y"]
        assert (await store.list("Thing")).items == []
        # a delete carries the listed resourceVersion: a changed object is not deleted
        stale = await store.create(thing("z"))
        await store.update({**stale, "spec": {"n": 1}})

        async def stale_plan(snapshot: Snapshot) -> list[Write]:
            return [Write("delete", stale)]

        with pytest.raises(StoreError) as err:  # Redis: the queued write's status; K8s: Conflict
            await store.transact(["Thing"], stale_plan)
        assert "conflict" in str(err.value).lower() or isinstance(err.value, Conflict)
        assert [o["metadata"]["name"] for o in (await store.list("Thing")).items] == ["z"]
    finally:
        await store.close()
