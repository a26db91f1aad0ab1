"""The node's endpoints in memory: records by attachment key, ids, per-key locks, state files.

:class:`EndpointTable` is the base every part of the lifecycle builds on (``add``,
``delete``, ``check``, ``restore``, ``update``): it holds the records, serialises the
operations on one attachment key with a per-key asyncio lock (different keys run
concurrently), persists records through the state store (netlink and file work runs in the
``--datapath-workers`` thread pool), hands out endpoint ids, releases an endpoint's address
and keeps the endpoint gauges.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from cilia_agent.datapath import LinuxDatapath
from cilia_agent.endpoint.params import AddParams, owner_of
from cilia_agent.endpoint.protocols import EndpointHooks, NodeView, PodLabels, PoolSelection
from cilia_agent.endpoint.state import EndpointRecord, StateStore
from cilia_agent.ipam import IPAM
from cilia_agent.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")


class EndpointTable:
    """The endpoints of the node and the plumbing every lifecycle step shares.

    Args:
        ipam: the node allocator.
        datapath: kernel plumbing.
        store: state files.
        metrics: the agent's metrics.
        executor: pool running blocking netlink/file work.
        mtu: default MTU when a request gives 0.
        node: the local node (readiness, router IP, default pool).
        pools: chooses each new pod's pool and waits for the operator's allocation
            (None: the requested pool or the default pool, no waiting).
        on_change: called after every successful Add/Del (demand recomputation).
        hooks: identity/policy/BPF enforcement run after plumbing (None = plumbing only).
        pods: where an Add's labels come from in Kubernetes mode (None: the CNI call's).
        services_synced: awaited before a new endpoint is created: returns once the
            operator's Service stream has synced, raises TimeoutError when it did not in
            time (None: no wait — no operator or no load balancer).
    """

    def __init__(
        self,
        *,
        ipam: IPAM,
        datapath: LinuxDatapath,
        store: StateStore,
        metrics: Metrics,
        executor: Executor,
        mtu: int,
        node: NodeView,
        pools: PoolSelection | None = None,
        on_change: Callable[[], None] = lambda: None,
        hooks: EndpointHooks | None = None,
        pods: PodLabels | None = None,
        services_synced: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.ipam = ipam
        self.services_synced = services_synced
        self.pods = pods
        self.datapath = datapath
        self.store = store
        self.metrics = metrics
        self.executor = executor
        self.mtu = mtu
        self.node = node
        self.pools = pools
        self._on_change = on_change
        self.hooks = hooks
        self._endpoints: dict[tuple[str, str], EndpointRecord] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._next_id = 1
        self._adding: collections.Counter[tuple[str, str]] = collections.Counter()
        self._background: set[asyncio.Task[Any]] = set()
        #: addresses held in IPAM for running Pods the agent has no endpoint of
        #: (address -> (namespace, name)); see EndpointAdds._allocate
        self._foreign: dict[ipaddress.IPv4Address, tuple[str, str]] = {}

    # --- helpers -------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _write(self, rec: EndpointRecord) -> None:
        """Persist ``rec``. A durable store (``--state-fsync``: two fsyncs) writes in the
        worker pool; otherwise the small write + rename runs on the loop (~0.1 ms here),
        sparing a thread hand-off each way, which costs more than the write on a busy host.

        Raises:
            StateError: the file could not be written.
        """
        if self.store.durable:
            await self._run(self.store.write_endpoint, rec)
        else:
            self.store.write_endpoint(rec)

    async def _remove(self, container_id: str, ifname: str) -> None:
        """Remove a state file (an unlink: on the loop unless the store is durable)."""
        if self.store.durable:
            await self._run(self.store.remove_endpoint, container_id, ifname)
        else:
            self.store.remove_endpoint(container_id, ifname)

    def _lock(self, key: tuple[str, str]) -> asyncio.Lock:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    def _forget_lock(self, key: tuple[str, str]) -> None:
        lock = self._locks.get(key)
        if lock is not None and not lock.locked():
            del self._locks[key]

    def _update_gauges(self) -> None:
        self.metrics.endpoint.set(len(self._endpoints))
        counts = {"creating": 0, "ready": 0, "disconnecting": 0}
        for rec in self._endpoints.values():
            counts[rec.state] += 1
        for state, n in counts.items():
            self.metrics.endpoint_state.labels(state=state).set(n)

    @property
    def adds_in_flight(self) -> int:
        """Adds started and not finished (their plumbing may still use the old gateway)."""
        return sum(self._adding.values())

    def list(self) -> list[EndpointRecord]:
        """Every endpoint the agent holds, sorted by id."""
        return sorted(self._endpoints.values(), key=lambda r: r.id)

    def get(self, container_id: str, ifname: str) -> EndpointRecord | None:
        """The endpoint of an attachment key, or None."""
        return self._endpoints.get((container_id, ifname))

    async def set_identity(self, key: tuple[str, str], identity: int) -> None:
        """Record the identity of an existing endpoint (late enforcement after restore).

        Raises:
            StateError: the state file could not be written.
        """
        async with self._lock(key):
            rec = self._endpoints.get(key)
            if rec is None:
                return
            rec = rec.model_copy(update={"identity": identity})
            await self._write(rec)
            self._endpoints[key] = rec

    def _busy(self, key: tuple[str, str]) -> bool:
        """An operation on ``key`` holds its lock now."""
        lock = self._locks.get(key)
        return lock is not None and lock.locked()

    def _new_record(self, p: AddParams, **fields: Any) -> EndpointRecord:
        """A ``creating`` record for ``p`` with the next endpoint id."""
        rec = EndpointRecord(
            id=self._next_id,
            container_id=p.container_id,
            ifname=p.ifname,
            netns=p.netns,
            mtu=p.mtu or self.mtu,
            labels=dict(p.labels),
            pod_namespace=p.pod_namespace,
            pod_name=p.pod_name,
            state="creating",
            created_at_ms=int(time.time() * 1000),
            **fields,
        )
        self._next_id += 1
        return rec

    def _release_ip(self, rec: EndpointRecord) -> bool:
        """Release ``rec``'s address only when IPAM holds it for ``rec``'s own key.

        A record of one sandbox never frees an address another attachment holds now
        (e.g. a stale record whose address was handed to a newer sandbox). Chained
        endpoints hold no address of ours.
        """
        if rec.chained:
            return False
        owner = owner_of(*rec.key)
        holder = self.ipam.allocated().get(ipaddress.IPv4Address(rec.ipv4))
        if holder != owner:
            if holder is not None:
                log.error(
                    "not releasing an address held by another attachment",
                    extra={
                        "container_id": rec.container_id,
                        "ifname": rec.ifname,
                        "ipv4": rec.ipv4,
                        "holder": holder,
                    },
                )
            return False
        self.ipam.release(rec.ipv4)
        self.metrics.ipam_events.labels(action="release", family="ipv4").inc()
        return True

    def _identity_writer(self, rec: EndpointRecord) -> Callable[[int], Awaitable[None]]:
        """Persist the identity into the ``creating`` state file as soon as it exists, so
        a restore after a crash mid-Add releases it (:meth:`restore` → ``cleaned``)."""

        async def write(identity: int) -> None:
            await self._write(rec.model_copy(update={"identity": identity}))

        return write
