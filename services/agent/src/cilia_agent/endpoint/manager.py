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
import ipaddress
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from cilia_agent.datapath import (
    DatapathError,
    LinuxDatapath,
    NetnsNotFound,
    PlumbRequest,
    host_ifname,
)
from cilia_agent.endpoint.state import EndpointRecord, StateStore
from cilia_agent.ipam import IPAM, AddressInUse
from cilia_agent.metrics import Metrics

log = logging.getLogger(__name__)
T = TypeVar("T")

_CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,254}$")
_IFNAME_BAD = re.compile(r"[/\s:]")
_POOL = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class InvalidRequest(ValueError):
    """A request field is invalid; ``field`` names it."""

    def __init__(self, field_name: str, reason: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {reason}")


class AgentNotReady(Exception):
    """The agent cannot serve Add yet (no router IP or no free address); retry later."""


class EndpointConflict(Exception):
    """The attachment key already exists with a different netns."""

    def __init__(self, container_id: str, ifname: str, netns: str) -> None:
        self.container_id = container_id
        self.ifname = ifname
        super().__init__(
            f"attachment ({container_id}, {ifname}) already exists in network namespace {netns!r}"
        )


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


def validate_ifname(value: str, field_name: str = "ifname") -> None:
    """Raise InvalidRequest unless ``value`` is a Linux interface name (1-15 chars)."""
    if not value:
        raise InvalidRequest(field_name, "must not be empty")
    if len(value) > 15 or value in (".", "..") or _IFNAME_BAD.search(value):
        raise InvalidRequest(field_name, f"{value!r} is not a valid interface name")


def validate_add(p: AddParams) -> None:
    """Check every Add field; raises InvalidRequest naming the first bad one."""
    if not _CONTAINER_ID.match(p.container_id):
        raise InvalidRequest("container_id", f"{p.container_id!r} must be 1-255 of [A-Za-z0-9_.-]")
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


class EndpointHooks(Protocol):
    """What the manager calls around plumbing (``endpoint.enforcement.Enforcement``)."""

    async def create(self, rec: EndpointRecord, ifindex: int) -> int:
        """Enforce policy on a plumbed endpoint; returns its identity. Undoes itself on error."""

    async def delete(self, rec: EndpointRecord) -> None:
        """Remove what :meth:`create` (or a restore) set up for ``rec``."""


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
        readiness: returns None when Add may proceed, else the reason.
        default_pool: returns the current default pool name.
        router_ip: returns the router IP (None until known).
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
        readiness: Callable[[], str | None],
        default_pool: Callable[[], str],
        router_ip: Callable[[], ipaddress.IPv4Address | None],
        on_change: Callable[[], None] = lambda: None,
        hooks: EndpointHooks | None = None,
    ) -> None:
        self.ipam = ipam
        self.datapath = datapath
        self.store = store
        self.metrics = metrics
        self.executor = executor
        self.mtu = mtu
        self._readiness = readiness
        self._default_pool = default_pool
        self._router_ip = router_ip
        self._on_change = on_change
        self.hooks = hooks
        self._endpoints: dict[tuple[str, str], EndpointRecord] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._next_id = 1

    # --- helpers -------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

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
            await self._run(self.store.write_endpoint, rec)
            self._endpoints[key] = rec

    # --- Add -----------------------------------------------------------------------
    async def add(self, p: AddParams) -> EndpointRecord:
        """Create the endpoint of ``p`` (idempotent for the same key and netns).

        Returns the ready endpoint record.

        Raises:
            InvalidRequest: a field is invalid.
            AgentNotReady: no router IP / free address yet.
            EndpointConflict: the key exists with another netns.
            NetnsNotFound: the netns does not exist.
            InterfaceExists: ``ifname`` already exists in the netns.
            PoolExhausted: the pool has no free address.
            DatapathError, StateError: plumbing or state file failure.
        """
        validate_add(p)
        key = (p.container_id, p.ifname)
        extra = {"container_id": p.container_id, "ifname": p.ifname, "netns": p.netns}
        async with self._lock(key):
            existing = self._endpoints.get(key)
            if existing is not None:
                if existing.netns == p.netns and existing.state == "ready":
                    log.info("add: endpoint already exists, returning it", extra=extra)
                    return existing
                raise EndpointConflict(p.container_id, p.ifname, existing.netns)
            reason = self._readiness()
            router = self._router_ip()
            if reason is not None or router is None:
                raise AgentNotReady(reason or "router IP not known yet")
            if not self.datapath.netns_exists(p.netns):
                raise NetnsNotFound(p.netns)
            started = time.perf_counter()
            try:
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
                    "duration_ms": round(elapsed * 1000, 2),
                },
            )
        self._on_change()
        return rec

    async def _create(
        self,
        p: AddParams,
        key: tuple[str, str],
        router: ipaddress.IPv4Address,
        extra: dict[str, str],
    ) -> EndpointRecord:
        pool = p.pool or self._default_pool()
        owner = _owner(*key)
        address = self.ipam.allocate(pool, owner)
        self.metrics.ipam_events.labels(action="allocate", family="ipv4").inc()
        rec = EndpointRecord(
            id=self._next_id,
            container_id=p.container_id,
            ifname=p.ifname,
            netns=p.netns,
            ipv4=str(address),
            pool=pool,
            host_ifname=host_ifname(*key),
            mtu=p.mtu or self.mtu,
            labels=dict(p.labels),
            pod_namespace=p.pod_namespace,
            pod_name=p.pod_name,
            state="creating",
        )
        self._next_id += 1
        wrote = plumbing = hooked = False
        try:
            await self._run(self.store.write_endpoint, rec)
            wrote = True
            self._endpoints[key] = rec
            plumbing = True
            result = await self._run(
                self.datapath.plumb,
                PlumbRequest(p.container_id, p.ifname, p.netns, address, router, rec.mtu),
            )
            rec = rec.model_copy(
                update={"host_mac": result.host_mac, "container_mac": result.container_mac}
            )
            if self.hooks is not None:
                identity = await self.hooks.create(rec, result.host_ifindex)
                hooked = True
                rec = rec.model_copy(update={"identity": identity})
            rec = rec.model_copy(update={"state": "ready"})
            await self._run(self.store.write_endpoint, rec)
            self._endpoints[key] = rec
            return rec
        except BaseException:
            await asyncio.shield(self._rollback(key, rec, address, wrote, plumbing, hooked, extra))
            raise

    async def _rollback(
        self,
        key: tuple[str, str],
        rec: EndpointRecord,
        address: ipaddress.IPv4Address,
        wrote: bool,
        plumbing: bool,
        hooked: bool,
        extra: dict[str, str],
    ) -> None:
        if hooked and self.hooks is not None:
            try:
                await self.hooks.delete(rec)
            except Exception as exc:
                log.error("rollback: cannot undo enforcement", extra={**extra, "reason": str(exc)})
        if plumbing:
            try:
                await self._run(self.datapath.unplumb, rec.host_ifname)
            except DatapathError as exc:
                log.error("rollback: cannot delete veth", extra={**extra, "reason": str(exc)})
        self.ipam.release(address)
        self.metrics.ipam_events.labels(action="release", family="ipv4").inc()
        if wrote:
            await self._run(self.store.remove_endpoint, *key)
        self._endpoints.pop(key, None)

    # --- Del -----------------------------------------------------------------------
    async def delete(self, container_id: str, ifname: str, netns: str = "") -> bool:
        """Delete the endpoint of ``(container_id, ifname)``; True if one existed.

        Succeeds when there is nothing to delete and when ``netns`` is empty or
        gone (the host side and the IP are cleaned up anyway). A leftover host
        veth of an unknown key is removed too.

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
            if rec is None:
                leftover = await self._run(self.datapath.unplumb, host_ifname(*key))
                log.info(
                    "del: no such endpoint",
                    extra={**extra, "removed_leftover_veth": leftover},
                )
                self._forget_lock(key)
                return False
            rec = rec.model_copy(update={"state": "disconnecting"})
            self._endpoints[key] = rec
            await self._run(self.store.write_endpoint, rec)
            if self.hooks is not None:
                await self.hooks.delete(rec)
            await self._run(self.datapath.unplumb, rec.host_ifname)
            self.ipam.release(rec.ipv4)
            self.metrics.ipam_events.labels(action="release", family="ipv4").inc()
            await self._run(self.store.remove_endpoint, *key)
            del self._endpoints[key]
            self._update_gauges()
            log.info("endpoint deleted", extra={**extra, "endpoint_id": rec.id, "ipv4": rec.ipv4})
        self._forget_lock(key)
        self._on_change()
        return True

    # --- restore -------------------------------------------------------------------
    def restore(self) -> RestoreReport:
        """Restore endpoints from state files; run before serving (blocking).

        - ``ready`` endpoints whose netns and host veth still exist re-occupy
          their IPs;
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
        try:
            self.datapath.unplumb(rec.host_ifname)
        except DatapathError as exc:
            log.error(
                "restore: cannot delete veth",
                extra={"container_id": rec.container_id, "reason": str(exc)},
            )
        self.store.remove_endpoint(*rec.key)
