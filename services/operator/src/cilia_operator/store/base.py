"""The Store interface: Kubernetes-shaped resources with resourceVersion and watch.

Resources are plain JSON objects (``dict``) shaped like Kubernetes objects:
``{"apiVersion", "kind", "metadata": {"name", "namespace"?, "resourceVersion", ...}, ...}``.
They are keyed by (kind, namespace, name); cluster-scoped kinds use namespace ``""``.

Every write bumps one store-wide, strictly increasing resourceVersion (a decimal string,
as in Kubernetes, but here also comparable as an integer). Updates and deletes may carry
the resourceVersion they were based on; a stale one raises :class:`Conflict`
(optimistic concurrency, like HTTP 409). A watch resumes from a resourceVersion and
raises :class:`Expired` (like HTTP 410 Gone) when the history it needs is gone, so the
caller lists again and watches from the list's resourceVersion.

Backends: :mod:`cilia_operator.store.redis` (standalone, ``--store redis://...``) and
:mod:`cilia_operator.store.kubernetes` (``--store kubernetes``: CRDs through the API
server). Both pass one shared test suite (services/operator/tests/integration/test_store.py).
"""

from __future__ import annotations

import abc
import builtins
import copy
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Resource = dict[str, Any]
EventType = Literal["ADDED", "MODIFIED", "DELETED"]


class StoreError(Exception):
    """Base class of every store failure."""


class StoreUnavailable(StoreError):
    """The backend cannot be reached (connection refused, timeout)."""


class NotFound(StoreError):
    """The resource does not exist (HTTP 404)."""

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        self.kind, self.namespace, self.name = kind, namespace, name
        super().__init__(f"{kind} {_display(namespace, name)} not found")


class AlreadyExists(StoreError):
    """Create of a resource that already exists (HTTP 409 AlreadyExists)."""

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        self.kind, self.namespace, self.name = kind, namespace, name
        super().__init__(f"{kind} {_display(namespace, name)} already exists")


class Conflict(StoreError):
    """Update/delete based on a stale resourceVersion (HTTP 409 Conflict).

    Attributes:
        expected: the resourceVersion the caller sent.
        current: the resourceVersion the store holds.
    """

    def __init__(self, kind: str, namespace: str, name: str, expected: str, current: str) -> None:
        self.kind, self.namespace, self.name = kind, namespace, name
        self.expected, self.current = expected, current
        super().__init__(
            f"{kind} {_display(namespace, name)}: resourceVersion {expected} is stale "
            f"(current {current}); get the object again and retry"
        )


class Contention(Conflict):
    """A read-modify-write retry loop gave up: the object changed under every attempt.

    Still a :class:`Conflict` (handled alike; ABORTED over gRPC), with ``expected`` and
    ``current`` empty: no single stale version is to blame.
    """

    def __init__(self, kind: str, namespace: str, name: str) -> None:
        self.kind, self.namespace, self.name = kind, namespace, name
        self.expected = self.current = ""
        StoreError.__init__(
            self,
            f"{kind} {_display(namespace, name)} kept changing during every retry "
            "(concurrent writers); retry later",
        )


class Expired(StoreError):
    """The watch history after ``since`` was trimmed (HTTP 410 Gone): list again."""

    def __init__(self, kind: str, since: str, oldest_kept: str) -> None:
        self.kind, self.since, self.oldest_kept = kind, since, oldest_kept
        super().__init__(
            f"watch of {kind} from resourceVersion {since} expired: events up to "
            f"{oldest_kept} were trimmed; list again"
        )


def _display(namespace: str, name: str) -> str:
    return f"{namespace}/{name}" if namespace else name


@dataclass(frozen=True)
class WatchEvent:
    """One change seen by a watch.

    Attributes:
        type: ``ADDED``, ``MODIFIED`` or ``DELETED``.
        object: the resource after the change (for DELETED: its last state), with
            ``metadata.resourceVersion`` set to this event's version.
        resource_version: the store resourceVersion of the change.
    """

    type: EventType
    object: Resource
    resource_version: str


@dataclass(frozen=True)
class ListResult:
    """Items of one kind (sorted by namespace/name) and the store version they reflect.

    Watching from ``resource_version`` sees every later change, none twice.
    """

    items: list[Resource]
    resource_version: str


def object_key(obj: Resource) -> tuple[str, str, str]:
    """Return ``(kind, namespace, name)`` of a resource.

    Raises:
        ValueError: ``kind`` or ``metadata.name`` missing.
    """
    kind = obj.get("kind")
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(kind, str) or not kind:
        raise ValueError("resource has no kind")
    if not isinstance(name, str) or not name:
        raise ValueError("resource has no metadata.name")
    namespace = meta.get("namespace") or ""
    return kind, str(namespace), name


def check_write_kinds(kinds: Sequence[str], writes: Sequence[Write]) -> None:
    """Refuse a transaction that writes a kind it did not read.

    Raises:
        ValueError: naming the kind.
    """
    for write in writes:
        kind = object_key(write.obj)[0]
        if kind not in kinds:
            raise ValueError(f"transaction writes {kind} but reads only {', '.join(kinds)}")


def resource_version(obj: Resource) -> str:
    """``metadata.resourceVersion`` of ``obj``, or ``""`` when absent."""
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def with_resource_version(obj: Resource, rv: str) -> Resource:
    """A deep copy of ``obj`` with ``metadata.resourceVersion`` set to ``rv``."""
    out = copy.deepcopy(obj)
    out.setdefault("metadata", {})["resourceVersion"] = rv
    return out


@dataclass(frozen=True)
class Write:
    """One write of a transaction (:meth:`Store.transact`).

    Attributes:
        op: ``create`` (the key must not exist), ``update`` (the key must exist; a
            non-empty ``metadata.resourceVersion`` of ``obj`` is a precondition) or
            ``delete`` (the key must exist; ``obj``'s resourceVersion, when set, is a
            precondition).
        obj: the resource to store (``delete``: the resource to delete, by its key).
    """

    op: Literal["create", "update", "delete"]
    obj: Resource


Snapshot = Mapping[str, ListResult]
"""What a transaction's plan reads: kind -> every resource of that kind, all taken at one
store version."""

TransactionPlan = Callable[[Snapshot], Awaitable[Sequence[Write]]]
"""Reads a snapshot, checks it, returns the writes (empty: nothing to write). It may raise
to abort the transaction (nothing is written) and may run more than once: once per
attempt, each time on a fresh snapshot."""


class Store(abc.ABC):
    """Typed resources keyed by kind/namespace/name with optimistic concurrency.

    Every method is a coroutine (the watch is an async iterator). Objects passed in are
    never mutated; objects returned are fresh copies the caller may change.
    """

    @abc.abstractmethod
    async def get(self, kind: str, name: str, namespace: str = "") -> Resource:
        """Return the resource with its ``metadata.resourceVersion``.

        Raises:
            NotFound: no such resource.
        """

    @abc.abstractmethod
    async def list(self, kind: str) -> ListResult:
        """Return every resource of ``kind`` and the list resourceVersion (atomic snapshot)."""

    @abc.abstractmethod
    async def create(self, obj: Resource) -> Resource:
        """Create ``obj``; sets ``metadata.uid``, ``creationTimestamp`` and resourceVersion.

        Returns the stored object.

        Raises:
            AlreadyExists: a resource with that key exists.
            ValueError: ``obj`` lacks kind or metadata.name.
        """

    @abc.abstractmethod
    async def update(self, obj: Resource) -> Resource:
        """Replace the resource with ``obj``.

        If ``obj.metadata.resourceVersion`` is set it must equal the stored one
        (optimistic concurrency); when empty the update is unconditional.

        Raises:
            NotFound: no such resource.
            Conflict: the resourceVersion is stale.
        """

    @abc.abstractmethod
    async def delete(
        self, kind: str, name: str, namespace: str = "", resource_version: str = ""
    ) -> Resource:
        """Delete the resource; returns its last state. A non-empty ``resource_version``
        is a precondition.

        Raises:
            NotFound: no such resource.
            Conflict: the precondition failed.
        """

    async def transact(
        self, kinds: Sequence[str], plan: TransactionPlan, *, attempts: int = 5
    ) -> builtins.list[Resource]:
        """Read every resource of ``kinds``, let ``plan`` check them and choose writes,
        and write them only if none of ``kinds`` changed in between.

        Backends that have multi-object transactions (Redis: ``WATCH``/``MULTI``/``EXEC``)
        write all or nothing, so checks made by ``plan`` (e.g. "no two pools overlap") hold
        when the writes land. This base implementation, used by the Kubernetes store
        (the API server has no multi-object transactions), lists, plans and writes one
        object after the other with resourceVersion preconditions: a concurrent change
        of a written object is caught, of another listed object is not, and a failure
        part-way leaves the earlier writes in place.

        Args:
            kinds: every kind ``plan`` reads; every written object's kind must be one.
            plan: see :data:`TransactionPlan`.
            attempts: times the whole read-plan-write is tried when a listed kind
                changed meanwhile (>= 1).

        Returns:
            the stored objects, in the order of the writes.

        Raises:
            Contention: a listed kind changed during every attempt.
            ValueError: a write's kind is not in ``kinds``.
            whatever ``plan`` raises (nothing written).
        """
        snapshot = {kind: await self.list(kind) for kind in dict.fromkeys(kinds)}
        writes = list(await plan(snapshot))
        check_write_kinds(kinds, writes)
        out = []
        for write in writes:
            if write.op == "create":
                out.append(await self.create(write.obj))
            elif write.op == "delete":
                kind, namespace, name = object_key(write.obj)
                out.append(await self.delete(kind, name, namespace, resource_version(write.obj)))
            else:
                out.append(await self.update(write.obj))
        return out

    @abc.abstractmethod
    def watch(self, kind: str, since: str) -> AsyncIterator[WatchEvent]:
        """Yield every change of ``kind`` with resourceVersion > ``since``, in order, forever.

        Raises (from the iterator):
            Expired: history after ``since`` was trimmed; list again.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Running watches end."""
