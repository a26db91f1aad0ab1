"""The node's local identity allocator: which identities this node's endpoints hold.

:class:`IdentityAllocator` keeps a local cache of the identities this node holds a
reference to at the operator, keyed by label set, with the local endpoints using each
(upstream ``pkg/allocator``'s ``localKeys``: a reference count per key, the backend called
only on the first local reference and released on the last; reference:
cilium-upstream.md §4):

- :meth:`IdentityAllocator.allocate` of a label set this node already holds (confirmed by
  the operator in this process) takes a local reference and returns at once: no
  ``IdentityService.Allocate`` round trip. Otherwise the operator is asked, under a lock
  per label set, so concurrent ADDs with the same labels make one call and the others
  wait for its answer.
- the last local user going releases the node's reference at the operator
  (``IdentityService.Release``) through the retry queue; every attempt takes the label
  set's lock and sends nothing when a user came back meanwhile, and an ADD arriving while
  a Release is under way waits for it and then allocates again. So the operator never
  sees a Release after an Allocate whose reference is still wanted.
- an identity restored from endpoint state files after a restart is counted at once but
  *unconfirmed*: the first ADD with its labels asks the operator again (which recreates
  the record under the same number when it was lost) before the cache hands it out.

Why a cached identity cannot have been freed by the operator: ``Allocate`` returns only
after this node's name was written into the identity's ``cilia.io/node-references``; the
operator's GC deletes an identity only when no CiliumEndpoint and no registered node
references it for ``--identity-heartbeat-timeout``; and this node's reference is removed
only by its own ``Release``, sent (above) only once the cache entry is no longer handed
out. The node reference is the keep-alive: it stands for every local user, and each
endpoint's own CiliumEndpoint record names the identity too. Out-of-protocol loss (an
admin deleting the record, the store wiped) is seen on the identity stream: a DELETE of
a held identity, an UPSERT giving it other labels, or a resync listing without it marks
the entry unconfirmed (the next ADD asks the operator) and re-allocates it in the
background, as upstream re-creates missing keys of its local key cache.

An identity allocated here is learned at once — put into the identity cache through the
sink (the policy engine), without waiting for the operator's stream — so a new endpoint is
selectable by policies immediately; the stream consumer keeps those identities across a
resync (:meth:`IdentityAllocator.local_identities`).

Not thread-safe: every method runs on the agent's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.controlplane import ControlPlane, RetryQueue
from cilia_agent.identity.cache import IdentityCache
from cilia_agent.identity.labels import is_cluster_identity
from cilia_agent.identity.local import LocalControlPlane

log = logging.getLogger(__name__)

LabelKey = tuple[str, ...]
"""A label set as the cache keys it: sorted ``source:key=value`` strings."""


class IdentitySink(Protocol):
    """Who applies identity changes to the cache (the policy engine, which recompiles)."""

    @property
    def identities(self) -> IdentityCache:
        """The cache the sink applies to."""

    def on_identities(self, response: cp.WatchIdentitiesResponse) -> object:
        """Apply an identity stream message (or one built for a learned identity)."""


@dataclass
class _Held:
    """One label set this node holds: its identity, and whether the operator confirmed
    this node's reference in this process (False: restored from state files, invalidated
    by the stream, or being released)."""

    identity: int
    confirmed: bool


@dataclass
class _KeyLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    waiters: int = 0


@dataclass
class AllocatorStats:
    """Counters: ``operator_allocations`` (backend Allocate calls answered),
    ``cache_hits`` (allocations served from the local cache), ``releases`` (Release
    calls answered), ``skipped_releases`` (a Release not sent: a user came back)."""

    operator_allocations: int = 0
    cache_hits: int = 0
    releases: int = 0
    skipped_releases: int = 0


class IdentityAllocator:
    """Allocation, local reference counts and release of security identities.

    Args:
        control: the operator's IdentityService (or the no-operator stand-in).
        retry: where best-effort releases and background re-allocations are retried.
        sink: applies learned identities to the cache (the policy engine).
        on_learn_error: exception types a learn may raise that are logged, not raised
            (the policy map being full: retried at the next change).
    """

    def __init__(
        self,
        control: ControlPlane,
        retry: RetryQueue,
        sink: IdentitySink,
        on_learn_error: tuple[type[Exception], ...] = (),
    ) -> None:
        self.control = control
        self.retry = retry
        self.sink = sink
        self.stats = AllocatorStats()
        self._learn_errors = on_learn_error
        self._users: dict[int, set[int]] = {}
        self._labels: dict[int, tuple[str, ...]] = {}  # every identity allocated/seeded here
        self._local: dict[int, tuple[str, ...]] = {}  # cluster identities local endpoints use
        self._held: dict[LabelKey, _Held] = {}
        self._key_of: dict[int, LabelKey] = {}
        self._locks: dict[LabelKey, _KeyLock] = {}
        self._reasserting: set[LabelKey] = set()

    # ------------------------------------------------------------------ locking

    @contextlib.asynccontextmanager
    async def _locked(self, key: LabelKey) -> AsyncIterator[None]:
        """Serialise the operator calls of one label set (dropped when nobody waits)."""
        entry = self._locks.setdefault(key, _KeyLock())
        entry.waiters += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and self._locks.get(key) is entry:
                del self._locks[key]

    def _key_for(self, identity: int) -> LabelKey:
        key = self._key_of.get(identity)
        if key is not None:
            return key
        labels = self.labels_of(identity)
        return tuple(sorted(labels)) if labels else (f"#identity={identity}",)

    # ------------------------------------------------------------------ allocation

    async def allocate(self, labels: Iterable[str], user: int) -> int:
        """The identity of ``labels`` (filtered ``source:key=value`` strings), referenced
        by local endpoint ``user`` before it is returned.

        Served from the local cache when this node holds the label set (confirmed);
        otherwise ``IdentityService.Allocate`` is called once per label set at a time.

        Raises:
            OperatorUnavailable / OperatorRejected: the operator could not allocate
                (no reference taken).
        """
        key = tuple(sorted(labels))
        held = self._held.get(key)
        if held is not None and held.confirmed:
            self.stats.cache_hits += 1
            self.acquire(held.identity, user)
            return held.identity
        async with self._locked(key):
            held = self._held.get(key)
            if held is not None and held.confirmed:  # a concurrent ADD just allocated it
                self.stats.cache_hits += 1
                self.acquire(held.identity, user)
                return held.identity
            identity = await self._allocate_at_operator(key)
            self.acquire(identity, user)
            return identity

    async def _allocate_at_operator(self, key: LabelKey) -> int:
        """Call the operator for ``key`` (its lock held) and record the answer as held."""
        allocated = await self.control.allocate_identity(list(key))
        identity = int(allocated.id)
        self.stats.operator_allocations += 1
        previous = self._held.get(key)
        if previous is not None and previous.identity != identity:
            log.warning(
                "the operator answered another identity for held labels; new endpoints get "
                "the new one, running ones keep theirs until relabelled",
                extra={"labels": list(key), "old": previous.identity, "identity": identity},
            )
        self._held[key] = _Held(identity, confirmed=True)
        self._key_of[identity] = key
        self._labels[identity] = key
        return identity

    def acquire(self, identity: int, ep_id: int) -> None:
        """Endpoint ``ep_id`` uses ``identity`` (from allocation or restore; idempotent)."""
        self._users.setdefault(identity, set()).add(ep_id)

    def drop(self, identity: int, ep_id: int) -> None:
        """Endpoint ``ep_id`` no longer uses ``identity``; nothing is released yet (see
        :meth:`release_if_unused`)."""
        self._users.get(identity, set()).discard(ep_id)

    def release(self, identity: int, ep_id: int) -> None:
        """Endpoint ``ep_id`` no longer uses ``identity``; released when unused."""
        self._users.get(identity, set()).discard(ep_id)
        self.release_if_unused(identity)

    def release_if_unused(self, identity: int, labels: Iterable[str] | None = None) -> None:
        """Release ``identity`` at the operator (queued) when no local endpoint uses it.

        ``labels``: its label set when the caller knows it and this process may not (an
        endpoint left over from before a restart), so the Release is ordered with ADDs of
        the same labels.

        The Release runs under the label set's lock and is skipped when a local user came
        back before it was sent (a pod re-created with the same labels keeps the identity
        without a round trip); from the moment it is sent the cache stops handing it out.
        """
        if self._users.get(identity) or not identity:
            return
        key = self._key_of.get(identity)
        if key is None and labels is not None:
            key = tuple(sorted(labels))
        self.retry.submit(
            f"Release identity {identity}", lambda: self._release_if_still_unused(identity, key)
        )

    async def _release_if_still_unused(self, identity: int, key: LabelKey | None) -> None:
        """One attempt of a queued release (the retry queue repeats it after a failure)."""
        if key is None:
            key = self._key_for(identity)
        async with self._locked(key):
            if self._users.get(identity):
                self.stats.skipped_releases += 1
                return  # used again before the Release was sent: the reference is wanted
            held = self._held.get(key)
            if held is not None and held.identity == identity:
                # from here on the operator may drop the reference: not handed out any more
                # (a failed attempt leaves it unconfirmed: the next ADD asks the operator)
                held.confirmed = False
            await self.control.release_identity(identity)
            self.stats.releases += 1
            if self._users.get(identity):
                # a user came without this lock meanwhile (an endpoint restored at start-up):
                # the reference just released is wanted after all
                self._invalidate(identity)
                return
            self._users.pop(identity, None)
            self._local.pop(identity, None)
            self._labels.pop(identity, None)
            if self._key_of.get(identity) == key:
                del self._key_of[identity]
            held = self._held.get(key)
            if held is not None and held.identity == identity:
                del self._held[key]

    # ------------------------------------------------------------------ restore / learn

    def seed(self, labels: Iterable[str], identity: int) -> None:
        """A restored endpoint had ``identity`` for ``labels``: held again, unconfirmed
        (the first ADD with these labels asks the operator); the no-operator allocator
        numbers the same labels the same again."""
        key = tuple(sorted(labels))
        self._held.setdefault(key, _Held(identity, confirmed=False))
        self._key_of.setdefault(identity, key)
        self._labels.setdefault(identity, key)
        if isinstance(self.control, LocalControlPlane):
            self.control.seed(key, identity)

    def learn(self, identity: int, labels: Iterable[str]) -> None:
        """Put an identity allocated here into the cache at once (local endpoints are
        selectable without waiting for the operator's stream)."""
        labels = tuple(labels)
        self._labels[identity] = labels
        if not is_cluster_identity(identity):
            return
        self._local[identity] = tuple(sorted(labels))
        known = self.sink.identities.get(identity)
        if known is not None and known.strings() == tuple(sorted(labels)):
            return
        try:
            self.sink.on_identities(
                cp.WatchIdentitiesResponse(
                    events=[
                        cp.IdentityEvent(
                            type=cp.EVENT_TYPE_UPSERT,
                            identity=cp.Identity(id=identity, labels=list(labels)),
                        )
                    ]
                )
            )
        except self._learn_errors:
            log.exception("policy map update after a new identity failed; retried later")

    # ------------------------------------------------------------------ the stream

    def observe(self, response: cp.WatchIdentitiesResponse, listed: set[int] | None) -> None:
        """Check a stream message against the held identities (before it is applied).

        A held identity the operator deleted, gave other labels, or left out of a full
        listing (``listed``: the ids of the listing, passed with its ``synced`` message)
        becomes unconfirmed and is allocated again in the background.
        """
        lost: list[int] = []
        for event in response.events:
            key = self._key_of.get(event.identity.id)
            if key is None:
                continue
            if event.type == cp.EVENT_TYPE_DELETE or tuple(sorted(event.identity.labels)) != key:
                lost.append(event.identity.id)
        if listed is not None:
            lost.extend(i for i in self._key_of if is_cluster_identity(i) and i not in listed)
        for identity in lost:
            self._invalidate(identity)

    def _invalidate(self, identity: int) -> None:
        key = self._key_of.get(identity)
        held = self._held.get(key) if key is not None else None
        if key is None or held is None or held.identity != identity:
            return
        held.confirmed = False
        if not self._users.get(identity) or key in self._reasserting:
            return
        log.warning(
            "a held identity is gone at the operator; allocating it again",
            extra={"identity": identity, "labels": list(key)},
        )
        self._reasserting.add(key)
        self.retry.submit(f"Allocate identity {identity} again", lambda: self._reassert(key))

    async def _reassert(self, key: LabelKey) -> None:
        """Allocate a held, unconfirmed label set again while local endpoints use it."""
        async with self._locked(key):
            held = self._held.get(key)
            if held is None or held.confirmed or not self._users.get(held.identity):
                self._reasserting.discard(key)
                return
            identity = await self._allocate_at_operator(key)
            self._reasserting.discard(key)
            self.learn(identity, key)

    # ------------------------------------------------------------------ getters

    def local_identities(self) -> Mapping[int, tuple[str, ...]]:
        """Cluster identities local endpoints use, with their sorted labels."""
        return dict(self._local)

    def labels_of(self, identity: int) -> tuple[str, ...] | None:
        """Labels of an identity the cache holds (the operator's stream or learned here),
        else of one this node allocated or restored (None: unknown; Hubble's getter)."""
        known = self.sink.identities.get(identity)
        if known is not None:
            return known.strings()
        return self._labels.get(identity)

    def users(self, identity: int) -> int:
        """How many local endpoints use ``identity``."""
        return len(self._users.get(identity, ()))

    def held(self, labels: Iterable[str]) -> tuple[int, bool] | None:
        """``(identity, confirmed)`` of a label set this node holds, else None."""
        entry = self._held.get(tuple(sorted(labels)))
        return (entry.identity, entry.confirmed) if entry is not None else None
