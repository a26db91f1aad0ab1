"""Regeneration of one endpoint: identity, policy-map entries, BPF programs, operator record.

The endpoint manager calls :meth:`Regeneration.create` after plumbing and
:meth:`Regeneration.delete` before unplumbing (the ``EndpointHooks`` protocol); it reads
and writes the owners of node state instead of holding copies:
``identity.IdentityAllocator`` (allocation, local reference counts, release),
``ipcache.IPCache`` (the endpoint's ``/32``), ``policy.PolicyEngine`` and
``policy.PolicyStreams`` (entries and readiness), the loaded ``datapath.loader.Datapath``
(endpoint map, tc programs) and the operator's EndpointService. Hubble reads the local
endpoints through :meth:`Regeneration.endpoint` / :meth:`Regeneration.endpoint_by_ip`.

Add (after the veth exists; every step is undone in reverse order on failure):

1. identity labels = ``pod_identity_labels(namespace, labels)`` (upstream label filter);
2. the identity of the labels: from the allocator's cache when another local endpoint
   holds the same labels (no round trip), else ``IdentityService.Allocate`` (operator
   unreachable: UNAVAILABLE); the identity is learned by the cache at once;
3. policy mode ``default``: wait up to ``--endpoint-policy-wait-timeout`` until the
   identity and policy streams have synced (upstream blocks endpoint creation until
   its policy is computed), else UNAVAILABLE;
4. ipcache ``pod/32 → identity``; the engine writes the endpoint's policy entries and,
   through ``on_enforce``, its ``cilia_endpoints`` entry (ep_id, identity, IPv4,
   enforcement flags);
5. both tc programs attached to the host veth — before the CNI result returns, so the
   pod never sends an unenforced packet;
6. ``EndpointService.UpsertEndpoint`` (every agent's ipcache learns IP → identity).

Del: detach, endpoint-map entry, policy entries, ipcache entry, then ``DeleteEndpoint``
and (when no local endpoint uses the identity any more) ``IdentityService.Release`` —
both best effort through a ``RetryQueue``.

Restart: :meth:`Regeneration.restore` re-attaches the freshly compiled programs with
``replace-filter`` and rewrites the endpoint entries keeping the enforcement flags found
in the pinned map; policy entries are adopted by ``PolicyEngine.restore`` and rewritten
only where they differ once both streams have synced. Maps and filters stay in the
kernel throughout, so running pods keep their enforcement and lose no packets.

Policy modes (``--enable-policy``, upstream ``enable-policy``): ``default`` enforces a
direction once a rule selects the endpoint for it; ``always`` enforces both directions
on every endpoint; ``never`` writes no policy entries and enforces nothing.

Source: upstream ``pkg/endpoint`` regeneration (reference: cilium-upstream.md §7).

Not thread-safe: every method runs on the agent's event loop (blocking netlink work is
sent to the executor).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.controlplane import (
    ControlPlane,
    OperatorRejected,
    OperatorUnavailable,
    RetryQueue,
)
from cilia_agent.datapath.layout import EndpointInfo, ip_to_map
from cilia_agent.datapath.loader import Datapath
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.identity.allocator import IdentityAllocator
from cilia_agent.identity.labels import LabelError, LabelSet, pod_identity_labels
from cilia_agent.ipcache import IPCache
from cilia_agent.policy.compiler import EndpointPolicy
from cilia_agent.policy.engine import PolicyEngine
from cilia_agent.policy.maps import PolicyMapError
from cilia_agent.policy.watcher import PolicyNotReady, PolicyStreams
from cilia_common.policy.model import DEFAULT_NAMESPACE

log = logging.getLogger(__name__)
T = TypeVar("T")

PolicyMode = Literal["default", "always", "never"]

__all__ = ["InvalidLabels", "LocalEndpoint", "PolicyMode", "PolicyNotReady", "Regeneration"]


class InvalidLabels(ValueError):
    """The pod's labels cannot form an identity (the message names the label)."""


@dataclass
class LocalEndpoint:
    """An enforced endpoint of this node (what Hubble reads to name flows).

    Attributes:
        rec: its state record.
        ifindex: host veth index the programs are attached to.
        identity: security identity.
        labels: identity labels.
        namespace: policy namespace (``default`` when the pod gave none).
        enforce: ``(ingress, egress)`` enforcement flags in ``cilia_endpoints``.
    """

    rec: EndpointRecord
    ifindex: int
    identity: int
    labels: LabelSet
    namespace: str
    enforce: tuple[bool, bool] = (True, True)

    @property
    def id(self) -> int:
        """Endpoint id."""
        return self.rec.id

    @property
    def pod_namespace(self) -> str:
        """Namespace shown in flows: the pod's, or the policy namespace for a named pod."""
        return self.rec.pod_namespace or (self.namespace if self.rec.pod_name else "")

    @property
    def pod_name(self) -> str:
        """Pod name ("" when the runtime gave none)."""
        return self.rec.pod_name

    @property
    def label_strings(self) -> tuple[str, ...]:
        """Identity labels as ``source:key=value`` strings."""
        return self.labels.strings()


@dataclass
class RegenerationStatus:
    """Numbers for ``cilia-agent status``."""

    endpoints: int
    pending_operator_calls: int


class Regeneration:
    """Identity + policy + BPF + operator record of the node's endpoints.

    Args:
        datapath: the loaded datapath (maps pinned, programs compiled).
        identities: the local identity allocator.
        ipcache: the node's ipcache (this writes its endpoints' ``/32``).
        engine: the policy engine (entries; calls back :meth:`on_enforce`).
        streams: readiness of policy computation.
        control: the operator's EndpointService (or the no-operator stand-in).
        retry: where best-effort operator calls are retried.
        executor: thread pool for tc attach/detach.
        node_name: this node.
        mode: ``--enable-policy``.
        policy_audit_mode: ``--policy-audit-mode``, written into every endpoint entry.
    """

    def __init__(
        self,
        *,
        datapath: Datapath,
        identities: IdentityAllocator,
        ipcache: IPCache,
        engine: PolicyEngine,
        streams: PolicyStreams,
        control: ControlPlane,
        retry: RetryQueue,
        executor: Executor,
        node_name: str,
        mode: PolicyMode = "default",
        policy_audit_mode: bool = False,
    ) -> None:
        self.datapath = datapath
        self.identities = identities
        self.ipcache = ipcache
        self.engine = engine
        self.streams = streams
        self.control = control
        self.retry = retry
        self.executor = executor
        self.node_name = node_name
        self.mode = mode
        self.policy_audit_mode = policy_audit_mode
        self._eps: dict[int, LocalEndpoint] = {}
        self._by_ip: dict[str, int] = {}
        self._by_ifindex: dict[int, int] = {}

    # ------------------------------------------------------------------ Hubble's getters

    def endpoint(self, ep_id: int) -> LocalEndpoint | None:
        """The enforced endpoint ``ep_id``, or None."""
        return self._eps.get(ep_id)

    def endpoint_by_ip(self, ip: str) -> LocalEndpoint | None:
        """The enforced endpoint holding ``ip``, or None."""
        ep_id = self._by_ip.get(ip)
        return self._eps.get(ep_id) if ep_id is not None else None

    def interface_name(self, ifindex: int) -> str | None:
        """Host veth name of the endpoint enforced on ``ifindex``, or None."""
        ep_id = self._by_ifindex.get(ifindex)
        ep = self._eps.get(ep_id) if ep_id is not None else None
        return ep.rec.host_ifname if ep is not None else None

    # ------------------------------------------------------------------ helpers

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _flags(self, policy: EndpointPolicy | None) -> tuple[bool, bool]:
        if self.mode == "never":
            return (False, False)
        if self.mode == "always" or policy is None:
            return (True, True)  # always, or fail-closed until the policy is computed
        return (policy.enforce_ingress, policy.enforce_egress)

    def _write_endpoint(self, ep: LocalEndpoint) -> None:
        self.datapath.set_endpoint(
            ep.ifindex,
            EndpointInfo(
                ep_id=ep.rec.id,
                sec_identity=ep.identity,
                ipv4=ip_to_map(ep.rec.ipv4),
                enforce_ingress=int(ep.enforce[0]),
                enforce_egress=int(ep.enforce[1]),
                policy_audit=int(self.policy_audit_mode),
            ),
        )

    def on_enforce(self, ep_id: int, policy: EndpointPolicy) -> None:
        """The engine recompiled ``ep_id``: write its enforcement flags (entries are in
        place before enforcement turns on)."""
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

    @property
    def ready(self) -> bool:
        """True once the identity and policy streams have synced (policies computable)."""
        return self.streams.ready

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

    def _endpoint_record(self, ep: LocalEndpoint) -> cp.EndpointRecord:
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

    def _register(self, ep: LocalEndpoint) -> None:
        self._eps[ep.rec.id] = ep
        self.identities.acquire(ep.identity, ep.rec.id)
        self._by_ip[ep.rec.ipv4] = ep.rec.id
        self._by_ifindex[ep.ifindex] = ep.rec.id
        self.ipcache.upsert_endpoint(ep.rec.ipv4, ep.identity, ep.rec.id)

    def _unregister(self, ep_id: int) -> LocalEndpoint | None:
        ep = self._eps.pop(ep_id, None)
        if ep is None:
            return None
        self.identities.drop(ep.identity, ep_id)
        if self._by_ip.get(ep.rec.ipv4) == ep_id:
            del self._by_ip[ep.rec.ipv4]
        if self._by_ifindex.get(ep.ifindex) == ep_id:
            del self._by_ifindex[ep.ifindex]
        self.ipcache.delete_endpoint(ep.rec.ipv4, ep_id)
        return ep

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
            # referenced by this Add at once (a concurrent failing Add must not release it);
            # served from the node's cache when another local endpoint holds these labels
            identity = await self.identities.allocate(labels.strings(), rec.id)
            undo.append(functools.partial(self.identities.release, identity, rec.id))
            if on_identity is not None:
                await on_identity(identity)
            self.identities.learn(identity, labels.strings())
            if self.mode == "default":
                await self.streams.wait_ready()
            if pending is not None:
                ifindex, pending = await pending, None
            assert isinstance(ifindex, int)
            if ifindex <= 0:
                ifindex = await self._run(socket.if_nametoindex, rec.host_ifname)
            host_index = ifindex
            ep = LocalEndpoint(rec, host_index, identity, labels, namespace, self._flags(None))
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
                policy = self.engine.set_endpoint(rec.id, labels, namespace, rec.pod_name)
                if policy is None:  # streams resyncing right now: fail closed until computed
                    self._write_endpoint(ep)
            else:
                self._write_endpoint(ep)
            undo.append(functools.partial(self.datapath.detach, host_index))
            upsert = asyncio.ensure_future(self.control.upsert_endpoint(self._endpoint_record(ep)))
            inflight = (upsert,)

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
            # attached on the loop while the upsert is in flight: one batch of three
            # rtnetlink messages (~0.1 ms), cheaper than a hand-off to a worker thread
            try:
                self.datapath.attach(host_index)
            except Exception:
                await asyncio.wait(inflight)
                upsert.result()  # the operator's error first (UNAVAILABLE to the CNI)
                raise
            await upsert
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

    async def relabel(self, rec: EndpointRecord) -> int:
        """The labels of a running endpoint changed (``rec`` carries the new ones; in
        Kubernetes mode a Pod's or its Namespace's labels were edited): its identity and
        policy are computed again without touching the veth or the programs, as upstream
        regenerates an endpoint on a label change. Returns the identity now in force.

        Order: the new identity is allocated and learned; the ipcache ``/32`` (what other
        endpoints' policies look the pod up by), the policy entries and the endpoint map
        entry are rewritten; the operator's record is upserted (other nodes' ipcaches; a
        failure is retried in the background); the old identity is released when no local
        endpoint uses it any more. An unknown endpoint or unchanged identity labels change
        nothing.

        Raises:
            InvalidLabels: the new labels cannot form an identity (nothing changed).
            OperatorUnavailable: the identity could not be allocated (nothing changed).
            PolicyMapFull / PolicyMapError: the policy map cannot take the entries.
        """
        ep = self._eps.get(rec.id)
        if ep is None:
            return 0
        labels, namespace = self.identity_labels(rec)
        if labels == ep.labels and namespace == ep.namespace:
            ep.rec = rec
            return ep.identity
        identity = await self.identities.allocate(labels.strings(), rec.id)
        self.identities.learn(identity, labels.strings())
        old = ep.identity
        ep.rec, ep.identity, ep.labels, ep.namespace = rec, identity, labels, namespace
        self.ipcache.upsert_endpoint(rec.ipv4, identity, rec.id)
        if self.mode != "never":
            self.engine.set_endpoint(rec.id, labels, namespace, rec.pod_name)
        self._write_endpoint(ep)
        if old != identity:
            self.identities.release(old, rec.id)
        record = self._endpoint_record(ep)
        self.retry.submit(
            f"UpsertEndpoint {record.namespace}/{record.name}",
            functools.partial(self.control.upsert_endpoint, record),
        )
        log.info(
            "endpoint relabelled",
            extra={"endpoint_id": rec.id, "old_identity": old, "identity": identity},
        )
        return identity

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
            if not veth_deleted_next:  # one rtnetlink message: on the loop
                self.datapath.detach(ifindex)
            self.datapath.delete_endpoint(ifindex)
        try:
            self.engine.remove_endpoint(rec.id)
        except PolicyMapError:
            log.exception("deleting the policy entries of endpoint %d failed", rec.id)
        self._unregister(rec.id)
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
                try:
                    labels: tuple[str, ...] | None = self.identity_labels(rec)[0].strings()
                except InvalidLabels:
                    labels = None
                self.identities.release_if_unused(rec.identity, labels)

    def purge_ipcache(self, records: Iterable[EndpointRecord]) -> None:
        """Remove the pinned ipcache ``/32`` of endpoints cleaned up at restore (a crash
        mid-Add or a missed Del) unless a live local endpoint uses the address now."""
        for rec in records:
            if rec.ipv4:
                self.ipcache.purge(rec.ipv4)

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
            self.identities.seed(labels.strings(), rec.identity)
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
            ep = LocalEndpoint(rec, ifindex, rec.identity, labels, namespace, flags)
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
            self.identities.learn(rec.identity, labels.strings())
            if self.mode != "never":
                self.engine.set_endpoint(rec.id, labels, namespace, rec.pod_name)
        for ifindex in existing:
            if ifindex not in kept:
                self.datapath.delete_endpoint(ifindex)
        pruned = self.engine.prune()
        if pruned:
            log.info("restore: policy entries of gone endpoints removed", extra={"ids": pruned})
        return missing

    # ------------------------------------------------------------------ status

    def status(self) -> RegenerationStatus:
        """Counters for ``cilia-agent status``."""
        return RegenerationStatus(
            endpoints=len(self._eps), pending_operator_calls=self.retry.pending
        )
