"""The node's local identity allocator: which identities this node's endpoints hold.

:class:`IdentityAllocator` asks the operator (``IdentityService.Allocate``, or the
no-operator :class:`~cilia_agent.identity.local.LocalControlPlane`) for the identity of a
label set, counts the local endpoints using each identity, and releases an identity
(``IdentityService.Release``, best effort through the retry queue) when its last local
user is gone. An identity allocated here is learned at once — put into the identity cache
through the sink (the policy engine), without waiting for the operator's stream — so a new
endpoint is selectable by policies immediately; the stream consumer keeps those identities
across a resync (:meth:`IdentityAllocator.local_identities`).

Source: upstream ``pkg/identity/cache`` (local allocation, reference counts, release on
last use; reference: cilium-upstream.md §4).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping
from typing import Protocol

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.controlplane import ControlPlane, RetryQueue
from cilia_agent.identity.cache import IdentityCache
from cilia_agent.identity.labels import is_cluster_identity
from cilia_agent.identity.local import LocalControlPlane

log = logging.getLogger(__name__)


class IdentitySink(Protocol):
    """Who applies identity changes to the cache (the policy engine, which recompiles)."""

    @property
    def identities(self) -> IdentityCache:
        """The cache the sink applies to."""

    def on_identities(self, response: cp.WatchIdentitiesResponse) -> object:
        """Apply an identity stream message (or one built for a learned identity)."""


class IdentityAllocator:
    """Allocation, local reference counts and release of security identities.

    Args:
        control: the operator's IdentityService (or the no-operator stand-in).
        retry: where best-effort releases are retried.
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
        self._learn_errors = on_learn_error
        self._users: dict[int, set[int]] = {}
        self._labels: dict[int, tuple[str, ...]] = {}  # every identity allocated/seeded here
        self._local: dict[int, tuple[str, ...]] = {}  # cluster identities local endpoints use

    async def allocate(self, labels: Iterable[str]) -> int:
        """The identity of ``labels`` (sorted, filtered ``source:key=value`` strings).

        Raises:
            OperatorUnavailable / OperatorRejected: the operator could not allocate.
        """
        allocated = await self.control.allocate_identity(list(labels))
        return int(allocated.id)

    def acquire(self, identity: int, ep_id: int) -> None:
        """Endpoint ``ep_id`` uses ``identity`` (from allocation or restore)."""
        self._users.setdefault(identity, set()).add(ep_id)

    def drop(self, identity: int, ep_id: int) -> None:
        """Endpoint ``ep_id`` no longer uses ``identity``; nothing is released yet (see
        :meth:`release_if_unused`)."""
        self._users.get(identity, set()).discard(ep_id)

    def release(self, identity: int, ep_id: int) -> None:
        """Endpoint ``ep_id`` no longer uses ``identity``; released when unused."""
        self._users.get(identity, set()).discard(ep_id)
        self.release_if_unused(identity)

    def release_if_unused(self, identity: int) -> None:
        """Release ``identity`` at the operator (queued) when no local endpoint uses it."""
        if self._users.get(identity):
            return
        self._users.pop(identity, None)
        self._local.pop(identity, None)
        self._labels.pop(identity, None)
        if identity:
            release = functools.partial(self.control.release_identity, identity)
            self.retry.submit(f"Release identity {identity}", release)

    def seed(self, labels: Iterable[str], identity: int) -> None:
        """A restored endpoint had ``identity`` for ``labels``: the no-operator allocator
        numbers the same labels the same again."""
        if isinstance(self.control, LocalControlPlane):
            self.control.seed(labels, identity)

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
