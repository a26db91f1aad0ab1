"""The Service controller of standalone mode: what kube-controller-manager's EndpointSlice and
ServiceCIDR controllers do, from what the operator knows. Leader only.

- **Default ServiceCIDR**: at start the ServiceCIDR ``kubernetes`` is created from
  ``--service-cluster-ip-range`` when it does not exist (as kube-apiserver does at start; an
  existing one is kept even when the flag differs -- ``spec.cidrs`` is immutable -- and a
  warning says so).
- **EndpointSlices** (upstream ``pkg/controller/endpointslice``): for every Service with a
  ``spec.selector``, the EndpointSlices labelled ``kubernetes.io/service-name: <service>``
  and ``endpointslice.kubernetes.io/managed-by: endpointslice-controller.cilia.io`` hold
  the endpoints the agents recorded (CiliumEndpoint records, ``EndpointService.
  UpsertEndpoint``) in the Service's namespace whose labels match the selector. An
  endpoint's labels are its security identity's labels of source ``k8s`` with the
  ``k8s:`` prefix stripped (the pod labels; upstream selects Pods by their labels, and
  the identity's ``k8s:`` labels are those). Each endpoint: its IPv4 address, conditions
  ready=true serving=true terminating=false (an agent records an endpoint once its pod
  is networked and deletes the record when the pod goes: a removed record takes its
  address out of the slice), ``nodeName``, ``targetRef`` the Pod. Slices hold at most
  100 endpoints (``--max-endpoints-per-slice`` upstream), sorted by address, named
  ``<service>-<n>``. Ports: a numeric ``targetPort`` is the slice port; a named
  ``targetPort`` cannot be resolved -- standalone agents do not report their pods'
  container ports -- so that port gets no slice port (its Service port has no backends)
  and a warning names it. Slices of other managers (applied for selector-less Services)
  are left alone; ours of a Service that is gone or lost its selector are deleted.
- **ServiceCIDR release** (upstream ``pkg/controller/servicecidrs``): a ServiceCIDR marked
  terminating (``ResourceService.Delete``, or a migration) is deleted once no Service holds
  an address in it -- a ClusterIP or an alias -- that no other live ServiceCIDR covers.
- **ServiceCIDR migration** (:mod:`.migration`): when the record
  ``CiliaServiceCIDRMigration/servicecidr-migration`` is applied, its steps run here (each
  one store transaction), and every ``alias_check_interval`` seconds the aliases are judged
  against ``alias_grace`` (:mod:`.aliases`) and the idle ones released.

Writes go to the store one object at a time with resourceVersion preconditions; a conflict
or a store error marks the Service again and it is retried after ``retry_interval``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..endpoint import records
from ..store import (
    AlreadyExists,
    Conflict,
    Expired,
    NotFound,
    Resource,
    Snapshot,
    Store,
    WatchEvent,
    Write,
)  # fmt: skip
from . import aliases, allocation, migration, model

log = logging.getLogger(__name__)

Key = tuple[str, str]  # namespace, name
K8S_SOURCE = "k8s:"


def endpoint_labels(record: Mapping[str, Any]) -> dict[str, str]:
    """The pod labels of a CiliumEndpoint record: its identity's ``k8s:key=value`` labels
    with the source stripped (other sources skipped)."""
    labels = ((record.get("status") or {}).get("identity") or {}).get("labels") or []
    out = {}
    for label in labels:
        text = str(label)
        if not text.startswith(K8S_SOURCE):
            continue
        key, _, value = text[len(K8S_SOURCE) :].partition("=")
        out[key] = value
    return out


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Service selector semantics: every ``key: value`` equal (an empty selector selects
    nothing, as upstream: such a Service gets no managed EndpointSlices)."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def slice_ports(service: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """``(EndpointSlice ports, names of ports skipped)`` of a Service: numeric targetPorts
    (default: the port); named ones are skipped (see the module docstring)."""
    ports, skipped = [], []
    for port in (service.get("spec") or {}).get("ports") or []:
        target = port.get("targetPort") or port.get("port")
        name = str(port.get("name") or "")
        if isinstance(target, str):
            skipped.append(name or str(port.get("port")))
            continue
        ports.append({"name": name, "port": int(target), "protocol": port.get("protocol") or "TCP"})
    return ports, skipped


def desired_slices(
    service: Mapping[str, Any], endpoints: Iterable[Resource], max_per_slice: int
) -> dict[str, dict[str, Any]]:
    """The EndpointSlices (name -> object) a Service with a selector should have, from the
    CiliumEndpoint records of its namespace; {} without a selector or for ExternalName."""
    spec = service.get("spec") or {}
    selector = spec.get("selector") or {}
    if not selector or spec.get("type") == "ExternalName":
        return {}
    namespace, name = model.key_of(service)
    chosen: dict[str, dict[str, Any]] = {}
    for record in endpoints:
        parsed = records.parse_endpoint(record)
        if parsed is None or parsed.namespace != namespace:
            continue
        if not selects(selector, endpoint_labels(record)):
            continue
        entry: dict[str, Any] = {
            "addresses": [parsed.ipv4],
            "conditions": {"ready": True, "serving": True, "terminating": False},
            "targetRef": {"kind": "Pod", "namespace": namespace, "name": parsed.name},
        }
        if parsed.node_name:
            entry["nodeName"] = parsed.node_name
        chosen[parsed.ipv4] = entry
    ports, _ = slice_ports(service)
    ordered = [chosen[ip] for ip in sorted(chosen, key=ipaddress.IPv4Address)]
    out = {}
    chunks = [ordered[i : i + max_per_slice] for i in range(0, len(ordered), max_per_slice)]
    for i, chunk in enumerate(chunks or [[]]):
        slice_name = f"{name}-{i}"
        out[slice_name] = {
            "apiVersion": model.SLICE_API_VERSION,
            "kind": model.SLICE_KIND,
            "metadata": {
                "name": slice_name,
                "namespace": namespace,
                "labels": {
                    model.SERVICE_NAME_LABEL: name,
                    model.MANAGED_BY_LABEL: model.MANAGED_BY,
                },
            },
            "addressType": "IPv4",
            "endpoints": chunk,
            "ports": ports,
        }
    return out


def _same(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    fields = ("addressType", "endpoints", "ports")
    if any(current.get(f) != desired.get(f) for f in fields):
        return False
    return model.labels_of(current) == model.labels_of(desired)


class ServiceController:
    """Keeps EndpointSlices and ServiceCIDRs in standalone mode (module docstring).

    Args:
        store: the Store.
        service_cidrs: ``--service-cluster-ip-range`` (the default ServiceCIDR).
        max_per_slice: endpoints per EndpointSlice at most (100).
        retry_interval: seconds before a failed write or watch is tried again.
        stop_timeout: seconds :meth:`stop` waits for its tasks.
        alias_grace: ``--service-alias-grace-period`` (seconds).
        alias_check_interval: ``--service-alias-check-interval`` (seconds).
        pod_cidrs: ``--cluster-pool-ipv4-cidr`` (a migration target may not overlap them).
        clock: the wall clock (tests pass a fake one).

    ``await start()`` (lists every kind, creates the default ServiceCIDR, reconciles
    everything) then follows changes in the background; ``await stop()``. Leader only.
    """

    KINDS = (
        model.SERVICE_KIND, records.KIND, model.SLICE_KIND, model.CIDR_KIND, migration.KIND,
        aliases.USE_KIND,
    )  # fmt: skip
    CLUSTER_KINDS = (model.CIDR_KIND, migration.KIND, aliases.USE_KIND)

    def __init__(
        self,
        store: Store,
        service_cidrs: tuple[ipaddress.IPv4Network, ...] = (),
        *,
        max_per_slice: int = model.MAX_ENDPOINTS_PER_SLICE,
        retry_interval: float = 1.0,
        stop_timeout: float = 1.0,
        alias_grace: float = aliases.DEFAULT_GRACE_SECONDS,
        alias_check_interval: float = 5.0,
        pod_cidrs: tuple[ipaddress.IPv4Network, ...] = (),
        clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:
        self.alias_grace = alias_grace
        self.alias_check_interval = alias_check_interval
        self.pod_cidrs = pod_cidrs
        self.clock = clock
        self.migration_dirty = False
        self.store = store
        self.stop_timeout = stop_timeout
        self._stopped = False
        self.service_cidrs = service_cidrs
        self.max_per_slice = max_per_slice
        self.retry_interval = retry_interval
        self.objects: dict[str, dict[Key, Resource]] = {k: {} for k in self.KINDS}
        # indexes: namespace -> Services / endpoint records; Service -> our slices
        self.in_namespace: dict[str, dict[str, set[Key]]] = {
            model.SERVICE_KIND: {},
            records.KIND: {},
        }
        self.slices_of: dict[Key, set[Key]] = {}
        self.dirty: set[Key] = set()
        self.cidrs_dirty = False
        self.writes = 0
        self._warned: set[tuple[Key, str]] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    # ---------------------------------------------------------------- state

    def _key(self, kind: str, obj: Resource) -> Key:
        if kind in self.CLUSTER_KINDS:
            return "", str((obj.get("metadata") or {}).get("name") or "")
        return model.key_of(obj)

    def _put(self, kind: str, obj: Resource) -> Resource | None:
        """Keep ``obj`` (indexes too); returns what it replaced."""
        key = self._key(kind, obj)
        old = self._drop(kind, key)
        self.objects[kind][key] = obj
        if kind in (model.SERVICE_KIND, records.KIND):
            self.in_namespace[kind].setdefault(key[0], set()).add(key)
        elif kind == model.SLICE_KIND:
            owner = model.slice_service(obj)
            if owner is not None and model.labels_of(obj).get(model.MANAGED_BY_LABEL) == (
                model.MANAGED_BY
            ):
                self.slices_of.setdefault(owner, set()).add(key)
        return old

    def _drop(self, kind: str, key: Key) -> Resource | None:
        """Forget one object (indexes too); returns it."""
        old = self.objects[kind].pop(key, None)
        if old is None:
            return None
        if kind in (model.SERVICE_KIND, records.KIND):
            self.in_namespace[kind].get(key[0], set()).discard(key)
        elif kind == model.SLICE_KIND:
            owner = model.slice_service(old)
            if owner is not None:
                self.slices_of.get(owner, set()).discard(key)
        return old

    def _mark(self, kind: str, obj: Resource) -> None:
        """Mark what a change of ``obj`` may affect: its Service; for an endpoint, the
        Services of its namespace whose selector picks it; the ServiceCIDRs."""
        key = self._key(kind, obj)
        if kind == model.SERVICE_KIND:
            self.dirty.add(key)
            self.cidrs_dirty = True
        elif kind == records.KIND:
            labels = endpoint_labels(obj)
            for service_key in self.in_namespace[model.SERVICE_KIND].get(key[0], ()):
                service = self.objects[model.SERVICE_KIND][service_key]
                if selects((service.get("spec") or {}).get("selector") or {}, labels):
                    self.dirty.add(service_key)
        elif kind == model.SLICE_KIND:
            owner = model.slice_service(obj)
            if owner is not None and model.labels_of(obj).get(model.MANAGED_BY_LABEL) == (
                model.MANAGED_BY
            ):
                self.dirty.add(owner)
        elif kind == migration.KIND:
            self.migration_dirty = True
        elif kind == aliases.USE_KIND:
            pass  # judged at the next alias tick: a report every few seconds per node
        else:
            self.cidrs_dirty = True
        self._wake.set()

    def _listed(self, kind: str, items: Iterable[Resource]) -> None:
        old = list(self.objects[kind].values())
        for obj in old:
            self._drop(kind, self._key(kind, obj))
        for obj in items:
            self._put(kind, obj)
        for obj in [*old, *self.objects[kind].values()]:
            self._mark(kind, obj)

    def on_event(self, kind: str, event: WatchEvent) -> None:
        """One change of one of :attr:`KINDS`."""
        if event.type == "DELETED":
            old = self._drop(kind, self._key(kind, event.object))
        else:
            old = self._put(kind, event.object)
        if old is not None:
            self._mark(kind, old)  # an endpoint's old labels; a slice's old owner
        self._mark(kind, event.object)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """List every kind, create the default ServiceCIDR, then follow and reconcile.

        Raises:
            StoreError: a first list or the default ServiceCIDR's create failed.
        """
        self._stopped = False
        versions = {}
        for kind in self.KINDS:
            listed = await self.store.list(kind)
            self._listed(kind, listed.items)
            versions[kind] = listed.resource_version
        await self._default_cidr()
        self._tasks = [
            asyncio.create_task(self._follow(kind, versions[kind]), name=f"svc-watch-{kind}")
            for kind in self.KINDS
        ]
        self._tasks.append(asyncio.create_task(self._reconciler(), name="svc-reconcile"))
        self._tasks.append(asyncio.create_task(self._alias_ticker(), name="svc-alias-tick"))

    async def stop(self) -> None:
        """Cancel the watches and the reconciler; waits at most ``stop_timeout`` seconds.

        A Redis watch cancelled while its client is still connecting can stay pending
        (seen with redis-py's asyncio client: the cancelled read never returns); such a
        task is left behind, logged, and ends at its next store error (it returns instead
        of retrying once the controller is stopped) -- at the latest when the store closes.
        """
        self._stopped = True
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.stop_timeout)
        if pending:
            log.warning("service controller tasks did not stop in time; left to end",
                        extra={"tasks": sorted(t.get_name() for t in pending)})  # fmt: skip

    async def _default_cidr(self) -> None:
        if not self.service_cidrs:
            return
        stored = self.objects[model.CIDR_KIND].get(("", model.DEFAULT_CIDR_NAME))
        replaced = model.migrated_from(self.objects[model.CIDR_KIND].values())
        if stored is None and set(self.service_cidrs) <= replaced:
            log.warning(
                "--service-cluster-ip-range was migrated away from (servicecidr migrate): the "
                "default ServiceCIDR is not re-created; set the flag to the new range",
                extra={"flag": [str(c) for c in self.service_cidrs]},
            )
        elif stored is None:
            with contextlib.suppress(AlreadyExists):
                created = await self.store.create(model.default_cidr(list(self.service_cidrs)))
                self._put(model.CIDR_KIND, created)
                log.info("default ServiceCIDR created",
                         extra={"cidrs": [str(c) for c in self.service_cidrs]})  # fmt: skip
        elif model.cidr_networks(stored) != list(self.service_cidrs):
            log.warning(
                "the stored default ServiceCIDR differs from --service-cluster-ip-range; it is "
                "kept (spec.cidrs is immutable)",
                extra={"stored": [str(c) for c in model.cidr_networks(stored)],
                       "flag": [str(c) for c in self.service_cidrs]},
            )  # fmt: skip

    async def _follow(self, kind: str, since: str) -> None:
        while True:
            try:
                async for event in self.store.watch(kind, since):
                    since = event.resource_version
                    self.on_event(kind, event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopped:
                    return
                if not isinstance(exc, Expired):
                    log.warning("service controller watch failed; relisting",
                                extra={"kind": kind, "error": str(exc)})  # fmt: skip
                    await asyncio.sleep(self.retry_interval)
                with contextlib.suppress(Exception):
                    listed = await self.store.list(kind)
                    self._listed(kind, listed.items)
                    since = listed.resource_version

    async def _alias_ticker(self) -> None:
        """Judge the aliases every ``alias_check_interval`` while any exists (time alone
        makes an alias idle long enough)."""
        while True:
            await asyncio.sleep(self.alias_check_interval)
            services = self.objects[model.SERVICE_KIND].values()
            if any(model.alias_ips(s) for s in services) or migration.phase(
                self.objects[migration.KIND].get(("", migration.NAME))
            ) in ("Moving", "Aliased"):
                self.migration_dirty = True
                self._wake.set()

    async def _reconciler(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            failed = await self.reconcile_once()
            if failed:
                await asyncio.sleep(self.retry_interval)
                self._wake.set()

    # ---------------------------------------------------------------- reconcile

    async def reconcile_once(self) -> bool:
        """Reconcile every marked Service and, if marked, the ServiceCIDRs; True when
        something failed (it stays marked)."""
        failed = False
        dirty, self.dirty = self.dirty, set()
        for key in sorted(dirty):
            try:
                await self._reconcile_service(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("EndpointSlice write failed; retrying",
                            extra={"service": f"{key[0]}/{key[1]}", "error": str(exc)})  # fmt: skip
                self.dirty.add(key)
                failed = True
        if self.migration_dirty:
            self.migration_dirty = False
            try:
                await self.migrate_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("ServiceCIDR migration step failed; retrying",
                            extra={"error": str(exc)})  # fmt: skip
                self.migration_dirty = True
                failed = True
        if self.cidrs_dirty:
            self.cidrs_dirty = False
            try:
                await self._release_cidrs()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("ServiceCIDR release failed; retrying", extra={"error": str(exc)})
                self.cidrs_dirty = True
                failed = True
        return failed

    async def _reconcile_service(self, key: Key) -> None:
        service = self.objects[model.SERVICE_KIND].get(key)
        endpoints = [
            self.objects[records.KIND][k] for k in self.in_namespace[records.KIND].get(key[0], ())
        ]
        desired: dict[str, dict[str, Any]] = {}
        if service is not None:
            desired = desired_slices(service, endpoints, self.max_per_slice)
            for name in slice_ports(service)[1]:
                if (key, name) not in self._warned:
                    self._warned.add((key, name))
                    log.warning(
                        "named targetPort not resolved (standalone agents do not report "
                        "container ports): the port gets no backends; give a number",
                        extra={"service": f"{key[0]}/{key[1]}", "port": name},
                    )
        current = {
            k[1]: self.objects[model.SLICE_KIND][k] for k in list(self.slices_of.get(key, ()))
        }
        for name, obj in desired.items():
            have = current.get(name)
            if have is None:
                try:
                    stored = await self.store.create(obj)
                except AlreadyExists:
                    stored = await self.store.get(model.SLICE_KIND, name, key[0])
                    if model.labels_of(stored).get(model.MANAGED_BY_LABEL) != model.MANAGED_BY:
                        log.warning("EndpointSlice name taken by another manager; skipped",
                                    extra={"slice": f"{key[0]}/{name}"})  # fmt: skip
                        continue
                    obj = {**obj, "metadata": {**obj["metadata"],
                           "resourceVersion": stored["metadata"]["resourceVersion"]}}  # fmt: skip
                    stored = await self.store.update(obj)
                self.writes += 1
                self._put(model.SLICE_KIND, stored)
            elif not _same(have, obj):
                rv = (have.get("metadata") or {}).get("resourceVersion") or ""
                update = {**have, **{f: obj[f] for f in ("addressType", "endpoints", "ports")}}
                update["metadata"] = {**have["metadata"], "labels": obj["metadata"]["labels"],
                                      "resourceVersion": rv}  # fmt: skip
                stored = await self.store.update(update)
                self.writes += 1
                self._put(model.SLICE_KIND, stored)
        for name, have in current.items():
            if name in desired:
                continue
            rv = str((have.get("metadata") or {}).get("resourceVersion") or "")
            with contextlib.suppress(NotFound):
                await self.store.delete(model.SLICE_KIND, name, key[0], rv)
            self.writes += 1
            self._drop(model.SLICE_KIND, (key[0], name))

    async def migrate_once(self) -> None:
        """Run the migration's steps that are due (:mod:`.migration`): start, every move
        (one transaction each, logged), then the release of idle aliases.

        Raises:
            StoreError: a transaction failed (the step is tried again).
        """
        cached = migration.phase(self.objects[migration.KIND].get(("", migration.NAME)))
        if not self.objects[migration.KIND] and not any(
            model.alias_ips(s) for s in self.objects[model.SERVICE_KIND].values()
        ):
            return  # nothing to do: no migration record, no alias
        start_kinds = (migration.KIND, model.CIDR_KIND, model.SERVICE_KIND, migration.POOL_KIND)

        async def start(snapshot: Snapshot) -> list[Write]:
            return migration.start_writes(snapshot, self.clock(), self.pod_cidrs)

        if cached == "Pending":
            await self.store.transact(start_kinds, start)
        moved: list[migration.Move] = []

        async def move(snapshot: Snapshot) -> list[Write]:
            writes, done = migration.move_writes(snapshot, self.clock())
            moved[:] = [done] if done else []
            return writes

        while cached in ("Pending", "Moving"):
            await self.store.transact((migration.KIND, model.SERVICE_KIND, model.CIDR_KIND), move)
            if not moved:
                break
            m = moved[0]
            self.cidrs_dirty = True
            log.info("Service moved to the new ServiceCIDR; the old ClusterIP stays an alias",
                     extra={"service": m.service, "old": str(m.old), "new": str(m.new)})  # fmt: skip
        released: list[aliases.Verdict] = []

        async def release(snapshot: Snapshot) -> list[Write]:
            writes, gone = migration.release_writes(snapshot, self.clock(), self.alias_grace)
            released[:] = gone
            return writes

        kinds = (migration.KIND, model.SERVICE_KIND, aliases.USE_KIND, model.CIDR_KIND)
        await self.store.transact(kinds, release)
        for v in released:
            self.cidrs_dirty = True
            log.info("Service alias released: unused for the grace period",
                     extra={"service": v.service, "alias": str(v.ip),
                            "idle_s": round(v.idle_seconds, 1)})  # fmt: skip

    async def _release_cidrs(self) -> None:
        cidrs = list(self.objects[model.CIDR_KIND].values())
        if not any(model.cidr_terminating(c) for c in cidrs):
            return
        # fresh: the watches of Services and ServiceCIDRs are separate streams, so the
        # Services seen here may lag the terminating mark; after the mark (one transaction
        # with the Services) the Services in the range can only go away
        services = (await self.store.list(model.SERVICE_KIND)).items
        for cidr in cidrs:
            if not model.cidr_terminating(cidr):
                continue
            if allocation.cidr_holders(cidr, services, cidrs):
                continue
            name = str(cidr["metadata"]["name"])
            rv = str(cidr["metadata"].get("resourceVersion") or "")
            try:
                await self.store.delete(model.CIDR_KIND, name, "", rv)
            except NotFound:
                pass
            except Conflict:
                self.cidrs_dirty = True  # changed meanwhile: the watch brings it back
                continue
            self._drop(model.CIDR_KIND, ("", name))
            log.info("ServiceCIDR released: no Service holds an address in it",
                     extra={"servicecidr": name})  # fmt: skip
