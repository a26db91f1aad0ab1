"""Identity cache: numeric identity → label set, fed by ``IdentityService.WatchIdentities``.

The cache always holds the reserved identities 1..8 (``labels.RESERVED_IDENTITIES``);
cluster identities (256 … 65535) arrive from the operator stream; node-local CIDR
identities (``cidr.LOCAL_SCOPE`` | n, see ``identity.cidr``) are put here by the policy
engine (:meth:`IdentityCache.upsert_local`), are refused from the stream and survive its
resyncs (the operator never knows them). Every mutation returns
an ``IdentityChange`` (id, old labels, new labels) so the policy repository can work out
which endpoints must be recompiled.

Stream contract (``proto/cilia/controlplane/v1/controlplane.proto``): a
``WatchIdentitiesResponse`` carries ``events`` (``IdentityEvent{type: UPSERT=1 | DELETE=2,
identity{id, labels}}``) and ``synced`` (true on the message ending the initial listing).
After a reconnect the operator lists everything again: call ``begin_resync()`` before
feeding the new stream; identities not listed again are removed when ``synced`` arrives.

Not thread-safe: feed it from the agent's event loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from cilia_agent.identity.cidr import is_local_identity
from cilia_agent.identity.labels import (
    MINIMAL_CLUSTER_IDENTITY,
    RESERVED_IDENTITIES,
    Label,
    LabelError,
    LabelSet,
    is_cluster_identity,
)

log = logging.getLogger(__name__)

EVENT_TYPE_UPSERT = 1
EVENT_TYPE_DELETE = 2


class SelectorLike(Hashable, Protocol):
    """What ``IdentityCache.matching`` needs of a selector (``policy.selector.Selector``)."""

    def matches(self, labels: LabelSet) -> bool: ...


class IdentityLike(Protocol):
    """Shape of ``controlplane_pb2.Identity``."""

    @property
    def id(self) -> int: ...
    @property
    def labels(self) -> Sequence[str]: ...


class IdentityEventLike(Protocol):
    """Shape of ``controlplane_pb2.IdentityEvent``."""

    @property
    def type(self) -> int: ...
    @property
    def identity(self) -> IdentityLike: ...


class WatchIdentitiesResponseLike(Protocol):
    """Shape of ``controlplane_pb2.WatchIdentitiesResponse``."""

    @property
    def events(self) -> Sequence[IdentityEventLike]: ...
    @property
    def synced(self) -> bool: ...


class InvalidIdentity(ValueError):
    """An identity event cannot be applied (id 0, reserved id, malformed label)."""


@dataclass(frozen=True)
class IdentityChange:
    """One effective change: ``old``/``new`` labels (None = absent before/after)."""

    id: int
    old: LabelSet | None
    new: LabelSet | None


class IdentityCache:
    """Numeric identity → ``LabelSet``, with selector lookups.

    Attributes:
        synced: True once the initial listing of the current stream was applied.
        revision: incremented on every effective change.
    """

    def __init__(self) -> None:
        self._ids: dict[int, LabelSet] = {r.id: r.labels for r in RESERVED_IDENTITIES.values()}
        self._memo: dict[Hashable, frozenset[int]] = {}
        self._seen: set[int] | None = None
        self.synced = False
        self.revision = 0

    # ------------------------------------------------------------------ lookups

    def get(self, identity: int) -> LabelSet | None:
        """Labels of ``identity``, None when unknown."""
        return self._ids.get(identity)

    def __contains__(self, identity: object) -> bool:
        return identity in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._ids))

    def items(self) -> list[tuple[int, LabelSet]]:
        """(id, labels) pairs, sorted by id."""
        return sorted(self._ids.items(), key=lambda kv: kv[0])

    def matching(self, selector: SelectorLike) -> frozenset[int]:
        """Every identity whose labels ``selector`` matches (memoised until the next change)."""
        hit = self._memo.get(selector)
        if hit is None:
            hit = frozenset(i for i, labels in self._ids.items() if selector.matches(labels))
            self._memo[selector] = hit
        return hit

    def cluster_identities(self) -> frozenset[int]:
        """Every operator-allocated identity (≥ 256) currently known."""
        return frozenset(i for i in self._ids if is_cluster_identity(i))

    # ------------------------------------------------------------------ mutations

    def upsert(self, identity: int, labels: Iterable[str | Label]) -> IdentityChange | None:
        """Set the labels of a cluster identity; returns the change, None when unchanged.

        Raises:
            InvalidIdentity: ``identity`` is 0 or reserved (< 256), node-local (CIDR scope,
                never from the operator), or a label is malformed.
        """
        if identity < MINIMAL_CLUSTER_IDENTITY:
            raise InvalidIdentity(
                f"identity {identity}: below {MINIMAL_CLUSTER_IDENTITY} (0 and 1..255 are reserved)"
            )
        if is_local_identity(identity):
            raise InvalidIdentity(f"identity {identity}: node-local scope, not a cluster identity")
        return self._set(identity, labels)

    def upsert_local(self, identity: int, labels: Iterable[str | Label]) -> IdentityChange | None:
        """Set the labels of a node-local (CIDR) identity; returns the change, None when
        unchanged. Stream resyncs never remove it; :meth:`delete` does.

        Raises:
            InvalidIdentity: ``identity`` is not in the local scope, or a label is malformed.
        """
        if not is_local_identity(identity):
            raise InvalidIdentity(f"identity {identity}: not a node-local identity")
        return self._set(identity, labels)

    def local_identities(self) -> frozenset[int]:
        """Every node-local (CIDR) identity currently known."""
        return frozenset(i for i in self._ids if is_local_identity(i))

    def _set(self, identity: int, labels: Iterable[str | Label]) -> IdentityChange | None:
        try:
            new = LabelSet.of(labels)
        except LabelError as exc:
            raise InvalidIdentity(f"identity {identity}: {exc}") from exc
        if self._seen is not None and not is_local_identity(identity):
            self._seen.add(identity)
        old = self._ids.get(identity)
        if old == new:
            return None
        self._ids[identity] = new
        return self._changed(IdentityChange(identity, old, new))

    def delete(self, identity: int) -> IdentityChange | None:
        """Forget a cluster or node-local identity; returns the change, None when it was
        unknown.

        Reserved identities are never removed (returns None).
        """
        if identity in RESERVED_IDENTITIES:
            return None
        old = self._ids.pop(identity, None)
        if old is None:
            return None
        return self._changed(IdentityChange(identity, old, None))

    def begin_resync(self) -> None:
        """A new stream starts: identities it does not list before ``synced`` get removed."""
        self._seen = set()
        self.synced = False

    def apply(self, response: WatchIdentitiesResponseLike) -> list[IdentityChange]:
        """Apply one ``WatchIdentitiesResponse``; returns the effective changes in order.

        Invalid events are logged and skipped (the rest of the message still applies).
        On ``synced`` after ``begin_resync()``, identities the stream did not list are removed.
        """
        changes: list[IdentityChange] = []
        for event in response.events:
            ident = event.identity
            try:
                if event.type == EVENT_TYPE_UPSERT:
                    change = self.upsert(ident.id, list(ident.labels))
                elif event.type == EVENT_TYPE_DELETE:
                    if is_local_identity(ident.id):
                        raise InvalidIdentity(f"identity {ident.id}: node-local, not the stream's")
                    change = self.delete(ident.id)
                else:
                    raise InvalidIdentity(f"identity {ident.id}: unknown event type {event.type}")
            except InvalidIdentity as exc:
                log.warning("skipping identity event: %s", exc)
                continue
            if change is not None:
                changes.append(change)
        if response.synced:
            if self._seen is not None:
                stale = [
                    i
                    for i in self._ids
                    if i not in RESERVED_IDENTITIES
                    and not is_local_identity(i)
                    and i not in self._seen
                ]
                for identity in stale:
                    change = self.delete(identity)
                    if change is not None:
                        changes.append(change)
                self._seen = None
            self.synced = True
        return changes

    def _changed(self, change: IdentityChange) -> IdentityChange:
        self._memo.clear()
        self.revision += 1
        return change
