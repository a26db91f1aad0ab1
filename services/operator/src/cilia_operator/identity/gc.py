"""Identity garbage collection (upstream ``operator/identitygc``, CRD mode; reference:
cilium-upstream.md §4).

Every ``--identity-gc-interval`` (upstream default 15m; 0 disables) one run:

1. lists CiliumEndpoints (an identity is *alive* when some endpoint's
   ``status.identity.id`` names it) and CiliumNodes (a node reference written by
   ``Allocate`` and not yet released keeps it alive while that node is registered);
2. an alive identity carrying the ``io.cilium.heartbeat`` mark loses it;
3. a dead identity without the mark gets it (the time it was first found dead);
4. a dead identity whose mark is older than ``--identity-heartbeat-timeout`` (upstream
   30m) is deleted with a resourceVersion precondition -- an ``Allocate`` in between
   changed the record, so the delete fails and the identity lives (the label-set key is
   kept: see ``IdentityAllocator.delete``). At most ``--identity-gc-rate-limit`` deletions happen per
   ``--identity-gc-rate-interval`` (upstream 2500 per 1m); the rest wait for a later run.

Several operator replicas may run GC at once: every write has a precondition.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..endpoint import slices
from ..endpoint.records import KIND as ENDPOINT_KIND
from ..kinds import NODE
from ..metrics import Metrics
from ..store import Conflict, NotFound, Store, StoreError, resource_version
from ..tasks import cancel_all
from . import records
from .allocator import IdentityAllocator

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GCResult:
    """Counts of one run: alive, newly marked, deleted, and dead ones left for later."""

    alive: int
    marked: int
    deleted: int
    deferred: int


def endpoint_identity(endpoint: dict[str, object]) -> int:
    """``status.identity.id`` of a CiliumEndpoint record (0 when absent)."""
    status = endpoint.get("status")
    ident = status.get("identity") if isinstance(status, dict) else None
    value = ident.get("id") if isinstance(ident, dict) else None
    return value if isinstance(value, int) else 0


class IdentityGC:
    """Periodic identity garbage collector.

    Args:
        store, allocator: where identities live and who deletes them.
        interval: seconds between runs (``--identity-gc-interval``; 0 disables).
        heartbeat_timeout: seconds an identity stays unreferenced before deletion.
        rate_interval / rate_limit: at most ``rate_limit`` deletions per ``rate_interval``
            seconds.
        metrics: ``cilium_operator_identity_gc_entries`` / ``_runs`` are updated.
        clock: wall-clock seconds (tests may pass their own).
    """

    def __init__(
        self,
        store: Store,
        allocator: IdentityAllocator,
        *,
        interval: float,
        heartbeat_timeout: float,
        rate_interval: float,
        rate_limit: int,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.allocator = allocator
        self.interval = interval
        self.heartbeat_timeout = heartbeat_timeout
        self.rate_interval = rate_interval
        self.rate_limit = rate_limit
        self.metrics = metrics
        self.clock = clock
        self._window_start = 0.0
        self._window_deletes = 0
        self._task: asyncio.Task[None] | None = None

    def _may_delete(self, now: float) -> bool:
        if now - self._window_start >= self.rate_interval:
            self._window_start, self._window_deletes = now, 0
        return self._window_deletes < self.rate_limit

    async def run_once(self) -> GCResult:
        """One GC pass (see the module docstring).

        Raises:
            StoreUnavailable: the store cannot be reached.
        """
        used = {endpoint_identity(o) for o in (await self.store.list(ENDPOINT_KIND)).items}
        # an identity a CiliumEndpointSlice references is alive too (upstream)
        for ces in (await self.store.list(slices.KIND)).items:
            used |= slices.slice_identities(ces)
        nodes = {o["metadata"]["name"] for o in (await self.store.list(NODE.kind)).items}
        alive = marked = deleted = deferred = 0
        for record in (await self.store.list(records.KIND)).items:
            identity = records.identity_id(record)
            if identity == 0:
                continue
            mark = records.heartbeat(record)
            if identity in used or records.node_references(record) & nodes:
                alive += 1
                if mark is not None:
                    with contextlib.suppress(Conflict, NotFound):
                        await self.store.update(records.with_heartbeat(record, None))
                continue
            now = self.clock()
            if mark is None:
                when = _dt.datetime.fromtimestamp(now, _dt.UTC)
                with contextlib.suppress(Conflict, NotFound):
                    await self.store.update(records.with_heartbeat(record, when))
                    marked += 1
                continue
            if now - mark.timestamp() < self.heartbeat_timeout:
                deferred += 1
                continue
            if not self._may_delete(now):
                deferred += 1
                continue
            try:
                await self.allocator.delete(identity, resource_version(record))
            except (Conflict, NotFound):
                continue  # referenced again (Allocate wrote it) or deleted by another replica
            self._window_deletes += 1
            deleted += 1
        result = GCResult(alive, marked, deleted, deferred)
        if self.metrics is not None:
            self.metrics.identity_gc_entries.labels("alive").set(alive)
            self.metrics.identity_gc_entries.labels("deleted").set(deleted)
        if deleted or marked:
            log.info("identity gc run", extra={"alive": alive, "marked": marked,
                     "deleted": deleted, "deferred": deferred})  # fmt: skip
        return result

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.run_once()
                outcome = "success"
            except StoreError as exc:
                log.warning("identity gc run failed", extra={"error": str(exc)})
                outcome = "failure"
            if self.metrics is not None:
                self.metrics.identity_gc_runs.labels(outcome).inc()

    def start(self) -> None:
        """Start the periodic runs (nothing when the interval is 0)."""
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="identity-gc")

    async def stop(self) -> None:
        """Stop the periodic runs (an ongoing run is cancelled; see :func:`cancel_all`)."""
        if self._task is not None:
            await cancel_all([self._task])
            if self._task.done() and not self._task.cancelled():
                self._task.result()  # a crashed loop raises here, as awaiting it did
            self._task = None
