"""CiliumEndpointSlices: the operator batches CiliumEndpoints (``--enable-cilium-endpoint-slice``).

Upstream's operator groups CiliumEndpoints into cluster-scoped ``CiliumEndpointSlice``
objects (``cilium.io/v2alpha1``) so that consumers watch a few slices instead of one object
per pod. Slicing as upstream's identity mode: a slice holds endpoints of one namespace and
one security identity, at most ``--ces-max-ciliumendpoints-per-ces`` (100) of them; an
endpoint stays in its slice while its group does not change (no churn when others come
and go); a new endpoint joins a slice of its group with room, else a new slice named
``ces-<10 random characters>``; a slice left empty is deleted. Writes to the store are
rate-limited (``--ces-write-qps-limit`` per second, bursts of ``--ces-write-qps-burst``)
and a slice changed several times before its turn is written once.

Slice shape (upstream ``CiliumEndpointSlice``)::

    metadata.name                 ces-…
    namespace                     the endpoints' namespace
    endpoints[]                   {name: pod, id: identity,
                                   networking: {addressing: [{ipv4}], node: node IP}}

In Cilia the agents never watch the API server: they learn every remote endpoint from the
operator's ``WatchIPCache`` stream, which is the fan-out upstream's slices exist to make
cheap. The slices are kept for everything else that reads them (and as upstream keeps
them, for ``kubectl``); the identity garbage collector counts an identity referenced by
any slice as alive.

Source: upstream ``operator/pkg/ciliumendpointslice`` (slicing modes, batching, rate
limits; reference: cilium-upstream.md §8).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiolimiter import AsyncLimiter

from ..store import Conflict, Expired, NotFound, Resource, Store, WatchEvent
from . import records

log = logging.getLogger(__name__)

KIND = "CiliumEndpointSlice"
API_VERSION = "cilium.io/v2alpha1"
NAME_PREFIX = "ces-"
_ALPHABET = string.ascii_lowercase + string.digits

EndpointKey = tuple[str, str]  # namespace, name
Group = tuple[str, int]  # namespace, identity


@dataclass(frozen=True)
class CoreEndpoint:
    """One slice member (upstream ``CoreCiliumEndpoint``)."""

    name: str
    identity: int
    ipv4: str
    node_ip: str

    def as_dict(self) -> dict[str, Any]:
        """The member as it is written in the slice."""
        networking: dict[str, Any] = {"addressing": [{"ipv4": self.ipv4}]}
        if self.node_ip:
            networking["node"] = self.node_ip
        return {"name": self.name, "id": self.identity, "networking": networking}


def core_endpoint(record: Resource) -> tuple[EndpointKey, Group, CoreEndpoint] | None:
    """Key, group and member of a CiliumEndpoint record (None: no identity or address)."""
    status = record.get("status") or {}
    meta = record.get("metadata") or {}
    identity = int((status.get("identity") or {}).get("id") or 0)
    networking = status.get("networking") or {}
    addressing = networking.get("addressing") or []
    ipv4 = str(addressing[0].get("ipv4") or "") if addressing else ""
    if identity <= 0 or not ipv4:
        return None
    namespace = str(meta.get("namespace") or records.DEFAULT_NAMESPACE)
    name = str(meta.get("name") or "")
    member = CoreEndpoint(name, identity, ipv4, str(networking.get("node") or ""))
    return (namespace, name), (namespace, identity), member


@dataclass
class Slice:
    """One slice being kept: its group and members."""

    name: str
    group: Group
    members: dict[str, CoreEndpoint] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        """The slice object (members sorted by name)."""
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": self.name},
            "namespace": self.group[0],
            "endpoints": [self.members[n].as_dict() for n in sorted(self.members)],
        }


def slice_identities(record: Mapping[str, Any]) -> set[int]:
    """Identities a slice object references."""
    out = set()
    for ep in record.get("endpoints") or []:
        if isinstance(ep, Mapping) and int(ep.get("id") or 0) > 0:
            out.add(int(ep["id"]))
    return out


class Slicer:
    """Which slice each endpoint is in (pure bookkeeping, no I/O).

    Args:
        max_per_slice: ``--ces-max-ciliumendpoints-per-ces`` (>= 1).
        new_name: makes a name for a new slice (random by default).
    """

    def __init__(self, max_per_slice: int, new_name: Any = None) -> None:
        if max_per_slice < 1:
            raise ValueError("--ces-max-ciliumendpoints-per-ces: must be >= 1")
        self.max_per_slice = max_per_slice
        self._new_name = new_name or (
            lambda: NAME_PREFIX + "".join(secrets.choice(_ALPHABET) for _ in range(10))
        )
        self.slices: dict[str, Slice] = {}
        self._where: dict[EndpointKey, str] = {}
        self.dirty: set[str] = set()

    def adopt(self, record: Mapping[str, Any]) -> None:
        """Take an existing slice object (operator start): its members stay in it."""
        name = str((record.get("metadata") or {}).get("name") or "")
        if not name:
            return
        namespace = str(record.get("namespace") or records.DEFAULT_NAMESPACE)
        identities = slice_identities(record)
        if len(identities) != 1:
            self.dirty.add(name)  # mixed or empty: rewritten (or deleted) from its members
        kept = Slice(name, (namespace, min(identities) if identities else 0))
        for ep in record.get("endpoints") or []:
            if not isinstance(ep, Mapping) or not ep.get("name"):
                continue
            addressing = (ep.get("networking") or {}).get("addressing") or [{}]
            member = CoreEndpoint(
                str(ep["name"]),
                int(ep.get("id") or 0),
                str(addressing[0].get("ipv4") or ""),
                str((ep.get("networking") or {}).get("node") or ""),
            )
            if member.identity != kept.group[1] or (namespace, member.name) in self._where:
                self.dirty.add(name)
                continue
            kept.members[member.name] = member
            self._where[(namespace, member.name)] = name
        self.slices[name] = kept

    def keys(self) -> set[EndpointKey]:
        """Every endpoint in some slice."""
        return set(self._where)

    def upsert(self, key: EndpointKey, group: Group, member: CoreEndpoint) -> None:
        """Put an endpoint in its group's slice (moving it when its group changed)."""
        current = self._where.get(key)
        if current is not None:
            kept = self.slices[current]
            if kept.group == group:
                if kept.members.get(member.name) != member:
                    kept.members[member.name] = member
                    self.dirty.add(current)
                return
            self.delete(key)
        target = next(
            (
                s
                for s in sorted(self.slices.values(), key=lambda s: (-len(s.members), s.name))
                if s.group == group and len(s.members) < self.max_per_slice
            ),
            None,
        )
        if target is None:
            name = self._new_name()
            while name in self.slices:
                name = self._new_name()
            target = self.slices[name] = Slice(name, group)
        target.members[member.name] = member
        self._where[key] = target.name
        self.dirty.add(target.name)

    def delete(self, key: EndpointKey) -> None:
        """Take an endpoint out of its slice."""
        current = self._where.pop(key, None)
        if current is None:
            return
        self.slices[current].members.pop(key[1], None)
        self.dirty.add(current)

    def take_dirty(self) -> list[tuple[str, dict[str, Any] | None]]:
        """Slices to write (``(name, object)``) or delete (``(name, None)``), once each."""
        out: list[tuple[str, dict[str, Any] | None]] = []
        for name in sorted(self.dirty):
            kept = self.slices.get(name)
            if kept is None or not kept.members:
                self.slices.pop(name, None)
                out.append((name, None))
            else:
                out.append((name, kept.record()))
        self.dirty.clear()
        return out


class SliceController:
    """Keeps the store's CiliumEndpointSlices in step with its CiliumEndpoints.

    Args:
        store: the Store.
        max_per_slice: ``--ces-max-ciliumendpoints-per-ces``.
        qps / burst: ``--ces-write-qps-limit`` / ``--ces-write-qps-burst`` (the names of
            upstream's operator before ``ces-rate-limits`` replaced them).
        retry_interval: seconds after a store error before trying again.
        sync_counter: ``cilium_operator_ces_sync_total`` (labels: outcome), optional.

    ``await start()`` lists slices and endpoints, then watches endpoints and writes slices in
    the background; ``await stop()``. Run it on the leader only.
    """

    def __init__(
        self,
        store: Store,
        *,
        max_per_slice: int = 100,
        qps: float = 10.0,
        burst: int = 20,
        retry_interval: float = 1.0,
        sync_counter: Any = None,
    ) -> None:
        self.store = store
        self.sync_counter = sync_counter
        self.slicer = Slicer(max_per_slice)
        self.limiter = AsyncLimiter(burst, burst / qps)
        self.retry_interval = retry_interval
        self.writes = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def _apply(self, items: Iterable[Resource]) -> None:
        listed: dict[EndpointKey, tuple[Group, CoreEndpoint]] = {}
        for record in items:
            parsed = core_endpoint(record)
            if parsed is not None:
                listed[parsed[0]] = (parsed[1], parsed[2])
        for key in self.slicer.keys() - set(listed):
            self.slicer.delete(key)
        for key, (group, member) in listed.items():
            self.slicer.upsert(key, group, member)
        self._wake.set()

    def on_event(self, event: WatchEvent) -> None:
        """One CiliumEndpoint change."""
        parsed = core_endpoint(event.object)
        if event.type == "DELETED" or parsed is None:
            self.slicer.delete(_key_of(event.object))
        else:
            self.slicer.upsert(*parsed)
        self._wake.set()

    async def start(self) -> None:
        """Adopt the stored slices, slice every endpoint, then follow changes.

        Raises:
            StoreError: the initial lists failed.
        """
        for record in (await self.store.list(KIND)).items:
            self.slicer.adopt(record)
        listed = await self.store.list(records.KIND)
        self._apply(listed.items)
        self._tasks = [
            asyncio.create_task(self._watch(listed.resource_version), name="ces-watch"),
            asyncio.create_task(self._writer(), name="ces-writer"),
        ]

    async def stop(self) -> None:
        """Cancel the watch and the writer."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def _watch(self, since: str) -> None:
        while True:
            try:
                async for event in self.store.watch(records.KIND, since):
                    since = event.resource_version
                    self.on_event(event)
            except Expired:
                listed = await self.store.list(records.KIND)
                self._apply(listed.items)
                since = listed.resource_version
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("endpoint watch for slices failed; retrying", extra={"error": str(exc)})
                await asyncio.sleep(self.retry_interval)

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            for name, record in self.slicer.take_dirty():
                await self.limiter.acquire()
                try:
                    await self._write(name, record)
                    if self.sync_counter is not None:
                        self.sync_counter.labels("success").inc()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if self.sync_counter is not None:
                        self.sync_counter.labels("fail").inc()
                    log.warning("slice write failed; retrying",
                                extra={"slice": name, "error": str(exc)})  # fmt: skip
                    self.slicer.dirty.add(name)
                    self._wake.set()
                    await asyncio.sleep(self.retry_interval)

    async def _write(self, name: str, record: dict[str, Any] | None) -> None:
        self.writes += 1
        if record is None:
            with contextlib.suppress(NotFound):
                await self.store.delete(KIND, name)
            return
        try:
            current = await self.store.get(KIND, name)
        except NotFound:
            await self.store.create(record)
            return
        desired = dict(record)
        desired["metadata"] = {**record["metadata"],
                               "resourceVersion": current["metadata"].get("resourceVersion")}  # fmt: skip
        try:
            await self.store.update(desired)
        except Conflict:
            self.slicer.dirty.add(name)
            self._wake.set()


def _key_of(record: Resource) -> EndpointKey:
    namespace, _, name = records.owner_of(record).partition("/")
    return namespace, name
