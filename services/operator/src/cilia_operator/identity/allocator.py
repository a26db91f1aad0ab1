"""``IdentityAllocator``: label set -> numeric identity, through the Store only.

Invariants, kept by the store (so they hold across operator replicas, not by a lock):

- one label set -> at most one identity: the label set's ``CiliaIdentityKey`` (named by the
  SHA-256 of the sorted labels) is created with create-if-absent; whoever loses the race
  reads the winner's key;
- one identity -> at most one label set: the ``CiliumIdentity`` named by the number is
  created with create-if-absent; an id taken by another label set moves the key to a new
  candidate (update with a resourceVersion precondition).

An id is returned only after the CiliumIdentity with that number and exactly these labels
was read or created, and after this node's reference was written into it (which also
clears a GC heartbeat mark), so a concurrent GC delete (resourceVersion precondition)
either happens before -- the record is then recreated from the key, same number -- or
fails. Keys are never deleted (one small record per label set ever allocated): a label
set that comes back gets its old number again while that number is free.

Candidates are free ids of ``min_id`` (256, upstream MinimalNumericIdentity) ..
``max_id`` (``--identity-max-id``, default 65535) -- the first free one after a random
point, as upstream's id pool leases random free ids, so replicas rarely collide -- from a
cache of used ids filled by a store list and corrected on every collision; the cache is
re-read before reporting exhaustion. Source of the scheme: upstream's CRD identity allocator
(``pkg/identity/cache``, ``pkg/allocator``), with the store's create-if-absent in place
of the Kubernetes API's.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Literal

from ..store import AlreadyExists, Conflict, NotFound, Store, resource_version
from . import records
from .labels import MAX_NUMERIC_IDENTITY, MINIMAL_NUMERIC_IDENTITY, LabelSet

log = logging.getLogger(__name__)

CONTENTION_RETRY_FACTOR = 10
"""Allocate and reference writes retry up to this many times ``conflict_retries``: each
conflict means another allocator made progress (claimed the label set, took the id,
wrote its node's reference), so contention resolves within a few rounds."""


class IdentitiesExhausted(Exception):
    """Every id of ``min_id..max_id`` belongs to another label set (RESOURCE_EXHAUSTED)."""


class AllocationContention(Exception):
    """The label set's records kept changing under this allocator (ABORTED); retry."""


class IdentityAllocator:
    """Allocates, references and releases identities.

    Args:
        store: the Store.
        min_id / max_id: inclusive range of cluster identities (256..65535 by default).
        conflict_retries: attempts per step that hits a resourceVersion conflict.

    Raises (from every method): ``StoreUnavailable``.
    """

    def __init__(
        self,
        store: Store,
        *,
        min_id: int = MINIMAL_NUMERIC_IDENTITY,
        max_id: int = MAX_NUMERIC_IDENTITY,
        conflict_retries: int = 5,
    ) -> None:
        if not MINIMAL_NUMERIC_IDENTITY <= min_id <= max_id <= MAX_NUMERIC_IDENTITY:
            raise ValueError(
                f"identity range {min_id}..{max_id} must lie within "
                f"{MINIMAL_NUMERIC_IDENTITY}..{MAX_NUMERIC_IDENTITY}"
            )
        self.store = store
        self.min_id = min_id
        self.max_id = max_id
        self.conflict_retries = max(1, conflict_retries)
        self._used: set[int] | None = None
        self._random = random.Random()

    async def _refresh(self) -> set[int]:
        listed = await self.store.list(records.KIND)
        self._used = {records.identity_id(o) for o in listed.items} - {0}
        return self._used

    async def _candidate(self) -> int:
        used = self._used if self._used is not None else await self._refresh()
        for attempt in range(2):
            span = self.max_id - self.min_id + 1
            start = self._random.randrange(span)  # replicas rarely pick the same id
            for step in range(span):
                candidate = self.min_id + (start + step) % span
                if candidate not in used:
                    used.add(candidate)  # claimed by this process until a refresh
                    return candidate
            if attempt == 0:
                used = await self._refresh()
        raise IdentitiesExhausted(
            f"no free identity in {self.min_id}..{self.max_id}: every id is allocated "
            "(raise --identity-max-id or wait for identity GC)"
        )

    def forget(self, identity: int) -> None:
        """Mark ``identity`` free in the local cache (after this process deleted it)."""
        if self._used is not None:
            self._used.discard(identity)

    async def allocate(self, node: str, labels: LabelSet) -> tuple[int, bool]:
        """The identity of ``labels``, created if needed, referenced by ``node``.

        Returns:
            ``(id, created)``; reserved label sets (``reserved:host`` ...) return their
            reserved id and ``created`` False without touching the store.

        Raises:
            IdentitiesExhausted: no free id left.
            AllocationContention: the records kept changing (after ``conflict_retries``).
            InvalidLabels: reserved labels mixed with others.
        """
        reserved = labels.reserved_identity()
        if reserved is not None:
            return reserved, False
        digest = labels.digest()
        conflicts = 0
        while conflicts < CONTENTION_RETRY_FACTOR * self.conflict_retries:
            try:
                key = await self.store.get(records.KEY_KIND, digest)
            except NotFound:
                candidate = await self._candidate()
                try:
                    key = await self.store.create(records.key_record(labels, candidate))
                except AlreadyExists:
                    conflicts += 1  # another allocator claimed the label set first
                    continue
            identity = records.key_id(key)
            outcome = await self._ensure_identity(identity, labels, node)
            if outcome == "conflict":
                conflicts += 1
                continue
            if outcome == "taken":
                if self._used is not None:
                    self._used.add(identity)
                moved = records.key_record(labels, await self._candidate())
                moved["metadata"]["resourceVersion"] = resource_version(key)
                try:
                    await self.store.update(moved)
                except (Conflict, NotFound):
                    conflicts += 1
                continue
            created = outcome == "created"
            if created:
                log.info("identity allocated", extra={"identity": identity,
                         "labels": labels.strings(), "node": node})  # fmt: skip
            return identity, created
        raise AllocationContention(
            f"identity for {labels.strings()} changed {conflicts} times during allocation; retry"
        )

    async def _ensure_identity(
        self, identity: int, labels: LabelSet, node: str
    ) -> Literal["created", "exists", "taken", "conflict"]:
        """Make CiliumIdentity ``identity`` exist with ``labels`` and reference ``node``."""
        if identity == 0:  # malformed key: give it a fresh id
            return "taken"
        try:
            current = await self.store.get(records.KIND, str(identity))
        except NotFound:
            try:
                await self.store.create(records.identity_record(identity, labels, node))
            except AlreadyExists:
                return "conflict"
            if self._used is not None:
                self._used.add(identity)
            return "created"
        for attempt in range(CONTENTION_RETRY_FACTOR * self.conflict_retries):
            if records.record_labels(current) != labels:
                return "taken"
            refs = records.node_references(current) | ({node} if node else set())
            desired = records.with_references(current, refs)  # a reference clears the GC mark
            if desired == current:
                return "exists"
            try:
                await self.store.update(desired)
                return "exists"
            except Conflict:
                # Many nodes referencing one identity at once: each round one writer wins.
                await asyncio.sleep(random.uniform(0, 0.002 * (attempt + 1)))
            except NotFound:
                return "conflict"  # deleted by GC meanwhile: start over
            try:
                current = await self.store.get(records.KIND, str(identity))
            except NotFound:
                return "conflict"
        return "conflict"

    async def release(self, node: str, identity: int) -> bool:
        """Drop ``node``'s reference to ``identity``; returns whether one was dropped.

        Absent identities and reserved ids are a no-op. GC deletes the identity once
        nothing references it past the heartbeat timeout.

        Raises:
            AllocationContention: the record kept changing.
        """
        if identity < self.min_id:
            return False
        for _ in range(self.conflict_retries):
            try:
                current = await self.store.get(records.KIND, str(identity))
            except NotFound:
                return False
            refs = records.node_references(current)
            if node not in refs:
                return False
            try:
                await self.store.update(records.with_references(current, refs - {node}))
            except (Conflict, NotFound):
                continue
            return True
        raise AllocationContention(f"identity {identity} kept changing during release; retry")

    async def delete(self, identity: int, expected_version: str = "") -> None:
        """Delete CiliumIdentity ``identity`` (precondition ``expected_version`` when given).

        The label set's key is kept on purpose: keys are never deleted, so a label set
        has at most one key at any time and an Allocate racing with this delete simply
        recreates the identity under the same number (or, if another label set took the
        number meanwhile, moves the key). Deleting keys would need a fence across two
        records, which the Store cannot update atomically.

        Raises:
            NotFound: no such identity.
            Conflict: the precondition failed (the identity changed: it is in use again).
        """
        deleted = await self.store.delete(records.KIND, str(identity), "", expected_version)
        self.forget(identity)
        labels = records.record_labels(deleted)
        log.info("identity deleted", extra={"identity": identity,
                 "labels": labels.strings() if labels else []})  # fmt: skip
