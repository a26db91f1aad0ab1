"""Creating an endpoint (CNI ADD): validate, allocate, plumb, enforce, or roll back.

Order of an Add (upstream cilium-cni ADD, reference: cilium-upstream.md §7):
validate → the Service stream synced (a new endpoint only; see :meth:`EndpointAdds.add`)
→ readiness → allocate the IP → write the state file with state
``creating`` → plumb the datapath → enforcement hooks (identity, policy, BPF
programs attached; ``endpoint.enforcement``) → write state ``ready`` with the
identity. Any failure rolls back everything done so far (hooks undone, veth
deleted, IP released, state file removed). A chained Add (prevResult) adopts the
previous plugin's interface instead (:mod:`cilia_agent.endpoint.chained`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import time
from dataclasses import dataclass

from cilia_agent.datapath import (
    DatapathError,
    NetnsNotFound,
    PlumbRequest,
    PlumbResult,
    host_ifname,
)
from cilia_agent.endpoint.chained import ChainedAdds
from cilia_agent.endpoint.chaining import PrevResult, parse_prev_result
from cilia_agent.endpoint.delete import EndpointDeletes
from cilia_agent.endpoint.errors import AgentNotReady, EndpointConflict, InvalidRequest
from cilia_agent.endpoint.params import AddParams, owner_of, validate_add
from cilia_agent.endpoint.protocols import EndpointHooks
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.ipam import PoolExhausted

log = logging.getLogger(__name__)


@dataclass
class _Caller:
    """Whether the caller of an Add is still waiting for its result."""

    gone: bool = False


class EndpointAdds(EndpointDeletes, ChainedAdds):
    """Add: the new endpoint, its rollback, and an abandoned Add's cleanup."""

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
            AgentNotReady: no router IP / free address yet; or the Service stream has not
                synced within ``--endpoint-service-wait-timeout`` (after an agent restart
                or a node reboot the Service maps are rebuilt from that stream: a pod
                created before would find ClusterIPs it cannot reach yet; upstream holds
                endpoint creation until its Kubernetes caches have synced).
            EndpointConflict: the key exists with another netns.
            NetnsNotFound: the netns does not exist.
            InterfaceExists: ``ifname`` already exists in the netns.
            PoolExhausted: the pool has no free address (after waiting for the operator's
                allocation, see ``pools``); PoolPending: it did not come in time.
            DatapathError, StateError: plumbing or state file failure.
        """
        validate_add(p)
        if self.services_synced is not None and self.get(p.container_id, p.ifname) is None:
            try:
                await self.services_synced()
            except TimeoutError as exc:
                raise AgentNotReady(
                    "Services not synced from the operator yet: a new pod could not reach "
                    "its ClusterIPs (--endpoint-service-wait-timeout)"
                ) from exc
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

    def _allocate(self, p: AddParams, pool: str, owner: str) -> ipaddress.IPv4Address:
        """The next free address of ``pool`` for ``owner`` that no other running Pod of
        this node holds (Kubernetes mode: the Pod stream's ``status.podIPs``).

        A Pod can hold an address the agent has no endpoint record of: ``helm uninstall``'s
        cleanup removes the state dir while Pods keep running, and a reinstalled agent
        starts with an empty IPAM. Such an address is kept in IPAM under the owner
        ``pod <namespace>/<name>`` (logged) and another one is taken; it is released again
        once that Pod no longer holds it (checked at every allocation).

        Raises:
            PoolExhausted: no free address left.
        """
        if self._foreign and self.pods is not None:
            held = self.ipam.allocated()
            for addr, (ns, name) in list(self._foreign.items()):
                if self.pods.holder(str(addr), ("", "")) != (ns, name):
                    if held.get(addr) == f"pod {ns}/{name}":  # not taken over meanwhile
                        self.ipam.release(addr)
                    del self._foreign[addr]
                    log.info("address no longer held by a pod without endpoint, released",
                             extra={"ip": str(addr), "pod": f"{ns}/{name}"})  # fmt: skip
        while True:
            address = self.ipam.allocate(pool, owner)
            holder = (
                self.pods.holder(str(address), (p.pod_namespace, p.pod_name))
                if self.pods is not None
                else None
            )
            if holder is None:
                return address
            self.ipam.release(address)
            self.ipam.occupy(address, f"pod {holder[0]}/{holder[1]}", pool)
            self._foreign[address] = holder
            log.warning(
                "address held by a running pod the agent has no endpoint of; kept, another "
                "one taken",
                extra={"ip": str(address), "pod": f"{holder[0]}/{holder[1]}"},
            )

    async def _create(
        self,
        p: AddParams,
        key: tuple[str, str],
        router: ipaddress.IPv4Address,
        extra: dict[str, str],
    ) -> EndpointRecord:
        pool = p.pool or self.node.default_pool
        owner = owner_of(*key)
        address = self._allocate(p, pool, owner)
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
