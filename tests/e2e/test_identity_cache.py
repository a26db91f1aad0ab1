"""The agent's cache of held identities against the real operator and store.

Two pods with the same labels on one node: the first ADD allocates the identity at the
operator (which writes the node's reference into the CiliumIdentity); the second is served
from the agent's cache and makes no ``IdentityService.Allocate`` call. The call is
detected in the store itself: before the second ADD the test puts the GC's
``io.cilium.heartbeat`` mark on the record, and any Allocate from this node rewrites the
record and clears the mark (``IdentityAllocator._ensure_identity`` in the operator). The
identity stays referenced by the node while one pod uses it and is released (the node's
reference removed) after the last DEL.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
from collections.abc import Callable
from typing import Any

from cilia_operator.identity import records
from cilia_operator.store import resource_version
from cilia_operator.store.redis import RedisStore
from cilia_testkit import bpfmaps, cni, host
from cilia_testkit.stack import Stack

RELEASE_TIMEOUT_SECONDS = 20.0
"""How long the queued Release after the last DEL may take to reach the store."""


async def _identity_of(store: RedisStore, label: str) -> dict[str, Any] | None:
    for record in (await store.list(records.KIND)).items:
        labels = records.record_labels(record)
        if labels is not None and label in labels.strings():
            return record
    return None


def _read(stack: Stack, label: str) -> dict[str, Any] | None:
    async def main() -> dict[str, Any] | None:
        store = RedisStore(stack.redis_url)
        try:
            return await _identity_of(store, label)
        finally:
            await store.close()

    return asyncio.run(main())


def _mark(stack: Stack, record: dict[str, Any]) -> dict[str, Any]:
    async def main() -> dict[str, Any]:
        store = RedisStore(stack.redis_url)
        try:
            marked = records.with_heartbeat(record, dt.datetime.now(dt.UTC))
            return await store.update(marked)
        finally:
            await store.close()

    return asyncio.run(main())


def test_second_add_with_the_same_labels_is_served_from_the_agents_cache(
    stack: Stack, make_pod: Callable[..., cni.Pod], conflist: dict[str, Any]
) -> None:
    app = f"idcache-{os.getpid()}"
    label = f"k8s:app={app}"
    node = stack.agent.node_name
    first = make_pod(labels={"app": app})
    first.add(conflist).check()
    record = _read(stack, label)
    assert record is not None, f"no CiliumIdentity with {label} after the first ADD"
    identity = records.identity_id(record)
    assert node in records.node_references(record)

    marked = _mark(stack, record)
    second = make_pod(labels={"app": app})
    second.add(conflist).check()
    after = _read(stack, label)
    assert after is not None and records.identity_id(after) == identity
    assert records.heartbeat(after) is not None, "an Allocate would have cleared the mark"
    assert resource_version(after) == resource_version(marked), "the record was not written"
    # both pods carry the identity in the datapath
    holders = [ep for ep in bpfmaps.bpf_endpoints(stack.agent.pin_dir).values()]
    assert sum(1 for ep in holders if ep["identity"] == identity) == 2, holders

    first.delete(conflist).check()
    kept = _read(stack, label)
    assert kept is not None and node in records.node_references(kept), "one pod still uses it"

    second.delete(conflist).check()

    def released() -> bool:
        current = _read(stack, label)
        return current is None or node not in records.node_references(current)

    assert host.wait_for(released, RELEASE_TIMEOUT_SECONDS), (
        f"the node's reference to {identity} was not released after the last DEL: {_read(stack, label)}"
    )
