"""Redis backend of :class:`~cilia_operator.store.base.Store` (standalone mode).

Layout under a key prefix (default ``cilia/``), per kind ``K``:

- ``<p>rv``: the store-wide resourceVersion counter (INCR on every write).
- ``<p>objects/K``: hash ``"<namespace>/<name>"`` -> object JSON (without resourceVersion).
- ``<p>versions/K``: hash ``"<namespace>/<name>"`` -> resourceVersion of that object.
- ``<p>events/K``: stream of changes; entry id ``<rv>-0``, fields ``type``, ``key``,
  ``object``; capped at ``event_history`` entries (XADD ``MAXLEN``).
- ``<p>trimmed/K``: resourceVersion of the newest event trimmed from the stream, so a
  watch knows exactly whether its history is complete (XINFO's ``max-deleted-entry-id``
  does not count trimming).

A transaction (:meth:`RedisStore.transact`) ``WATCH``es the version hashes of the kinds
it reads, reads them, lets the caller check and choose writes, and queues those writes
(the same Lua script each) between ``MULTI`` and ``EXEC``: Redis runs all of them or,
when a watched hash changed meanwhile, none; the transaction then starts over.

Every write is one Lua script: check the current version, write the JSON, INCR the
counter, trim and XADD the event -- atomic, so the object, its version and the event
stream never disagree. A watch reads the stream with an atomic "history complete? then
XRANGE" script, then waits for new entries with ``XREAD BLOCK`` pipelined with a read of
the trimmed marker (one round trip per wake-up; :meth:`RedisStore.watch`).

Source: the design mirrors Cilium's etcd kvstore mode and Kubernetes' resourceVersion /
410 Gone watch semantics (reference: DESIGN.md §3).
"""

from __future__ import annotations

import asyncio
import builtins
import datetime as _dt
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions

from .base import (
    AlreadyExists,
    Conflict,
    Contention,
    Expired,
    ListResult,
    NotFound,
    Resource,
    Store,
    StoreError,
    StoreUnavailable,
    TransactionPlan,
    WatchEvent,
    Write,
    check_write_kinds,
    object_key,
    resource_version,
    with_resource_version,
)

T = TypeVar("T")

LIST_OFFLOAD_ITEMS = 500
"""Lists of at least this many objects are decoded in a worker thread, not on the event
loop (which keeps serving RPCs and streams meanwhile)."""

_WRITE = """
-- KEYS: rv counter, objects hash, versions hash, events stream, trimmed marker
-- ARGV: op (create|update|delete), field, json, expected rv ('' = any), max stream length
local cur = redis.call('HGET', KEYS[3], ARGV[2])
if ARGV[1] == 'create' then
  if cur then return {'exists', cur, ''} end
else
  if not cur then return {'notfound', '', ''} end
  if ARGV[4] ~= '' and ARGV[4] ~= cur then return {'conflict', cur, ''} end
end
local rv = redis.call('INCR', KEYS[1])
local body = ARGV[3]
local etype = 'MODIFIED'
if ARGV[1] == 'delete' then
  body = redis.call('HGET', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[2], ARGV[2])
  redis.call('HDEL', KEYS[3], ARGV[2])
  etype = 'DELETED'
else
  if ARGV[1] == 'create' then etype = 'ADDED' end
  redis.call('HSET', KEYS[2], ARGV[2], body)
  redis.call('HSET', KEYS[3], ARGV[2], rv)
end
local maxlen = tonumber(ARGV[5])
local len = redis.call('XLEN', KEYS[4])
if len >= maxlen then
  local gone = redis.call('XRANGE', KEYS[4], '-', '+', 'COUNT', len - maxlen + 1)
  redis.call('SET', KEYS[5], string.match(gone[#gone][1], '^(%d+)'))
end
redis.call('XADD', KEYS[4], 'MAXLEN', maxlen, rv .. '-0',
  'type', etype, 'key', ARGV[2], 'object', body)
return {'ok', tostring(rv), body}
"""

_READ_EVENTS = """
-- KEYS: events stream, trimmed marker; ARGV: since rv, max entries
local trimmed = redis.call('GET', KEYS[2]) or '0'
if tonumber(trimmed) > tonumber(ARGV[1]) then return {'expired', trimmed} end
return {'ok', redis.call('XRANGE', KEYS[1], '(' .. ARGV[1] .. '-0', '+', 'COUNT', ARGV[2])}
"""

_LIST = """
-- KEYS: rv counter, objects hash, versions hash
return {redis.call('GET', KEYS[1]) or '0', redis.call('HGETALL', KEYS[2]),
        redis.call('HGETALL', KEYS[3])}
"""

_GET = """
-- KEYS: objects hash, versions hash; ARGV: field
return {redis.call('HGET', KEYS[1], ARGV[1]), redis.call('HGET', KEYS[2], ARGV[1])}
"""


def _field(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def _split(field: str) -> tuple[str, str]:
    namespace, _, name = field.partition("/")
    return namespace, name


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _loaded(body: str | bytes, rv: str) -> Resource:
    """A stored JSON body as a fresh object with ``metadata.resourceVersion`` ``rv`` (set in
    place: ``json.loads`` made it, so the deep copy of :func:`with_resource_version` is not
    needed -- it was half the time of a 10,000-object list)."""
    obj: Resource = json.loads(body)
    obj.setdefault("metadata", {})["resourceVersion"] = rv
    return obj


def _copied(obj: Resource) -> Resource:
    """A deep copy of ``obj`` through JSON (what will be stored), without
    ``metadata.resourceVersion`` (the versions hash holds it)."""
    body: Resource = json.loads(json.dumps(obj))
    body.get("metadata", {}).pop("resourceVersion", None)
    return body


def _serialized(body: Resource) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def _for_create(obj: Resource) -> tuple[Resource, str]:
    """``(object as stored, its JSON)`` for a create: a copy of ``obj`` with ``uid`` and
    ``creationTimestamp`` set unless given and an empty namespace left out. One JSON copy
    and one serialisation (it was three and two, plus a deep copy of the result)."""
    stored = _copied(obj)
    meta = stored.setdefault("metadata", {})
    meta.setdefault("uid", str(uuid.uuid4()))
    meta.setdefault("creationTimestamp", _now())
    if not meta.get("namespace"):
        meta.pop("namespace", None)
    return stored, _serialized(stored)


class RedisStore(Store):
    """Store backed by one Redis database.

    Args:
        url: ``redis://HOST:PORT/DB`` (also ``rediss://``, ``unix://``).
        prefix: key prefix, so several stores can share a database.
        event_history: events kept per kind for watches (stream MAXLEN, >= 1); a watch
            further behind raises :class:`Expired`.
        watch_block_timeout: seconds one ``XREAD BLOCK`` waits before polling again (> 0).
        watch_batch_size: max events read per round trip by a watch (>= 1).
        connect_timeout: seconds to wait for a TCP connection (> 0).
        request_timeout: seconds to wait for a reply (> 0); a blocking watch read may
            take ``watch_block_timeout`` longer.

    Raises (from every method):
        StoreUnavailable: Redis cannot be reached.
    """

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "cilia/",
        event_history: int = 10000,
        watch_block_timeout: float = 5.0,
        watch_batch_size: int = 500,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
    ) -> None:
        if event_history < 1:
            raise ValueError(f"event_history must be >= 1, got {event_history}")
        if watch_batch_size < 1:
            raise ValueError(f"watch_batch_size must be >= 1, got {watch_batch_size}")
        if min(watch_block_timeout, connect_timeout, request_timeout) <= 0:
            raise ValueError("watch_block_timeout, connect_timeout, request_timeout must be > 0")
        self.url = url
        self._prefix = prefix
        self._history = event_history
        self._block_ms = max(1, int(watch_block_timeout * 1000))
        self._batch = watch_batch_size
        self._r: Any = aioredis.Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=connect_timeout,
            socket_timeout=request_timeout + watch_block_timeout,
        )
        self._write = self._r.register_script(_WRITE)
        self._read_events = self._r.register_script(_READ_EVENTS)
        self._list = self._r.register_script(_LIST)
        self._get = self._r.register_script(_GET)

    def _keys(self, kind: str) -> dict[str, str]:
        p = self._prefix
        return {
            "rv": f"{p}rv",
            "objects": f"{p}objects/{kind}",
            "versions": f"{p}versions/{kind}",
            "events": f"{p}events/{kind}",
            "trimmed": f"{p}trimmed/{kind}",
        }

    async def _call(self, pending: Awaitable[T]) -> T:
        try:
            return await pending
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoreUnavailable(f"redis store {self.url} unreachable: {exc}") from exc

    async def ping(self) -> None:
        """Check that Redis answers.

        Raises:
            StoreUnavailable: it does not, or what answers is not a usable Redis (another
                protocol on the port, a DB index the server does not have, NOAUTH): the
                operator's start-up reports it in one line instead of a traceback.
        """
        try:
            await self._call(self._r.ping())
        except redis.exceptions.RedisError as exc:
            raise StoreUnavailable(
                f"redis store {self.url} does not answer as Redis: {exc}"
            ) from exc

    async def get(self, kind: str, name: str, namespace: str = "") -> Resource:
        k = self._keys(kind)
        body, rv = await self._call(
            self._get(keys=[k["objects"], k["versions"]], args=[_field(namespace, name)])
        )
        if body is None:
            raise NotFound(kind, namespace, name)
        return _loaded(body, str(rv))

    async def list(self, kind: str) -> ListResult:
        k = self._keys(kind)
        rv, flat_objects, flat_versions = await self._call(
            self._list(keys=[k["rv"], k["objects"], k["versions"]])
        )
        versions = dict(zip(flat_versions[::2], flat_versions[1::2], strict=True))
        objects = dict(zip(flat_objects[::2], flat_objects[1::2], strict=True))

        def load() -> list[Resource]:
            return [
                _loaded(objects[field], str(versions.get(field, "")))
                for field in sorted(objects, key=_split)
            ]

        # decoding 10,000 policies of 5 KB takes about a second: off the event loop
        big = len(objects) >= LIST_OFFLOAD_ITEMS
        items = await asyncio.to_thread(load) if big else load()
        return ListResult(items=items, resource_version=str(rv))

    async def _run_write(
        self, op: str, kind: str, namespace: str, name: str, body: str, expected: str
    ) -> tuple[str, str]:
        k = self._keys(kind)
        status, value, stored = await self._call(
            self._write(
                keys=[k["rv"], k["objects"], k["versions"], k["events"], k["trimmed"]],
                args=[op, _field(namespace, name), body, expected, self._history],
            )
        )
        if status == "exists":
            raise AlreadyExists(kind, namespace, name)
        if status == "notfound":
            raise NotFound(kind, namespace, name)
        if status == "conflict":
            raise Conflict(kind, namespace, name, expected, str(value))
        return str(value), str(stored)

    async def create(self, obj: Resource) -> Resource:
        kind, namespace, name = object_key(obj)
        stored, body = _for_create(obj)
        rv, _ = await self._run_write("create", kind, namespace, name, body, "")
        stored["metadata"]["resourceVersion"] = rv  # our own copy: returned, never kept
        return stored

    async def update(self, obj: Resource) -> Resource:
        kind, namespace, name = object_key(obj)
        stored = _copied(obj)
        body = _serialized(stored)
        rv, _ = await self._run_write("update", kind, namespace, name, body, resource_version(obj))
        stored.setdefault("metadata", {})["resourceVersion"] = rv
        return stored

    async def delete(
        self, kind: str, name: str, namespace: str = "", resource_version: str = ""
    ) -> Resource:
        rv, body = await self._run_write("delete", kind, namespace, name, "", resource_version)
        return _loaded(body, rv)

    def _prepare(self, write: Write) -> tuple[builtins.list[str], builtins.list[Any], Resource]:
        """Keys, script args and the object as it will be stored, for one write."""
        kind, namespace, name = object_key(write.obj)
        k = self._keys(kind)
        keys = [k["rv"], k["objects"], k["versions"], k["events"], k["trimmed"]]
        if write.op == "create":
            stored, body = _for_create(write.obj)
            args = ["create", _field(namespace, name), body, "", self._history]
        elif write.op == "delete":
            stored = _copied(write.obj)
            args = ["delete", _field(namespace, name), "", resource_version(write.obj),
                    self._history]  # fmt: skip
        else:
            stored = _copied(write.obj)
            args = [
                "update", _field(namespace, name), _serialized(stored),
                resource_version(write.obj), self._history,
            ]  # fmt: skip
        return keys, args, stored

    async def transact(
        self, kinds: Sequence[str], plan: TransactionPlan, *, attempts: int = 5
    ) -> builtins.list[Resource]:
        """All-or-nothing: ``WATCH`` the kinds' version hashes, read, plan, then
        ``MULTI``/``EXEC`` every write (see :meth:`Store.transact`). A client that gives
        up part-way (deadline, cancellation) leaves nothing written unless ``EXEC``
        reached Redis, and then everything.

        Raises:
            Contention: a watched kind changed during every attempt (concurrent writers).
            StoreError: Redis refused a queued write (cannot happen while the watch holds).
        """
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts}")
        kinds = list(dict.fromkeys(kinds))
        watched = [self._keys(kind)["versions"] for kind in kinds]
        for _ in range(attempts):
            async with self._r.pipeline(transaction=True) as pipe:
                await self._call(pipe.watch(*watched))
                snapshot = {}
                for kind in kinds:
                    k = self._keys(kind)
                    rv = await self._call(pipe.get(k["rv"]))
                    flat_objects = await self._call(pipe.hgetall(k["objects"]))
                    versions = await self._call(pipe.hgetall(k["versions"]))
                    items = [
                        _loaded(flat_objects[f], str(versions.get(f, "")))
                        for f in sorted(flat_objects, key=_split)
                    ]
                    snapshot[kind] = ListResult(items=items, resource_version=str(rv or "0"))
                writes = list(await plan(snapshot))
                check_write_kinds(kinds, writes)
                if not writes:
                    return []
                prepared = [self._prepare(w) for w in writes]
                pipe.multi()
                for keys, args, _ in prepared:
                    await self._write(keys=keys, args=args, client=pipe)  # queued
                try:
                    replies = await self._call(pipe.execute())
                except redis.exceptions.WatchError:
                    continue
            out = []
            for (status, value, _), (_, _, stored), write in zip(
                replies, prepared, writes, strict=True
            ):
                if status != "ok":
                    kind, namespace, name = object_key(write.obj)
                    raise StoreError(f"transaction write of {kind} {namespace}/{name}: {status}")
                out.append(with_resource_version(stored, str(value)))
            return out
        raise Contention(", ".join(kinds), "", "(transaction)")

    async def _wait_events(
        self, k: dict[str, str], last: str
    ) -> tuple[builtins.list[tuple[str, dict[str, str]]], str]:
        """One round trip: ``XREAD BLOCK`` of the entries after ``last`` (up to the batch
        size; none after ``watch_block_timeout``), then ``GET`` of the trimmed marker,
        pipelined on one connection, so Redis reads the marker after the entries.
        Returns ``([(entry id, fields)], marker)``."""
        pipe = self._r.pipeline(transaction=False)
        pipe.xread({k["events"]: f"{last}-0"}, count=self._batch, block=self._block_ms)
        pipe.get(k["trimmed"])
        reply, trimmed = await self._call(pipe.execute())
        return (list(reply[0][1]) if reply else []), str(trimmed or "0")

    async def watch(self, kind: str, since: str) -> AsyncIterator[WatchEvent]:
        """See :meth:`Store.watch`. The history after ``since`` is read with the atomic
        "complete? then XRANGE" script (and again after a full batch); then each wait
        for new entries is one pipelined round trip (:meth:`_wait_events`) whose entries
        are used as they are: the trimmed marker read after them only grows, so when it
        is still <= ``last`` nothing after ``last`` was trimmed before the entries were
        read, and when it is not the watch raises :class:`Expired` (an entry trimmed
        between the two reads makes it relist once more than needed: never a lost
        event). Before, every event cost each watch three round trips (the wake-up
        ``XREAD``, the script's read, the script's empty read) -- with three watches of
        CiliumEndpoint in the operator, nine per endpoint change.
        """
        k = self._keys(kind)
        last = str(int(since or "0"))
        catch_up = True
        while True:
            if catch_up:
                reply = await self._call(
                    self._read_events(keys=[k["events"], k["trimmed"]], args=[last, self._batch])
                )
                if reply[0] == "expired":
                    raise Expired(kind, last, str(reply[1]))
                entries = [
                    (entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
                    for entry_id, flat in reply[1]
                ]
            else:
                entries, trimmed = await self._wait_events(k, last)
                if int(trimmed) > int(last):
                    raise Expired(kind, last, trimmed)
            # a full batch may have more behind it: read on with the script
            catch_up = len(entries) >= self._batch
            for entry_id, fields in entries:
                last = entry_id.split("-", 1)[0]
                yield WatchEvent(
                    type=fields["type"],
                    object=_loaded(fields["object"], last),
                    resource_version=last,
                )

    async def close(self) -> None:
        await self._r.aclose()
