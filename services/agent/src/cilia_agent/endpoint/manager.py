"""Endpoint lifecycle: create (Add), delete (Del), restore after a restart.

Order of an Add (upstream cilium-cni ADD, reference: cilium-upstream.md §7):
validate → readiness → allocate the IP → write the state file with state
``creating`` → plumb the datapath → enforcement hooks (identity, policy, BPF
programs attached; ``endpoint.enforcement``) → write state ``ready`` with the
identity. Any failure rolls back everything done so far (hooks undone, veth
deleted, IP released, state file removed). Del runs the hooks' delete first.

Operations on one attachment key ``(container_id, ifname)`` are serialised by
a per-key asyncio lock; different keys run concurrently (netlink and file work
runs in the ``--datapath-workers`` thread pool).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from cilia_agent.datapath import (
    DatapathError,
    LinuxDatapath,
    NetnsNotFound,
    PlumbRequest,
    PlumbResult,
    host_ifname,
)
from cilia_agent.endpoint.chaining import PrevResult, parse_prev_result
from cilia_agent.endpoint.errors import (
    AgentNotReady,
    CheckFailed,
    EndpointConflict,
    InvalidRequest,
    UnknownAttachment,
)
from cilia_agent.endpoint.netlink import (
    NetnsInterface,
    find_host_peer,
    host_link_index,
    inspect_interface,
)
from cilia_agent.endpoint.state import EndpointRecord, StateStore
from cilia_agent.ipam import IPAM, AddressInUse, PoolExhausted
from cilia_agent.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")
Key = tuple[str, str]
"""An attachment key ``(container_id, ifname)``."""
Keys = list[Key]
Lines = list[str]

_CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}$")
# Characters the kernel refuses in a name ('/', ':', whitespace: dev_valid_name) or takes as a
# name template ('%': "eth%d" becomes eth0, eth1, ...; dev_alloc_name).
_IFNAME_BAD = re.compile(r"[/\s:%]")
_POOL = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


@dataclass(frozen=True)
class AddParams:
    """Fields of an Add request (see ``cilia.agent.v1.AddRequest``)."""

    container_id: str
    ifname: str
    netns: str
    labels: dict[str, str] = field(default_factory=dict)
    pod_namespace: str = ""
    pod_name: str = ""
    pool: str = ""
    mtu: int = 0
    prev_result: str = ""
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckParams:
    """Fields of a Check request (see ``cilia.agent.v1.CheckRequest``).

    ``addresses`` are CIDR strings, ``routes`` ``(dst cidr, gateway or "")`` pairs; empty
    lists mean "what the agent recorded" (the pod /32 and the default route via the
    router, or for a chained endpoint the prevResult's). ``mac`` "" skips the MAC check.
    """

    container_id: str
    ifname: str
    netns: str = ""
    addresses: list[str] = field(default_factory=list)
    routes: list[tuple[str, str]] = field(default_factory=list)
    mac: str = ""


@dataclass
class RestoreReport:
    """What :meth:`EndpointManager.restore` did, by attachment ``container_id/ifname``."""

    restored: list[str] = field(default_factory=list)
    removed_stale: list[str] = field(default_factory=list)
    rolled_back: list[str] = field(default_factory=list)
    invalid_files: list[str] = field(default_factory=list)
    cleaned: list[EndpointRecord] = field(default_factory=list)
    """Records of every endpoint removed or rolled back (their operator records and
    identities are released by the enforcement layer)."""


#: Longest request value quoted in an error message (longer ones are cut, length named).
MAX_SHOWN_CHARS = 80


def _shown(value: str) -> str:
    """``repr(value)`` cut to :data:`MAX_SHOWN_CHARS` (the full length is named)."""
    text = repr(value)
    if len(text) <= MAX_SHOWN_CHARS:
        return text
    return f"{text[: MAX_SHOWN_CHARS - 4]}...' ({len(value)} chars)"


def validate_ifname(value: str, field_name: str = "ifname") -> None:
    """Raise InvalidRequest unless ``value`` is a Linux interface name: 1-15 bytes of UTF-8
    (IFNAMSIZ 16 with its NUL), not ``.``/``..``, without ``/``, ``:``, whitespace or ``%``."""
    if not value:
        raise InvalidRequest(field_name, "must not be empty")
    if len(value.encode()) > 15 or value in (".", "..") or _IFNAME_BAD.search(value):
        raise InvalidRequest(field_name, f"{_shown(value)} is not a valid interface name")


def validate_add(p: AddParams) -> None:
    """Check every Add field; raises InvalidRequest naming the first bad one."""
    if not _CONTAINER_ID.match(p.container_id):
        raise InvalidRequest(
            "container_id", f"{_shown(p.container_id)} must be 1-255 of [A-Za-z0-9_.-]"
        )
    validate_ifname(p.ifname)
    if not p.netns:
        raise InvalidRequest("netns", "must not be empty")
    if not p.netns.startswith("/"):
        raise InvalidRequest("netns", f"{p.netns!r} must be an absolute path")
    if p.pool and not _POOL.match(p.pool):
        raise InvalidRequest("pool", f"{p.pool!r} is not a valid pool name")
    if p.mtu and not 68 <= p.mtu <= 65535:
        raise InvalidRequest("mtu", f"{p.mtu} is outside 68..65535")
    for key in p.labels:
        if not key:
            raise InvalidRequest("labels", "label keys must not be empty")


class NodeView(Protocol):
    """What endpoints read of the local node (``cilia_agent.node.LocalNode``)."""

    @property
    def router_ip(self) -> ipaddress.IPv4Address | None:
        """The pods' gateway (None until the first CIDR arrived)."""

    @property
    def default_pool(self) -> str:
        """The pool of a pod that names none."""

    @property
    def not_ready_reason(self) -> str | None:
        """None when Adds may proceed, else why not."""


class PodLabels(Protocol):
    """Where an Add's labels come from in Kubernetes mode (``cilia_agent.k8s.PodCache``)."""

    async def endpoint_labels(self, namespace: str, name: str) -> dict[str, str] | None:
        """The Pod's endpoint labels (waiting a bounded time for the Pod), or None when
        the CNI call's labels are used (standalone mode).

        Raises:
            ValueError: the call does not name the Pod (Kubernetes mode).
            Exception: the Pod is not known in time (a retryable error)."""


class PoolSelection(Protocol):
    """Chooses a new pod's pool (``cilia_agent.ipam.selection.PoolSelector``)."""

    async def select(
        self,
        requested: str,
        namespace: str,
        name: str,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
    ) -> str:
        """The pool for the pod. Raises ValueError (the pool cannot be served) or
        OperatorUnavailable."""

    async def wait_for_addresses(
        self, exc: PoolExhausted, container_id: str, deadline: float | None
    ) -> float:
        """Wait after ``exc`` and return the deadline for the next attempt, or raise
        PoolExhausted / PoolPending when the Add must fail."""


class EndpointHooks(Protocol):
    """What the manager calls around plumbing (``endpoint.enforcement.Enforcement``)."""

    async def create(
        self,
        rec: EndpointRecord,
        ifindex: int | Awaitable[int],
        on_identity: Callable[[int], Awaitable[None]] | None = None,
    ) -> int:
        """Enforce policy on a plumbed endpoint; returns its identity. Undoes itself on error.

        ``ifindex`` is the host veth's index, or a future of it while the veth is being
        plumbed (the veth must not be touched before it resolves; its error is the plumb
        error). ``on_identity`` is awaited as soon as the identity is allocated."""

    async def delete(self, rec: EndpointRecord, *, veth_deleted_next: bool = False) -> None:
        """Remove what :meth:`create` (or a restore) set up for ``rec``.

        ``veth_deleted_next``: the caller deletes the host veth right afterwards (anything
        attached to the device goes with it)."""

    async def health(self, rec: EndpointRecord) -> list[str]:
        """Problems of ``rec``'s enforcement (programs, map entries); [] when healthy."""

    async def relabel(self, rec: EndpointRecord) -> int:
        """``rec``'s labels changed: re-compute its identity and policy; returns the
        identity in force."""


@dataclass
class _Caller:
    """Whether the caller of an Add is still waiting for its result."""

    gone: bool = False


def _owner(container_id: str, ifname: str) -> str:
    return f"{container_id}/{ifname}"


class EndpointManager:
    """Holds the node's endpoints and drives their lifecycle.

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
    ) -> None:
        self.ipam = ipam
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

    async def move_gateway(
        self, old: ipaddress.IPv4Address, new: ipaddress.IPv4Address, *, wait: float = 10.0
    ) -> bool:
        """The node's router IP moves from ``old`` to ``new``: once the Adds in flight (which
        may have read the old gateway) are done — at most ``wait`` seconds — every pod's
        default route is repointed and the old address removed
        (``LinuxDatapath.move_router_ip``). Chained endpoints (another plugin's routes)
        are left alone. Returns False, keeping ``old``, when a pod could not be repointed.

        Raises:
            DatapathError: the host device cannot be changed.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while self.adds_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        pods = [(r.netns, r.ifname) for r in self._endpoints.values() if not r.chained]
        problems = await self._run(self.datapath.move_router_ip, old, new, pods)
        if problems:
            log.warning("router IP not moved yet", extra={"problems": problems[:10]})
            return False
        log.info("router IP moved", extra={"old_router_ip": str(old), "router_ip": str(new)})
        return True

    async def relabel(self, namespace: str, name: str, labels: dict[str, str]) -> list[int]:
        """Pod ``namespace/name`` has new labels (Kubernetes mode: Pod or Namespace labels
        edited): each of its endpoints gets them, its identity and policy re-computed
        (:meth:`EndpointHooks.relabel`) and its state file rewritten. Returns the ids of
        the endpoints relabelled.

        Raises:
            StateError: a state file could not be written.
            Exception: from the hooks (identity allocation, policy maps); the endpoint
                keeps its previous labels then.
        """
        done: list[int] = []
        for key, rec in list(self._endpoints.items()):
            if rec.pod_namespace != namespace or rec.pod_name != name or rec.labels == labels:
                continue
            async with self._lock(key):
                current = self._endpoints.get(key)
                if current is None or current.labels == labels:
                    continue
                updated = current.model_copy(update={"labels": dict(labels)})
                if self.hooks is not None and current.identity:
                    identity = await self.hooks.relabel(updated)
                    updated = updated.model_copy(update={"identity": identity})
                await self._write(updated)
                self._endpoints[key] = updated
                done.append(updated.id)
        return done

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

    # --- Add -----------------------------------------------------------------------
    async def add(self, p: AddParams) -> EndpointRecord:
        """Create the endpoint of ``p`` (idempotent for the same key and netns).

        With ``p.prev_result`` (chaining) the container interface and its address come
        from the previous plugin: no veth is created and no address allocated.

        The work runs in its own task: when the caller is cancelled (the plugin was
        killed, gRPC cancels the handler) the Add still finishes — a failure rolls
        itself back — and a finished endpoint nobody received is deleted before the
        key's lock is released (a retried Add for the key then creates a fresh one), so
        an abandoned Add never leaks an address, veth, state file or BPF entry.

        Returns the ready endpoint record.

        Raises:
            InvalidRequest: a field is invalid (also: unusable prevResult, chained
                interface missing or not a veth with a host-side peer).
            AgentNotReady: no router IP / free address yet.
            EndpointConflict: the key exists with another netns.
            NetnsNotFound: the netns does not exist.
            InterfaceExists: ``ifname`` already exists in the netns.
            PoolExhausted: the pool has no free address (after waiting for the operator's
                allocation, see ``pools``); PoolPending: it did not come in time.
            DatapathError, StateError: plumbing or state file failure.
        """
        validate_add(p)
        if self.pods is not None and self.get(p.container_id, p.ifname) is None:
            try:
                labels = await self.pods.endpoint_labels(p.pod_namespace, p.pod_name)
            except ValueError as exc:  # PodRequired
                raise InvalidRequest("args", str(exc)) from exc
            if labels is not None:  # Kubernetes mode: the Pod's labels, not the call's
                p = dataclasses.replace(p, labels=labels)
        if self.pools is None or p.prev_result or self.get(p.container_id, p.ifname):
            return await self._add_once(p)
        # a new pod: its pool is chosen first (chained Adds and repeats skip this)
        try:
            pool = await self.pools.select(
                p.pool, p.pod_namespace, p.pod_name, p.labels, p.annotations
            )
        except ValueError as exc:  # ipam's PoolRefused: the pool field cannot be served
            raise InvalidRequest("pool", str(exc)) from exc
        p = dataclasses.replace(p, pool=pool)
        deadline: float | None = None
        while True:
            try:
                return await self._add_once(p)
            except PoolExhausted as exc:
                deadline = await self.pools.wait_for_addresses(exc, p.container_id, deadline)

    async def _add_once(self, p: AddParams) -> EndpointRecord:
        """One Add attempt of :meth:`add` (same errors)."""
        prev = parse_prev_result(p.prev_result, p.ifname) if p.prev_result else None
        key = (p.container_id, p.ifname)
        caller = _Caller()
        work = asyncio.get_running_loop().create_task(self._add(p, key, prev, caller))
        self._adding[key] += 1
        work.add_done_callback(lambda _t: self._add_finished(key))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            caller.gone = True
            self._background.add(work)
            work.add_done_callback(self._reap)
            raise

    def _add_finished(self, key: tuple[str, str]) -> None:
        self._adding[key] -= 1
        if self._adding[key] <= 0:
            del self._adding[key]

    def _busy(self, key: tuple[str, str]) -> bool:
        lock = self._locks.get(key)
        return lock is not None and lock.locked()

    def _reap(self, work: asyncio.Task[EndpointRecord]) -> None:
        """Drop an abandoned Add's task; its outcome was handled inside the task."""
        self._background.discard(work)
        if not work.cancelled():
            work.exception()  # retrieved: a failure was logged and rolled back already

    async def _add(
        self, p: AddParams, key: tuple[str, str], prev: PrevResult | None, caller: _Caller
    ) -> EndpointRecord:
        extra = {"container_id": p.container_id, "ifname": p.ifname, "netns": p.netns}
        async with self._lock(key):
            existing = self._endpoints.get(key)
            if existing is not None:
                if existing.netns == p.netns and existing.state == "ready":
                    log.info("add: endpoint already exists, returning it", extra=extra)
                    return existing
                raise EndpointConflict(p.container_id, p.ifname, existing.netns)
            reason = self.node.not_ready_reason
            router = self.node.router_ip
            if prev is None and (reason is not None or router is None):
                raise AgentNotReady(reason or "router IP not known yet")
            if not self.datapath.netns_exists(p.netns):
                raise NetnsNotFound(p.netns)
            started = time.perf_counter()
            try:
                if prev is not None:
                    rec = await self._create_chained(p, key, prev)
                else:
                    assert router is not None
                    rec = await self._create(p, key, router, extra)
            except BaseException as exc:
                self.metrics.regenerations.labels(outcome="failure").inc()
                log.warning("add failed, rolled back", extra={**extra, "reason": str(exc)})
                raise
            finally:
                self._update_gauges()
            elapsed = time.perf_counter() - started
            self.metrics.add_duration.observe(elapsed)
            self.metrics.regenerations.labels(outcome="success").inc()
            log.info(
                "endpoint created",
                extra={
                    **extra,
                    "endpoint_id": rec.id,
                    "ipv4": rec.ipv4,
                    "host_ifname": rec.host_ifname,
                    "chained": rec.chained,
                    "duration_ms": round(elapsed * 1000, 2),
                },
            )
            if caller.gone:
                # nobody receives this result (the plugin was killed, the RPC cancelled):
                # delete it before another request for the key can see it
                log.warning("add: caller went away, deleting the endpoint it created", extra=extra)
                await self._delete_locked(key, rec, extra)
        self._on_change()
        return rec

    def _new_record(self, p: AddParams, **fields: Any) -> EndpointRecord:
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

    async def _create(
        self,
        p: AddParams,
        key: tuple[str, str],
        router: ipaddress.IPv4Address,
        extra: dict[str, str],
    ) -> EndpointRecord:
        pool = p.pool or self.node.default_pool
        owner = _owner(*key)
        address = self.ipam.allocate(pool, owner)
        self.metrics.ipam_events.labels(action="allocate", family="ipv4").inc()
        rec = self._new_record(p, ipv4=str(address), pool=pool, host_ifname=host_ifname(*key))
        wrote = plumbing = hooked = False
        try:
            await self._write(rec)
            wrote = True
            self._endpoints[key] = rec
            plumbing = True
            request = PlumbRequest(p.container_id, p.ifname, p.netns, address, router, rec.mtu)
            if self.hooks is None:
                result = await self._run(self.datapath.plumb, request)
            else:
                result, identity = await self._plumb_and_enforce(rec, request, self.hooks)
                hooked = True
                rec = rec.model_copy(update={"identity": identity})
            rec = rec.model_copy(
                update={
                    "host_mac": result.host_mac,
                    "container_mac": result.container_mac,
                    "state": "ready",
                }
            )
            await self._write(rec)
            self._endpoints[key] = rec
            return rec
        except BaseException:
            await asyncio.shield(self._rollback(key, rec, wrote, plumbing, hooked, extra))
            raise

    async def _plumb_and_enforce(
        self, rec: EndpointRecord, request: PlumbRequest, hooks: EndpointHooks
    ) -> tuple[PlumbResult, int]:
        """Plumb the veth while the hooks allocate the identity (one operator round trip
        overlapped with the netlink work); the hooks touch the veth only once it exists.

        Both always finish before this returns or raises: on a failure of either, the
        hooks have undone themselves and a veth that was created is still there for the
        caller's rollback (a failed plumb removes what it created itself).
        """
        loop = asyncio.get_running_loop()
        plumb: asyncio.Future[PlumbResult] = asyncio.ensure_future(
            self._run(self.datapath.plumb, request)
        )
        ifindex: asyncio.Future[int] = loop.create_future()

        def deliver(done: asyncio.Future[PlumbResult]) -> None:
            if ifindex.done():
                return
            if done.cancelled():
                ifindex.cancel()
            elif (exc := done.exception()) is not None:
                ifindex.set_exception(exc)
            else:
                ifindex.set_result(done.result().host_ifindex)

        plumb.add_done_callback(deliver)
        enforce = asyncio.ensure_future(hooks.create(rec, ifindex, self._identity_writer(rec)))
        try:
            await asyncio.wait((plumb, enforce))
        except BaseException:
            await asyncio.shield(asyncio.wait((plumb, enforce)))
            raise
        finally:
            if ifindex.done() and not ifindex.cancelled():
                ifindex.exception()  # retrieved: the plumb error is raised below
        plumb_failed = plumb.cancelled() or plumb.exception() is not None
        if plumb_failed and not enforce.cancelled() and enforce.exception() is None:
            # hooks that did not wait for the veth finished anyway: undo them too
            try:
                await asyncio.shield(hooks.delete(rec))
            except Exception as exc:
                log.error(
                    "rollback: cannot undo enforcement",
                    extra={"container_id": rec.container_id, "reason": str(exc)},
                )
        result = plumb.result()  # the netlink error first (e.g. InterfaceExists)
        return result, enforce.result()

    async def _create_chained(
        self, p: AddParams, key: tuple[str, str], prev: PrevResult
    ) -> EndpointRecord:
        """Adopt the previous plugin's interface (generic-veth chaining)."""
        iface = await self._run(inspect_interface, p.netns, p.ifname)
        if iface is None:
            raise InvalidRequest(
                "ifname",
                f"{p.ifname!r} does not exist in {p.netns}: chaining needs the previous "
                "plugin to create it",
            )
        ip = str(prev.address.ip)
        if ip not in {a.split("/", 1)[0] for a in iface.addresses}:
            raise InvalidRequest(
                "prev_result",
                f"address {prev.address} is not configured on {p.ifname} in {p.netns} "
                f"(it has {iface.addresses or 'no IPv4 address'})",
            )
        peer = await self._run(find_host_peer, iface)
        if peer is None:
            raise InvalidRequest(
                "ifname",
                f"{p.ifname} in {p.netns} is not a veth whose peer is in the host netns "
                "(generic-veth chaining)",
            )
        for other in self._endpoints.values():
            if other.host_ifname == peer.name:
                raise EndpointConflict(other.container_id, other.ifname, other.netns)
        rec = self._new_record(
            p,
            ipv4=ip,
            pool="",
            host_ifname=peer.name,
            host_mac=peer.mac,
            container_mac=iface.mac,
            chained=True,
            prev_result=p.prev_result,
        )
        wrote = False
        try:
            await self._write(rec)
            wrote = True
            self._endpoints[key] = rec
            if self.hooks is not None:
                identity = await self.hooks.create(rec, peer.ifindex, self._identity_writer(rec))
                rec = rec.model_copy(update={"identity": identity})
            rec = rec.model_copy(update={"state": "ready"})
            await self._write(rec)
            self._endpoints[key] = rec
            return rec
        except BaseException:
            # hooks.create undoes itself; the interface and address are the other plugin's
            self._endpoints.pop(key, None)
            if wrote:
                await asyncio.shield(self._remove(*key))
            raise

    def _identity_writer(self, rec: EndpointRecord) -> Callable[[int], Awaitable[None]]:
        """Persist the identity into the ``creating`` state file as soon as it exists, so
        a restore after a crash mid-Add releases it (:meth:`restore` → ``cleaned``)."""

        async def write(identity: int) -> None:
            await self._write(rec.model_copy(update={"identity": identity}))

        return write

    def _release_ip(self, rec: EndpointRecord) -> bool:
        """Release ``rec``'s address only when IPAM holds it for ``rec``'s own key.

        A record of one sandbox never frees an address another attachment holds now
        (e.g. a stale record whose address was handed to a newer sandbox). Chained
        endpoints hold no address of ours.
        """
        if rec.chained:
            return False
        owner = _owner(*rec.key)
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

    async def _rollback(
        self,
        key: tuple[str, str],
        rec: EndpointRecord,
        wrote: bool,
        plumbing: bool,
        hooked: bool,
        extra: dict[str, str],
    ) -> None:
        if hooked and self.hooks is not None:
            try:
                await self.hooks.delete(rec, veth_deleted_next=plumbing)
            except Exception as exc:
                log.error("rollback: cannot undo enforcement", extra={**extra, "reason": str(exc)})
        if plumbing:
            try:
                await self._run(self.datapath.unplumb, rec.host_ifname)
            except DatapathError as exc:
                log.error("rollback: cannot delete veth", extra={**extra, "reason": str(exc)})
        self._release_ip(rec)
        if wrote:
            await self._remove(*key)
        self._endpoints.pop(key, None)

    # --- Del -----------------------------------------------------------------------
    async def delete(
        self, container_id: str, ifname: str, netns: str = "", *, not_after_ms: int = 0
    ) -> bool:
        """Delete the endpoint of ``(container_id, ifname)``; True if one existed.

        Everything is looked up by the attachment key: the endpoint record, its state
        file, its host veth and the address (released only when IPAM holds it for this
        key), so a DEL of an old sandbox never touches a newer sandbox of the same pod.
        Succeeds when there is nothing to delete and when ``netns`` is empty or gone
        (the host side and the IP are cleaned up anyway). A leftover host veth of an
        unknown key is removed too. A chained endpoint is detached and forgotten; the
        other plugin's veth and address stay.

        Args:
            not_after_ms: when > 0 (a replayed DEL queued at this Unix ms time), an
                endpoint created after it is a newer attachment and is kept.

        Raises:
            InvalidRequest: ``container_id`` or ``ifname`` is empty/invalid.
            DatapathError, StateError: cleanup failed (the record is kept, so a
                retried Del can finish).
        """
        if not container_id:
            raise InvalidRequest("container_id", "must not be empty")
        validate_ifname(ifname)
        key = (container_id, ifname)
        extra = {"container_id": container_id, "ifname": ifname, "netns": netns}
        async with self._lock(key):
            rec = self._endpoints.get(key)
            if rec is not None and not_after_ms and rec.created_at_ms > not_after_ms:
                log.info(
                    "del: endpoint is newer than the queued DEL, kept",
                    extra={**extra, "endpoint_id": rec.id},
                )
                return False
            if rec is None:
                leftover = await self._run(self.datapath.unplumb, host_ifname(*key))
                log.info(
                    "del: no such endpoint",
                    extra={**extra, "removed_leftover_veth": leftover},
                )
                self._forget_lock(key)
                if self.ipam.forget_pending(_owner(*key)):  # a DEL after a failed ADD
                    self._on_change()
                return False
            await self._delete_locked(key, rec, extra)
        self._forget_lock(key)
        self.ipam.forget_pending(_owner(*key))
        self._on_change()
        return True

    async def _delete_if(self, key: tuple[str, str], endpoint_id: int) -> bool:
        """Delete the endpoint of ``key`` only if it is still endpoint ``endpoint_id``."""
        extra = {"container_id": key[0], "ifname": key[1]}
        try:
            async with self._lock(key):
                rec = self._endpoints.get(key)
                if rec is None or rec.id != endpoint_id or rec.state == "creating":
                    return False
                await self._delete_locked(key, rec, extra)
        except Exception as exc:
            log.error("cannot delete endpoint", extra={**extra, "reason": str(exc)})
            return False
        self._forget_lock(key)
        self._on_change()
        return True

    async def _delete_locked(
        self, key: tuple[str, str], rec: EndpointRecord, extra: dict[str, str]
    ) -> None:
        rec = rec.model_copy(update={"state": "disconnecting"})
        self._endpoints[key] = rec
        await self._write(rec)
        if self.hooks is not None:
            await self.hooks.delete(rec, veth_deleted_next=not rec.chained)
        if not rec.chained:
            await self._run(self.datapath.unplumb, rec.host_ifname)
        self._release_ip(rec)
        await self._remove(*key)
        del self._endpoints[key]
        self._update_gauges()
        log.info(
            "endpoint deleted",
            extra={**extra, "endpoint_id": rec.id, "ipv4": rec.ipv4, "chained": rec.chained},
        )

    # --- Check ---------------------------------------------------------------------
    async def check(self, c: CheckParams) -> EndpointRecord:
        """Verify an attachment (CNI CHECK); returns its record when everything matches.

        Checked: the endpoint exists and is ready; its netns exists (and is the one
        given); the interface exists there and carries every expected address (the
        request's, else the record's /32), the MAC (when given) and every expected
        route (the request's, else the default route via the router; a route with an
        empty gateway matches any gateway); the host veth exists; the enforcement
        hooks report no problem (programs attached, endpoint map entry present).
        When the request lists addresses (the runtime's prevResult), the address the
        agent assigned (or the chained prevResult's) must be among them. The interface
        MTU must be the one configured at Add (not checked for chained endpoints).
        IPv6 addresses and routes in the request are not checked (IPv4 only).

        Raises:
            InvalidRequest: ``container_id``/``ifname`` invalid.
            UnknownAttachment: no endpoint for the key.
            AgentNotReady: the agent or the endpoint is not ready.
            CheckFailed: every difference found, in one message.
        """
        if not c.container_id:
            raise InvalidRequest("container_id", "must not be empty")
        validate_ifname(c.ifname)
        rec = self._endpoints.get((c.container_id, c.ifname))
        if rec is None:
            raise UnknownAttachment(c.container_id, c.ifname)
        if rec.state != "ready":
            raise AgentNotReady(f"endpoint {rec.id} is {rec.state}")
        reason = self.node.not_ready_reason
        if reason is not None and not rec.chained:
            raise AgentNotReady(reason)
        diffs: Lines = []
        if c.netns and c.netns != rec.netns:
            diffs.append(f"netns: expected {c.netns}, the endpoint is in {rec.netns}")
        iface: NetnsInterface | None = None
        if not self.datapath.netns_exists(rec.netns):
            diffs.append(f"netns {rec.netns} does not exist")
        else:
            iface = await self._run(inspect_interface, rec.netns, rec.ifname)
            if iface is None:
                diffs.append(f"interface {rec.ifname} not found in {rec.netns}")
        if iface is not None:
            diffs += self._compare(rec, c, iface)
        if not await self._run(host_link_index, rec.host_ifname):
            diffs.append(f"host veth {rec.host_ifname} does not exist")
        elif self.hooks is not None:
            diffs += await self.hooks.health(rec)
        if diffs:
            raise CheckFailed(c.container_id, c.ifname, diffs)
        return rec

    def _expected_routes(self, rec: EndpointRecord) -> Keys:
        if rec.chained:
            prev = parse_prev_result(rec.prev_result, rec.ifname)
            return [(r["dst"], r["gw"]) for r in prev.routes]
        router = self.node.router_ip
        return [("0.0.0.0/0", str(router) if router else "")]

    def _compare(self, rec: EndpointRecord, c: CheckParams, iface: NetnsInterface) -> Lines:
        diffs: Lines = []
        have = {ipaddress.ip_interface(a) for a in iface.addresses}
        expected = c.addresses or (
            [str(parse_prev_result(rec.prev_result, rec.ifname).address)]
            if rec.chained
            else [f"{rec.ipv4}/32"]
        )
        assigned = ipaddress.ip_interface(
            str(parse_prev_result(rec.prev_result, rec.ifname).address)
            if rec.chained
            else f"{rec.ipv4}/32"
        )
        wanted: set[ipaddress.IPv4Interface | ipaddress.IPv6Interface] = set()
        for text in expected:
            try:
                want = ipaddress.ip_interface(text)
            except ValueError:
                diffs.append(f"expected address {_shown(text)} is not an address")
                continue
            wanted.add(want)
            if want.version == 4 and want not in have:
                diffs.append(
                    f"address {want} missing on {rec.ifname} "
                    f"(has {', '.join(sorted(iface.addresses)) or 'none'})"
                )
        if c.addresses and assigned not in wanted:
            diffs.append(
                f"address {assigned} assigned at Add is not in the request's addresses "
                f"(prevResult.ips: {', '.join(sorted(map(str, wanted))) or 'none'})"
            )
        if not rec.chained and iface.mtu and iface.mtu != rec.mtu:
            diffs.append(f"mtu: expected {rec.mtu}, {rec.ifname} has {iface.mtu}")
        if c.mac and c.mac.lower() != iface.mac:
            diffs.append(f"mac: expected {c.mac.lower()}, {rec.ifname} has {iface.mac}")
        routes = c.routes or self._expected_routes(rec)
        have_routes = [(ipaddress.ip_network(d, strict=False), g) for d, g in iface.routes]
        for dst, gw in routes:
            try:
                net = ipaddress.ip_network(dst, strict=False)
            except ValueError:
                diffs.append(f"expected route {dst!r} is not a CIDR")
                continue
            if net.version != 4:
                continue
            if not any(n == net and (not gw or g == gw) for n, g in have_routes):
                via = f" via {gw}" if gw else ""
                diffs.append(f"route {net}{via} missing in {rec.netns}")
        return diffs

    # --- GC ------------------------------------------------------------------------
    async def gc(self, valid: set[Key]) -> Keys:
        """Release every attachment not in ``valid`` (CNI 1.1 GC); returns those released.

        Each released endpoint goes through the same path as Del (enforcement hooks:
        programs, BPF entries, identity reference, operator record; host veth; address;
        state file). Attachments whose Add or Del is in progress, and endpoints still
        ``creating``, are kept. Addresses IPAM holds for an attachment key that has no
        endpoint and no Add in progress (a leak) are released too. A failure on one
        attachment is logged and the others are still processed.
        """
        released: Keys = []
        for rec in list(self._endpoints.values()):
            key = rec.key
            if key in valid or key in self._adding or self._busy(key):
                continue
            if await self._delete_if(key, rec.id):
                released.append(key)
        for address, owner in self.ipam.allocated().items():
            cid, sep, ifname = owner.rpartition("/")
            key = (cid, ifname)
            if not sep or not _CONTAINER_ID.match(cid) or _IFNAME_BAD.search(ifname):
                continue
            if key in valid or key in self._endpoints or key in self._adding or self._busy(key):
                continue
            if self.ipam.allocated().get(address) == owner:
                self.ipam.release(address)
                self.metrics.ipam_events.labels(action="release", family="ipv4").inc()
                log.warning("gc: released an address without endpoint", extra={"owner": owner})
                if key not in released:
                    released.append(key)
        if released:
            log.info("gc: attachments released", extra={"released": [_owner(*k) for k in released]})
        return released

    # --- restore -------------------------------------------------------------------
    def restore(self) -> RestoreReport:
        """Restore endpoints from state files; run before serving (blocking).

        - ``ready`` endpoints whose netns and host veth still exist re-occupy
          their IPs (chained endpoints hold no IP of ours);
        - endpoints whose netns or host veth is gone (a missed DEL) are cleaned up;
        - ``creating`` endpoints (crash mid-Add) are rolled back;
        - ``disconnecting`` endpoints (crash mid-Del) are finished;
        - unreadable files are renamed to ``*.invalid`` and reported.
        """
        report = RestoreReport()
        records, bad = self.store.load_endpoints()
        for path in bad:
            path.rename(path.with_suffix(".invalid"))
            report.invalid_files.append(str(path))
        for rec in records:
            name = _owner(*rec.key)
            extra = {"container_id": rec.container_id, "ifname": rec.ifname, "netns": rec.netns}
            if rec.state != "ready":
                self._cleanup_restored(rec)
                report.rolled_back.append(name)
                report.cleaned.append(rec)
                log.info(f"restore: finished interrupted {rec.state} endpoint", extra=extra)
                continue
            if not self.datapath.netns_exists(rec.netns) or not self.datapath.link_exists(
                rec.host_ifname
            ):
                self._cleanup_restored(rec)
                report.removed_stale.append(name)
                report.cleaned.append(rec)
                log.info("restore: netns or host veth gone, endpoint removed", extra=extra)
                continue
            if not rec.chained:
                try:
                    self.ipam.occupy(rec.ipv4, name, rec.pool)
                except AddressInUse as exc:
                    log.error(
                        "restore: address claimed twice, endpoint removed",
                        extra={**extra, "reason": str(exc)},
                    )
                    self._cleanup_restored(rec)
                    report.removed_stale.append(name)
                    report.cleaned.append(rec)
                    continue
            self._endpoints[rec.key] = rec
            self._next_id = max(self._next_id, rec.id + 1)
            report.restored.append(name)
            log.info(
                "restore: endpoint restored",
                extra={**extra, "endpoint_id": rec.id, "ipv4": rec.ipv4},
            )
        self._update_gauges()
        return report

    def _cleanup_restored(self, rec: EndpointRecord) -> None:
        if not rec.chained:
            try:
                self.datapath.unplumb(rec.host_ifname)
            except DatapathError as exc:
                log.error(
                    "restore: cannot delete veth",
                    extra={"container_id": rec.container_id, "reason": str(exc)},
                )
        self.store.remove_endpoint(*rec.key)
