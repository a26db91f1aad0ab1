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

import json
import os
import subprocess
from collections.abc import Callable
from typing import Any

from cilia_testkit import VENV_BIN, bpfmaps, cni, host
from cilia_testkit.stack import Stack

RELEASE_TIMEOUT_SECONDS = 20.0
"""How long the queued Release after the last DEL may take to reach the store."""

STORE_TIMEOUT_SECONDS = 60.0
"""Deadline of one store read (redis-cli) or write (the project's Python, start-up included)."""

# Runs in the project's venv (the e2e env has only pytest and the test kit): finds the
# CiliumIdentity whose labels hold argv[2] in the store at argv[1], puts the GC's heartbeat
# mark on it (a precondition-checked store update) and prints the record as JSON (null: none).
_MARK_SCRIPT = """
import asyncio, datetime, json, sys
from cilia_operator.identity import records
from cilia_operator.store.redis import RedisStore

async def main():
    store = RedisStore(sys.argv[1])
    try:
        for record in (await store.list(records.KIND)).items:
            labels = records.record_labels(record)
            if labels is not None and sys.argv[2] in labels.strings():
                now = datetime.datetime.now(datetime.UTC)
                return await store.update(records.with_heartbeat(record, now))
        return None
    finally:
        await store.close()

print(json.dumps(asyncio.run(main())))
"""


def _mark(stack: Stack, label: str) -> dict[str, Any] | None:
    """GC-mark the CiliumIdentity holding ``label``; the marked record (None: no such)."""
    out = subprocess.run(
        [str(VENV_BIN / "python"), "-c", _MARK_SCRIPT, stack.redis_url, label],
        capture_output=True,
        text=True,
        timeout=STORE_TIMEOUT_SECONDS,
        check=True,
    )
    record = json.loads(out.stdout)
    assert record is None or isinstance(record, dict)
    return record


def _record(stack: Stack, identity: int) -> dict[str, Any] | None:
    """CiliumIdentity ``identity`` as the store holds it (the Redis store's layout:
    object JSON in hash ``cilia/objects/<kind>``, its version in ``cilia/versions/<kind>``,
    field ``<namespace>/<name>``), read with redis-cli (no Python start-up per read)."""
    values = []
    for table in ("objects", "versions"):
        out = subprocess.run(
            ["redis-cli", "-s", str(stack.redis_socket), "--raw", "HGET",
             f"cilia/{table}/CiliumIdentity", f"/{identity}"],
            capture_output=True,
            text=True,
            timeout=STORE_TIMEOUT_SECONDS,
            check=True,
        )  # fmt: skip
        values.append(out.stdout.strip())
    if not values[0]:
        return None
    record = json.loads(values[0])
    assert isinstance(record, dict)
    record.setdefault("metadata", {})["resourceVersion"] = values[1]
    return record


def _references(record: dict[str, Any] | None) -> set[str]:
    annotations = (record or {}).get("metadata", {}).get("annotations", {})
    return {n for n in annotations.get("cilia.io/node-references", "").split(",") if n}


def _marked(record: dict[str, Any]) -> bool:
    return "io.cilium.heartbeat" in record.get("metadata", {}).get("annotations", {})


def _version(record: dict[str, Any]) -> str:
    return str(record.get("metadata", {}).get("resourceVersion", ""))


def test_second_add_with_the_same_labels_is_served_from_the_agents_cache(
    stack: Stack, make_pod: Callable[..., cni.Pod], conflist: dict[str, Any]
) -> None:
    app = f"idcache-{os.getpid()}"
    label = f"k8s:app={app}"
    node = stack.agent.node_name
    first = make_pod(labels={"app": app})
    first.add(conflist).check()
    marked = _mark(stack, label)
    assert marked is not None, f"no CiliumIdentity with {label} after the first ADD"
    identity = int(marked["metadata"]["name"])
    assert node in _references(marked) and _marked(marked)

    second = make_pod(labels={"app": app})
    second.add(conflist).check()
    after = _record(stack, identity)
    assert after is not None
    assert _marked(after), "an Allocate from the node would have cleared the mark"
    assert _version(after) == _version(marked), "the record was not written"
    # both pods carry the identity in the datapath
    holders = list(bpfmaps.bpf_endpoints(stack.agent.pin_dir).values())
    assert sum(1 for ep in holders if ep["identity"] == identity) == 2, holders

    first.delete(conflist).check()
    assert node in _references(_record(stack, identity)), "one pod still uses it"

    second.delete(conflist).check()
    assert host.wait_for(
        lambda: node not in _references(_record(stack, identity)), RELEASE_TIMEOUT_SECONDS
    ), f"the node's reference to {identity} not released: {_record(stack, identity)}"
