"""Enforcement of endpoints: identity, policy-map entries, BPF programs, Hubble metadata.

The one place where the endpoint lifecycle meets the eBPF datapath
(``datapath.loader.Datapath``), the policy engine (``policy.engine.PolicyEngine``),
Hubble's enrichment (``hubble.enrich.MemoryResolver``) and the operator's
identity/endpoint services. The endpoint manager calls :meth:`Enforcement.create`
after plumbing and :meth:`Enforcement.delete` before unplumbing; the agent feeds the
operator's watch streams through the ``consume_*`` methods.

Add (after the veth exists; every step is undone in reverse order on failure):

1. identity labels = ``pod_identity_labels(namespace, labels)`` (upstream label filter);
2. ``IdentityService.Allocate`` → identity (operator unreachable: UNAVAILABLE);
   the identity is fed to the engine and the resolver at once;
3. policy mode ``default``: wait up to ``--endpoint-policy-wait-timeout`` until the
   identity and policy streams have synced (upstream blocks endpoint creation until
   its policy is computed), else UNAVAILABLE;
4. ipcache ``pod/32 → identity``; the engine writes the endpoint's policy entries and,
   through ``on_enforce``, its ``cilia_endpoints`` entry (ep_id, identity, IPv4,
   enforcement flags);
5. both tc programs attached to the host veth — before the CNI result returns, so the
   pod never sends an unenforced packet;
6. the resolver learns the endpoint (flows show pod names);
7. ``EndpointService.UpsertEndpoint`` (every agent's ipcache learns IP → identity).

Del: detach, endpoint-map entry, policy entries, ipcache entry, resolver, then
``DeleteEndpoint`` and (when no local endpoint uses the identity any more)
``IdentityService.Release`` — both best effort through a :class:`RetryQueue`.

Restart: :meth:`Enforcement.restore` re-attaches the freshly compiled programs with
``replace-filter`` and rewrites the endpoint entries keeping the enforcement flags found
in the pinned map; policy entries are adopted by ``PolicyEngine.restore`` and rewritten
only where they differ once both streams have synced. Maps and filters stay in the
kernel throughout, so running pods keep their enforcement and lose no packets.

Policy modes (``--enable-policy``, upstream ``enable-policy``): ``default`` enforces a
direction once a rule selects the endpoint for it; ``always`` enforces both directions
on every endpoint; ``never`` writes no policy entries and enforces nothing.

Not thread-safe: every method runs on the agent's event loop (blocking netlink work is
sent to the executor).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.controlplane import OperatorRejected, OperatorUnavailable, RetryQueue
from cilia_agent.datapath.layout import IDENTITY_HOST, EndpointInfo, ip_to_map
from cilia_agent.datapath.loader import Datapath
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.hubble.enrich import MemoryResolver
from cilia_agent.identity.labels import (
    MINIMAL_CLUSTER_IDENTITY,
    LabelError,
    LabelSet,
    is_cluster_identity,
    pod_identity_labels,
)
from cilia_agent.metrics import Metrics
from cilia_agent.policy.compiler import EndpointPolicy
from cilia_agent.policy.engine import PolicyEngine
from cilia_agent.policy.maps import PolicyMapError, PolicyMapWriter
from cilia_agent.policy.model import DEFAULT_NAMESPACE

log = logging.getLogger(__name__)
T = TypeVar("T")

PolicyMode = Literal["default", "always", "never"]


class PolicyNotReady(Exception):
    """The identity/policy streams did not sync within ``--endpoint-policy-wait-timeout``."""


class InvalidLabels(ValueError):
    """The pod's labels cannot form an identity (the message names the label)."""


class ControlPlane(Protocol):
    """The operator calls enforcement needs (``controlplane.OperatorAPI``)."""

    async def allocate_identity(self, labels: list[str]) -> cp.Identity:
        """Identity of a sorted, filtered label set. Raises OperatorUnavailable."""

    async def release_identity(self, identity: int) -> None:
        """Drop this node's reference."""

    async def upsert_endpoint(self, record: cp.EndpointRecord) -> None:
        """Record the endpoint (feeds every agent's ipcache)."""

    async def delete_endpoint(self, namespace: str, name: str, container_id: str = "") -> None:
        """Remove the endpoint record (only this container's, when ``container_id`` is set)."""


class LocalControlPlane:
    """:class:`ControlPlane` for an agent without an operator (``--operator ''``).

    Identities are numbered by this agent alone from 256 up, one per label set (seeded
    from restored endpoints so numbers survive restarts); endpoint records go nowhere.
    Meant for tests and single-host setups: identities are not shared with other nodes.
    """

    def __init__(self) -> None:
        self._by_labels: dict[tuple[str, ...], int] = {}
        self._next = MINIMAL_CLUSTER_IDENTITY

    def seed(self, labels: Iterable[str], identity: int) -> None:
        """Reuse ``identity`` for ``labels`` (restored endpoint)."""
        key = tuple(sorted(labels))
        self._by_labels.setdefault(key, identity)
        self._next = max(self._next, identity + 1)

    async def allocate_identity(self, labels: list[str]) -> cp.Identity:
        """See :class:`ControlPlane`."""
        key = tuple(sorted(labels))
        identity = self._by_labels.get(key)
        if identity is None:
            identity = self._by_labels[key] = self._next
            self._next += 1
        return cp.Identity(id=identity, labels=list(key))

    async def release_identity(self, identity: int) -> None:
        """Identities stay numbered for the life of the process."""

    async def upsert_endpoint(self, record: cp.EndpointRecord) -> None:
        """No operator: nothing to record."""

    async def delete_endpoint(self, namespace: str, name: str, container_id: str = "") -> None:
        """No operator: nothing to delete."""


@dataclass
class _Endpoint:
    rec: EndpointRecord
    ifindex: int
    identity: int
    labels: LabelSet
    namespace: str
    enforce: tuple[bool, bool] = (True, True)  # (ingress, egress)


@dataclass
class EnforcementStatus:
    """Numbers for ``cilia-agent status``."""

    policy_revision: int
    policies: int
    identities: int
    synced: bool
    endpoints: int
    ipcache_entries: int
    pending_operator_calls: int


@dataclass
class _IpcacheState:
    remote: dict[str, int] = field(default_factory=dict)  # cidr → identity (from the stream)
    host: set[str] = field(default_factory=set)  # this node's addresses (identity 1)


def _net(cidr: str) -> ipaddress.IPv4Network:
    return ipaddress.IPv4Network(cidr, strict=False)


class Enforcement:
    """Identity + policy + BPF + Hubble metadata of the node's endpoints.

    Args:
        datapath: the loaded datapath (maps pinned, programs compiled).
        resolver: Hubble's enrichment store.
        control: operator calls (:class:`~cilia_agent.controlplane.OperatorAPI`) or a
            :class:`LocalControlPlane`.
        retry: where best-effort operator calls are retried.
        executor: thread pool for tc attach/detach.
        metrics: the agent's metrics (``cilium_policy``).
        node_name: this node.
        mode: ``--enable-policy``.
        policy_wait_timeout: ``--endpoint-policy-wait-timeout`` (s).
        policy_map_max: ``--bpf-policy-map-max`` (capacity the writer checks).
    """

    def __init__(
        self,
        *,
        datapath: Datapath,
        resolver: MemoryResolver,
        control: ControlPlane,
        retry: RetryQueue,
        executor: Executor,
        metrics: Metrics,
        node_name: str,
        mode: PolicyMode = "default",
        policy_wait_timeout: float = 10.0,
        policy_map_max: int = 65536,
    ) -> None:
        self.datapath = datapath
        self.resolver = resolver
        self.control = control
        self.retry = retry
        self.executor = executor
        self.metrics = metrics
        self.node_name = node_name
        self.mode = mode
        self.policy_wait_timeout = policy_wait_timeout
        self.engine = PolicyEngine(
            PolicyMapWriter(datapath.table("cilia_policy"), capacity=policy_map_max),
            on_enforce=self._on_enforce,
        )
        self._eps: dict[int, _Endpoint] = {}
        self._identity_users: dict[int, set[int]] = {}
        self._local_ips: dict[str, int] = {}  # pod IP → ep_id
        self._ipcache = _IpcacheState()
        self._resolver_identities: set[int] = set()
        self._local_labels: dict[int, tuple[str, ...]] = {}  # identities local endpoints use
        self._ready = asyncio.Event()

    # ------------------------------------------------------------------ helpers

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _flags(self, policy: EndpointPolicy | None) -> tuple[bool, bool]:
        if self.mode == "never":
            return (False, False)
        if self.mode == "always" or policy is None:
            return (True, True)  # always, or fail-closed until the policy is computed
        return (policy.enforce_ingress, policy.enforce_egress)

    def _write_endpoint(self, ep: _Endpoint) -> None:
        self.datapath.set_endpoint(
            ep.ifindex,
            EndpointInfo(
                ep_id=ep.rec.id,
                sec_identity=ep.identity,
                ipv4=ip_to_map(ep.rec.ipv4),
                enforce_ingress=int(ep.enforce[0]),
                enforce_egress=int(ep.enforce[1]),
            ),
        )

    def _on_enforce(self, ep_id: int, policy: EndpointPolicy) -> None:
        ep = self._eps.get(ep_id)
        if ep is None:
            return
        flags = self._flags(policy)
        if flags != ep.enforce:
            log.info(
                "endpoint enforcement changed",
                extra={"endpoint_id": ep_id, "ingress": flags[0], "egress": flags[1]},
            )
        ep.enforce = flags
        self._write_endpoint(ep)

    def _update_ready(self) -> None:
        if self.engine.ready:
            self._ready.set()
        else:
            self._ready.clear()
        self.metrics.policy.set(len(self.engine.repository))

    @property
    def ready(self) -> bool:
        """True once the identity and policy streams have synced (policies computable)."""
        return self.engine.ready

    async def wait_ready(self) -> None:
        """Wait up to ``policy_wait_timeout`` for :attr:`ready`.

        Raises:
            PolicyNotReady: the streams did not sync in time.
        """
        if self.engine.ready:
            return
        try:
            await asyncio.wait_for(self._ready.wait(), self.policy_wait_timeout)
        except TimeoutError as exc:
            raise PolicyNotReady(
                "policy not computable yet: identities/policies from the operator have not "
                f"synced within {self.policy_wait_timeout:g}s (--endpoint-policy-wait-timeout)"
            ) from exc

    def _learn_identity(self, identity: int, labels: Iterable[str]) -> None:
        """Feed an identity we allocated to the engine and resolver without waiting for
        the operator's stream (local endpoints are selectable at once)."""
        labels = list(labels)
        self.resolver.set_identity(identity, labels)
        self._resolver_identities.add(identity)
        if not is_cluster_identity(identity):
            return
        self._local_labels[identity] = tuple(sorted(labels))
        known = self.engine.identities.get(identity)
        if known is not None and known.strings() == tuple(sorted(labels)):
            return
        try:
            self.engine.on_identities(
                cp.WatchIdentitiesResponse(
                    events=[
                        cp.IdentityEvent(
                            type=cp.EVENT_TYPE_UPSERT,
                            identity=cp.Identity(id=identity, labels=labels),
                        )
                    ]
                )
            )
        except PolicyMapError:
            log.exception("policy map update after a new identity failed; retried later")

    def identity_labels(self, rec: EndpointRecord) -> tuple[LabelSet, str]:
        """The endpoint's identity labels and namespace.

        Raises:
            InvalidLabels: a label cannot be used.
        """
        namespace = rec.pod_namespace or DEFAULT_NAMESPACE
        try:
            return pod_identity_labels(namespace, rec.labels), namespace
        except LabelError as exc:
            raise InvalidLabels(f"labels: {exc}") from exc

    def _endpoint_record(self, ep: _Endpoint) -> cp.EndpointRecord:
        rec = ep.rec
        return cp.EndpointRecord(
            namespace=ep.namespace,
            name=rec.pod_name or rec.container_id,
            node_name=self.node_name,
            ipv4=rec.ipv4,
            identity=ep.identity,
            labels=list(ep.labels.strings()),
            endpoint_id=rec.id,
            container_id=rec.container_id,
        )

    def _register(self, ep: _Endpoint) -> None:
        self._eps[ep.rec.id] = ep
        self._identity_users.setdefault(ep.identity, set()).add(ep.rec.id)
        self._local_ips[ep.rec.ipv4] = ep.rec.id
        self.datapath.upsert_ipcache(ep.rec.ipv4, 32, ep.identity)

    def _unregister(self, ep_id: int) -> _Endpoint | None:
        ep = self._eps.pop(ep_id, None)
        if ep is None:
            return None
        users = self._identity_users.get(ep.identity)
        if users is not None:
            users.discard(ep_id)
        if self._local_ips.get(ep.rec.ipv4) == ep_id:
            del self._local_ips[ep.rec.ipv4]
            remote = self._ipcache.remote.get(f"{ep.rec.ipv4}/32")
            if remote is not None:  # the stream still knows the address (another node now)
                self.datapath.upsert_ipcache(ep.rec.ipv4, 32, remote)
            else:
                self.datapath.delete_ipcache(ep.rec.ipv4, 32)
        return ep

    def _release_if_unused(self, identity: int) -> None:
        users = self._identity_users.get(identity)
        if users:
            return
        self._identity_users.pop(identity, None)
        self._local_labels.pop(identity, None)
        if identity:
            self.retry.submit(
                f"Release identity {identity}", lambda: self.control.release_identity(identity)
            )

    def _publish(self, ep: _Endpoint) -> None:
        rec = ep.rec
        self.resolver.set_endpoint(
            rec.id,
            ipv4=rec.ipv4,
            identity=ep.identity,
            namespace=rec.pod_namespace or (ep.namespace if rec.pod_name else ""),
            pod_name=rec.pod_name,
            labels=ep.labels.strings(),
        )
        self.resolver.set_interface(ep.ifindex, rec.host_ifname)

    # ------------------------------------------------------------------ lifecycle

    async def create(
        self,
        rec: EndpointRecord,
        ifindex: int | Awaitable[int],
        on_identity: Callable[[int], Awaitable[None]] | None = None,
    ) -> int:
        """Give a plumbed endpoint its identity, policy and programs; returns the identity.

        ``ifindex`` is the host veth's index (0: looked up by name), or an awaitable of it
        while the veth is still being plumbed: the identity is allocated (and
        ``on_identity`` awaited) first, so that operator round trip overlaps the netlink
        work; nothing touches the veth before the awaitable has delivered (its error is
        raised after the identity is released again).

        ``on_identity`` is awaited with the identity right after the operator allocated
        it (the manager persists it, so a crash before the Add finishes can release it).

        The programs are attached while ``UpsertEndpoint`` is in flight (both before the
        return, so the pod never sends an unenforced packet and its operator record exists
        once the Add succeeds); when either fails, the record is deleted again along with
        everything else: awaited when the operator answered (so a retried Add of the same
        container cannot be overtaken by the deletion), through the retry queue when the
        upsert raised OperatorUnavailable (unreachable/deadline: no second
        ``--operator-timeout`` inside the Add; a timed-out upsert may have been stored).

        Raises:
            InvalidLabels: the labels cannot form an identity.
            OperatorUnavailable: identity allocation or the endpoint record failed.
            PolicyNotReady: policy not computable within the wait timeout.
            PolicyMapFull / PolicyMapError: the policy map cannot take the entries.
            pyroute2 NetlinkError, OSError: attaching failed.
        Everything done is undone before raising.
        """
        labels, namespace = self.identity_labels(rec)
        pending = None if isinstance(ifindex, int) else ifindex
        undo: list[Callable[[], Awaitable[None] | None]] = []
        inflight: tuple[asyncio.Future[Any], ...] = ()
        try:
            allocated = await self.control.allocate_identity(list(labels.strings()))
            identity = int(allocated.id)
            # the Add in flight uses the identity: a concurrent failing Add must not release it
            self._identity_users.setdefault(identity, set()).add(rec.id)

            def release() -> None:
                self._identity_users.get(identity, set()).discard(rec.id)
                self._release_if_unused(identity)

            undo.append(release)
            if on_identity is not None:
                await on_identity(identity)
            self._learn_identity(identity, labels.strings())
            if self.mode == "default":
                await self.wait_ready()
            if pending is not None:
                ifindex, pending = await pending, None
            assert isinstance(ifindex, int)
            if ifindex <= 0:
                ifindex = await self._run(socket.if_nametoindex, rec.host_ifname)
            host_index = ifindex
            ep = _Endpoint(rec, host_index, identity, labels, namespace, self._flags(None))
            self._register(ep)

            def unregister() -> None:
                self._unregister(rec.id)
                self.datapath.delete_endpoint(host_index)

            undo.append(unregister)
            if self.mode != "never":

                def remove_policy() -> None:
                    self.engine.remove_endpoint(rec.id)

                undo.append(remove_policy)
                # writes the policy entries, then the endpoint entry through on_enforce
                policy = self.engine.set_endpoint(rec.id, labels, namespace)
                if policy is None:  # streams resyncing right now: fail closed until computed
                    self._write_endpoint(ep)
            else:
                self._write_endpoint(ep)
            undo.append(lambda: self._run(self.datapath.detach, host_index))
            self._publish(ep)
            undo.append(lambda: self._unpublish(ep))
            attach = asyncio.ensure_future(self._run(self.datapath.attach, host_index))
            upsert = asyncio.ensure_future(self.control.upsert_endpoint(self._endpoint_record(ep)))
            inflight = (attach, upsert)

            def delete_record() -> Awaitable[None] | None:
                failed = upsert.done() and not upsert.cancelled() and upsert.exception()
                if isinstance(failed, OperatorUnavailable) and not isinstance(
                    failed, OperatorRejected
                ):
                    # the operator did not answer: no second --operator-timeout inline
                    self.retry.submit(*self._delete_call_of(rec))
                    return None
                return self._delete_record_now(rec)

            undo.append(delete_record)
            await asyncio.wait(inflight)
            upsert.result()  # the operator's error first (UNAVAILABLE to the CNI)
            attach.result()
            return identity
        except BaseException:
            # nothing is undone while a step is still running: the veth being plumbed (the
            # caller owns it), the attach, the operator call
            for running in (pending, *inflight):
                if running is not None:
                    with contextlib.suppress(BaseException):
                        await asyncio.shield(running)
            for step in reversed(undo):
                try:
                    result = step()
                    if result is not None:
                        await asyncio.shield(result)
                except Exception:
                    log.exception("undoing enforcement of endpoint %d failed", rec.id)
            raise

    def _delete_call_of(self, rec: EndpointRecord) -> tuple[str, Callable[[], Awaitable[None]]]:
        namespace = rec.pod_namespace or DEFAULT_NAMESPACE
        name = rec.pod_name or rec.container_id
        return f"DeleteEndpoint {namespace}/{name}", self._delete_call(
            namespace, name, rec.container_id
        )

    async def _delete_record_now(self, rec: EndpointRecord) -> None:
        """Delete the operator record of a failed Add before the Add returns (queued for
        retry when that fails)."""
        what, call = self._delete_call_of(rec)
        try:
            await call()
        except Exception as exc:
            log.warning(
                "rollback: deleting the operator record failed, retrying in the background",
                extra={"container_id": rec.container_id, "reason": str(exc)},
            )
            self.retry.submit(what, call)

    def _unpublish(self, ep: _Endpoint) -> None:
        self.resolver.remove_endpoint(ep.rec.id)
        self.resolver.remove_interface(ep.ifindex)

    async def delete(self, rec: EndpointRecord, *, veth_deleted_next: bool = False) -> None:
        """Remove the endpoint's programs, map entries and metadata; release its operator
        record and (when unused) its identity in the background.

        ``veth_deleted_next``: the caller deletes the host veth right after this (an own
        endpoint's Del): its clsact qdisc and both programs go with the device, so they are
        not detached one by one first (two netlink round trips and a socket saved). The map
        entries are removed either way, before the device goes.
        """
        ep = self._eps.get(rec.id)
        ifindex = ep.ifindex if ep is not None else 0
        if ifindex == 0:
            with contextlib.suppress(OSError):
                ifindex = await self._run(socket.if_nametoindex, rec.host_ifname)
        if ifindex:
            if not veth_deleted_next:
                await self._run(self.datapath.detach, ifindex)
            self.datapath.delete_endpoint(ifindex)
        try:
            self.engine.remove_endpoint(rec.id)
        except PolicyMapError:
            log.exception("deleting the policy entries of endpoint %d failed", rec.id)
        self._unregister(rec.id)
        self.resolver.remove_endpoint(rec.id)
        if ifindex:
            self.resolver.remove_interface(ifindex)
        self.forget([rec])

    async def health(self, rec: EndpointRecord) -> list[str]:
        """Problems of ``rec``'s enforcement, one line each ([] when healthy).

        Checked: the endpoint is registered here, its host veth still has the ifindex it
        was enforced on, the ``cilia_endpoints`` entry names this endpoint, and both tc
        programs are attached (clsact ingress ``cil_from_container``, egress
        ``cil_to_container``).
        """
        from cilia_agent.datapath.loader import (
            PARENT_EGRESS,
            PARENT_INGRESS,
            PROG_FROM_CONTAINER,
            PROG_TO_CONTAINER,
        )
        from cilia_agent.endpoint.netlink import bpf_filter_names, host_link_index

        ep = self._eps.get(rec.id)
        if ep is None:
            return [f"datapath: endpoint {rec.id} is not enforced (no identity/programs)"]
        problems: list[str] = []
        ifindex = await self._run(host_link_index, rec.host_ifname)
        if ifindex != ep.ifindex:
            problems.append(
                f"datapath: {rec.host_ifname} has ifindex {ifindex}, enforced on {ep.ifindex}"
            )
        info = self.datapath.endpoints().get(ep.ifindex)
        if info is None or int(info.ep_id) != rec.id:
            problems.append(f"datapath: no endpoint map entry for {rec.host_ifname}")
        filters = await self._run(bpf_filter_names, ep.ifindex, (PARENT_INGRESS, PARENT_EGRESS))
        for parent, prog in (
            (PARENT_INGRESS, PROG_FROM_CONTAINER),
            (PARENT_EGRESS, PROG_TO_CONTAINER),
        ):
            if not any(name.startswith(prog) for name in filters[parent]):
                problems.append(f"datapath: program {prog} not attached to {rec.host_ifname}")
        return problems

    def _delete_call(
        self, namespace: str, name: str, container_id: str
    ) -> Callable[[], Awaitable[None]]:
        return lambda: self.control.delete_endpoint(namespace, name, container_id)

    def forget(self, records: Iterable[EndpointRecord]) -> None:
        """Release the operator record and identity of endpoints that are gone.

        The operator's record is keyed by pod namespace/name: while a newer local endpoint
        (higher id: a newer sandbox of the same pod) holds that name, the record is its own
        and is not deleted.
        """
        for rec in records:
            namespace = rec.pod_namespace or DEFAULT_NAMESPACE
            name = rec.pod_name or rec.container_id
            newer = [
                ep.rec.container_id
                for ep in self._eps.values()
                if ep.rec.id > rec.id
                and (ep.rec.pod_namespace or DEFAULT_NAMESPACE) == namespace
                and (ep.rec.pod_name or ep.rec.container_id) == name
            ]
            if newer:
                log.info(
                    "operator record kept: a newer sandbox of the pod owns it",
                    extra={"container_id": rec.container_id, "newer": newer},
                )
            else:
                self.retry.submit(
                    f"DeleteEndpoint {namespace}/{name}",
                    self._delete_call(namespace, name, rec.container_id),
                )
            if rec.identity:
                self._release_if_unused(rec.identity)

    def purge_ipcache(self, records: Iterable[EndpointRecord]) -> None:
        """Remove the pinned ipcache ``/32`` of endpoints cleaned up at restore (a crash
        mid-Add or a missed Del) unless a live local endpoint uses the address now."""
        for rec in records:
            if rec.ipv4 and rec.ipv4 not in self._local_ips:
                try:
                    self.datapath.delete_ipcache(rec.ipv4, 32)
                except Exception as exc:
                    log.warning(
                        "cannot remove a stale ipcache entry",
                        extra={"ipv4": rec.ipv4, "reason": str(exc)},
                    )

    async def restore(self, records: Iterable[EndpointRecord]) -> list[EndpointRecord]:
        """Re-enforce endpoints restored from state files after a restart.

        Programs are replaced in place (``replace-filter``) and endpoint entries rewritten
        with the flags the pinned map holds (fail-closed when an entry is missing); the
        engine recompiles them once the streams have synced. Entries of endpoints that no
        longer exist are removed. Returns the records without an identity (created before
        BPF was enabled): :meth:`create` must be retried for them.
        """
        existing = self.datapath.endpoints()
        kept: set[int] = set()
        missing: list[EndpointRecord] = []
        for rec in records:
            try:
                ifindex = await self._run(socket.if_nametoindex, rec.host_ifname)
            except OSError:
                log.warning("restore: host veth %s is gone", rec.host_ifname)
                continue
            if rec.identity == 0:
                missing.append(rec)
                continue
            labels, namespace = self.identity_labels(rec)
            if isinstance(self.control, LocalControlPlane):
                self.control.seed(labels.strings(), rec.identity)
            old = existing.get(ifindex)
            if old is not None and old.ep_id == rec.id:
                flags = (bool(old.enforce_ingress), bool(old.enforce_egress))
            else:
                flags = self._flags(None)
                log.warning(
                    "restore: no endpoint map entry, enforcing both directions until the "
                    "policy is computed",
                    extra={"endpoint_id": rec.id, "host_ifname": rec.host_ifname},
                )
            ep = _Endpoint(rec, ifindex, rec.identity, labels, namespace, flags)
            if self.mode == "never":
                ep.enforce = (False, False)
            self._register(ep)
            self._write_endpoint(ep)
            kept.add(ifindex)
            try:
                await self._run(self.datapath.attach, ifindex)
            except Exception as exc:  # the old programs stay attached with the same maps
                log.error(
                    "restore: replacing the programs failed; the previous ones stay attached",
                    extra={
                        "endpoint_id": rec.id,
                        "host_ifname": rec.host_ifname,
                        "reason": str(exc),
                    },
                )
            self._learn_identity(rec.identity, labels.strings())
            self._publish(ep)
            if self.mode != "never":
                self.engine.set_endpoint(rec.id, labels, namespace)
        for ifindex in existing:
            if ifindex not in kept:
                self.datapath.delete_endpoint(ifindex)
        pruned = self.engine.prune()
        if pruned:
            log.info("restore: policy entries of gone endpoints removed", extra={"ids": pruned})
        return missing

    # ------------------------------------------------------------------ node addresses

    def set_host_addresses(self, addresses: Iterable[str]) -> None:
        """This node's addresses (and router IP) → identity 1 (host) in the ipcache."""
        for address in addresses:
            if not address:
                continue
            cidr = f"{ipaddress.IPv4Address(address)}/32"
            self._ipcache.host.add(cidr)
            self.datapath.upsert_ipcache(address, 32, IDENTITY_HOST)
            self.resolver.set_ipcache(cidr, IDENTITY_HOST)

    def local_synced(self) -> None:
        """No operator: there are no policies and no remote identities; mark both synced."""
        self.engine.on_identities(cp.WatchIdentitiesResponse(synced=True))
        self.engine.on_policies(cp.WatchPoliciesResponse(synced=True))
        self._update_ready()

    # ------------------------------------------------------------------ watch streams

    async def consume_identities(self, stream: AsyncIterable[cp.WatchIdentitiesResponse]) -> bool:
        """Follow one ``WatchIdentities`` stream (a new stream resyncs the cache).

        Identities of local endpoints missing from the initial listing (allocated while
        the listing was being taken) are kept: they are added to the listing rather than
        removed and re-added when the operator's event arrives.
        """
        delivered = False
        listed: set[int] | None = None
        async for response in stream:
            if not delivered:
                self.engine.identities.begin_resync()
                delivered = True
                listed = set()
            if listed is not None:
                listed.update(e.identity.id for e in response.events)
                if response.synced:
                    response = self._with_local_identities(response, listed)
                    listed = None
            try:
                self.engine.on_identities(response)
            finally:
                for event in response.events:
                    ident = event.identity
                    if event.type == cp.EVENT_TYPE_DELETE:
                        self.resolver.remove_identity(ident.id)
                        self._resolver_identities.discard(ident.id)
                    else:
                        self.resolver.set_identity(ident.id, list(ident.labels))
                        self._resolver_identities.add(ident.id)
                if response.synced:
                    stale = [
                        i for i in self._resolver_identities if i not in self.engine.identities
                    ]
                    for identity in stale:
                        self.resolver.remove_identity(identity)
                        self._resolver_identities.discard(identity)
                self._update_ready()
        return delivered

    def _with_local_identities(
        self, response: cp.WatchIdentitiesResponse, listed: set[int]
    ) -> cp.WatchIdentitiesResponse:
        extra = {i: labels for i, labels in self._local_labels.items() if i not in listed}
        if not extra:
            return response
        merged = cp.WatchIdentitiesResponse()
        merged.CopyFrom(response)
        for identity, labels in sorted(extra.items()):
            merged.events.append(
                cp.IdentityEvent(
                    type=cp.EVENT_TYPE_UPSERT,
                    identity=cp.Identity(id=identity, labels=list(labels)),
                )
            )
        return merged

    async def consume_policies(self, stream: AsyncIterable[cp.WatchPoliciesResponse]) -> bool:
        """Follow one ``WatchPolicies`` stream (a new stream resyncs the repository)."""
        delivered = False
        async for response in stream:
            if not delivered:
                self.engine.repository.begin_resync()
                delivered = True
            try:
                result, recompiled = self.engine.on_policies(response)
                if result.updates or recompiled:
                    log.info(
                        "policies applied",
                        extra={
                            "revision": self.engine.repository.revision,
                            "policies": len(self.engine.repository),
                            "recompiled_endpoints": sorted(recompiled),
                        },
                    )
            finally:
                self._update_ready()
        return delivered

    async def consume_ipcache(self, stream: AsyncIterable[cp.WatchIPCacheResponse]) -> bool:
        """Follow one ``WatchIPCache`` stream into the BPF ipcache and the resolver.

        Entries for this node's endpoints and addresses are owned locally and ignored;
        after a reconnect, entries the new listing does not contain are removed.
        """
        delivered = False
        seen: set[str] | None = set()
        async for response in stream:
            delivered = True
            for event in response.events:
                entry = event.entry
                try:
                    net = _net(entry.cidr)
                except ValueError:
                    log.warning("ipcache: ignoring bad CIDR %r", entry.cidr)
                    continue
                cidr = str(net)
                if seen is not None:
                    seen.add(cidr)
                if event.type == cp.EVENT_TYPE_DELETE:
                    self._ipcache_delete(cidr, net)
                else:
                    self._ipcache_upsert(cidr, net, entry)
            if response.synced and seen is not None:
                for cidr in [c for c in self._ipcache.remote if c not in seen]:
                    self._ipcache_delete(cidr, _net(cidr))
                seen = None
        return delivered

    def _locally_owned(self, cidr: str, net: ipaddress.IPv4Network) -> bool:
        return cidr in self._ipcache.host or (
            net.prefixlen == 32 and str(net.network_address) in self._local_ips
        )

    def _ipcache_upsert(
        self, cidr: str, net: ipaddress.IPv4Network, entry: cp.IPCacheEntry
    ) -> None:
        self._ipcache.remote[cidr] = entry.identity
        if self._locally_owned(cidr, net):
            return
        self.datapath.upsert_ipcache(
            str(net.network_address), net.prefixlen, entry.identity, entry.host_ip
        )
        self.resolver.set_ipcache(cidr, entry.identity, entry.owner)

    def _ipcache_delete(self, cidr: str, net: ipaddress.IPv4Network) -> None:
        if self._ipcache.remote.pop(cidr, None) is None:
            return
        if self._locally_owned(cidr, net):
            return
        self.datapath.delete_ipcache(str(net.network_address), net.prefixlen)
        self.resolver.remove_ipcache(cidr)

    # ------------------------------------------------------------------ status

    def status(self) -> EnforcementStatus:
        """Counters for ``cilia-agent status``."""
        return EnforcementStatus(
            policy_revision=self.engine.repository.revision,
            policies=len(self.engine.repository),
            identities=len(self.engine.identities),
            synced=self.engine.ready,
            endpoints=len(self._eps),
            ipcache_entries=len(self._ipcache.remote)
            + len(self._ipcache.host)
            + len(self._local_ips),
            pending_operator_calls=self.retry.pending,
        )
