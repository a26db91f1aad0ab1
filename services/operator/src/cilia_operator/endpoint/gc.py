"""CiliumEndpoint garbage collection (upstream ``operator/endpointgc``).

A CiliumEndpoint is written by its node's agent on CNI ADD and deleted on CNI DEL. When
a DEL never comes — the node was removed while its pods ran, the agent crashed between
the runtime's DEL and its own, a Pod was force-deleted on a node that is gone — the
record stays: its address stays in every node's ipcache and its identity stays alive
for the identity GC. Every ``--cilium-endpoint-gc-interval`` (upstream default 5m0s;
0 disables) the leader runs once:

1. lists CiliumEndpoints, then CiliumNodes, and in Kubernetes mode Pods (listed after
   the endpoints, so an endpoint written for a new Pod or by a new node is never judged
   against an older list);
2. a record whose owner (``status.networking.node-name``) has no CiliumNode is deleted:
   its node left the cluster (upstream deletes endpoints whose node is gone too);
3. in Kubernetes mode, a record whose Pod (same namespace and name) does not exist is
   deleted, as upstream's GC does for endpoints without a Pod;
4. each delete carries the record's resourceVersion: an agent that took the record over
   or rewrote it in between wins, and the record stays.

A record without an owner (written before owners were recorded) is left alone. At most
``--cilium-endpoint-gc-max-per-run`` records (Cilia's flag; default 1000) are deleted per
run so a store that lost its CiliumNodes by mistake is not emptied in one go; the rest
waits for the next run.

Metric (upstream name, a gauge counted up as upstream's Go counter has no ``_total``):
``cilium_operator_endpoint_gc_objects{outcome}``, ``success`` / ``failure`` per record.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ..kinds import NODE
from ..metrics import Metrics
from ..store import Conflict, NotFound, Store, StoreError, resource_version
from ..tasks import cancel_all
from . import records

log = logging.getLogger(__name__)

POD_KIND = "Pod"
"""Store kind of core v1 Pods (listed only by the Kubernetes store)."""
DEFAULT_MAX_PER_RUN = 1000


@dataclass(frozen=True)
class EndpointGCResult:
    """One run: records kept, deleted because their node or Pod is gone, and deletes that
    lost a race or were left for the next run."""

    kept: int
    node_gone: int
    pod_gone: int
    skipped: int


class EndpointGC:
    """Periodic CiliumEndpoint garbage collector (see the module docstring).

    Args:
        store: where endpoints, nodes (and Pods in Kubernetes mode) live.
        interval: seconds between runs (``--cilium-endpoint-gc-interval``; 0 disables).
        check_pods: also delete records whose Pod is gone (Kubernetes mode only: the
            Redis store has no Pods).
        max_per_run: at most this many deletes per run (``--cilium-endpoint-gc-max-per-run``).
        metrics: ``cilium_operator_endpoint_gc_objects`` is counted up.
    """

    def __init__(
        self,
        store: Store,
        *,
        interval: float,
        check_pods: bool,
        max_per_run: int = DEFAULT_MAX_PER_RUN,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        self.interval = interval
        self.check_pods = check_pods
        self.max_per_run = max_per_run
        self.metrics = metrics
        self._task: asyncio.Task[None] | None = None

    async def run_once(self) -> EndpointGCResult:
        """One GC pass.

        Raises:
            StoreError: the store cannot be reached (nothing is deleted after the failing
                call; what was deleted before it stays deleted).
        """
        endpoints = (await self.store.list(records.KIND)).items
        nodes = {o["metadata"]["name"] for o in (await self.store.list(NODE.kind)).items}
        pods: set[str] | None = None
        if self.check_pods:
            pods = {records.owner_of(o) for o in (await self.store.list(POD_KIND)).items}
        kept = node_gone = pod_gone = skipped = 0
        for record in endpoints:
            owner = records.node_name_of(record)
            if not owner:
                kept += 1
                continue
            if owner in nodes and (pods is None or records.owner_of(record) in pods):
                kept += 1
                continue
            if node_gone + pod_gone >= self.max_per_run:
                skipped += 1
                continue
            meta = record["metadata"]
            try:
                await self.store.delete(
                    records.KIND,
                    meta["name"],
                    meta.get("namespace") or records.DEFAULT_NAMESPACE,
                    resource_version(record),
                )
            except (Conflict, NotFound):
                skipped += 1  # rewritten or taken over in between, or deleted by its agent
                self._count("failure")
                continue
            self._count("success")
            node_left = owner not in nodes
            node_gone += node_left
            pod_gone += not node_left
            log.info("endpoint garbage-collected", extra={
                "endpoint": records.owner_of(record), "node": owner,
                "reason": "node gone" if node_left else "pod gone"})  # fmt: skip
        return EndpointGCResult(kept, node_gone, pod_gone, skipped)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.endpoint_gc_objects.labels(outcome).inc()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.run_once()
            except StoreError as exc:
                log.warning("endpoint gc run failed", extra={"error": str(exc)})

    def start(self) -> None:
        """Start the periodic runs (nothing when the interval is 0)."""
        if self.interval > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="endpoint-gc")

    async def stop(self) -> None:
        """Stop the periodic runs (an ongoing run is cancelled; see :func:`cancel_all`)."""
        if self._task is not None:
            await cancel_all([self._task])
            if self._task.done() and not self._task.cancelled():
                self._task.result()  # a crashed loop raises here
            self._task = None
