"""``servicecidr migrate --kubernetes``: a ServiceCIDR migration carried out against the
Kubernetes API (the cluster runs ``--store kubernetes``: kube-apiserver allocates
ClusterIPs, so the command re-creates Services itself; :mod:`cilia_operator.service.recreate`
says how and why).

The command prints the plan, then each step as it makes it, and records its progress in
the one ``CiliaServiceCIDRMigration`` object ``servicecidr-migration`` (CRD of the chart),
so that running it again with the same ``--to`` resumes where it stopped; a run with
another ``--to`` is refused while one is unfinished. One run at a time: it holds the Lease
``kube-system/cilia-servicecidr-migration``, renewed every third of ``--lease-duration``;
a second run is refused while the Lease is fresh, and takes it over once it expired (the
first run was interrupted).

Steps (``status.phase``):

- Moving: the new ServiceCIDR created, the old ones deleted (terminating: nothing new is
  allocated from them) with the finalizer ``cilia.io/service-aliases``; each Service
  re-created in the new range, its old ClusterIP an alias. A Service's entry is written
  (``state: recreating`` with its old and new address) before it is touched, so an
  interruption between its delete and its create is finished from the entry;
- AwaitingAPIServer: ``default/kubernetes`` is kube-apiserver's; after the API servers run
  with the new ``--service-cluster-ip-range`` the command (``--apiserver-updated``)
  deletes it under the same hold and the API server creates it again in the new range;
- Aliased: every alias idle for the grace period (every node's CiliaServiceAliasUse
  record) is removed from its Service;
- Done: the finalizers removed, the old ServiceCIDRs gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from ..service import aliases, migration, model, recreate
from ..store import AlreadyExists, Conflict, NotFound, Resource, StoreError
from ..store.kubernetes import KINDS, KubernetesStore
from .connection import CommandError

Net = ipaddress.IPv4Network
Addr = ipaddress.IPv4Address

LEASE_NAMESPACE = "kube-system"
LEASE_NAME = "cilia-servicecidr-migration"
RECORD_KINDS = {migration.KIND: KINDS[migration.KIND]}


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _micro(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class K8sMigration:
    """One run of ``servicecidr migrate --kubernetes`` (see the module docstring).

    Args:
        store: a :class:`KubernetesStore` with :data:`RECORD_KINDS`.
        out: where the plan and progress lines go.
        settle: ``--settle``: seconds between writing the EndpointSlice copies and deleting
            the Service, and between the re-created Service being served and deleting the
            copies (the time the operator and agents need to see a change; default 1).
        endpoints_timeout: ``--endpoints-timeout``: seconds to wait for a re-created
            Service's own EndpointSlices to list the endpoints the copies list.
        lease_duration: ``--lease-duration``: seconds a run's Lease stays valid unrenewed.
        wait_timeout: ``--wait-timeout``: seconds this run waits for aliases to be released.
        apiserver_timeout: seconds kube-apiserver may take to re-create ``default/kubernetes``
            (it reconciles it every 10 s).
        poll: seconds between two looks while waiting.
        sleep: the sleep coroutine (tests).
    """

    def __init__(
        self,
        store: KubernetesStore,
        out: IO[str],
        *,
        settle: float = 1.0,
        endpoints_timeout: float = 30.0,
        lease_duration: float = 15.0,
        wait_timeout: float = 600.0,
        apiserver_timeout: float = 60.0,
        poll: float = 1.0,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self.apiserver_timeout = apiserver_timeout
        self.store, self.out = store, out
        self.settle, self.endpoints_timeout = settle, endpoints_timeout
        self.lease_duration, self.wait_timeout, self.poll = lease_duration, wait_timeout, poll
        self.sleep = sleep
        self.identity = f"{socket.gethostname()}/{os.getpid()}"
        self.record: Resource = {}

    def say(self, line: str) -> None:
        """One progress line, flushed."""
        print(line, file=self.out, flush=True)

    # ------------------------------------------------------------------ reading

    async def _list(self, kind: str) -> list[Resource]:
        return list((await self.store.list(kind)).items)

    async def _get(self, kind: str, name: str, namespace: str = "") -> Resource | None:
        try:
            return await self.store.get(kind, name, namespace)
        except NotFound:
            return None

    async def _slices_of(self, key: tuple[str, str]) -> list[Resource]:
        return [s for s in await self._list(model.SLICE_KIND)
                if model.key_of(s)[0] == key[0] and model.slice_service(s) == key]  # fmt: skip

    # ------------------------------------------------------------------ the record

    async def _save(self, **status: Any) -> None:
        """Write ``status`` changes into the record (re-read and retried on a conflict: only
        this run writes it, the Lease says so)."""
        for _ in range(5):
            self.record["status"] = {**(self.record.get("status") or {}), **status}
            try:
                self.record = await self.store.update(self.record)
                return
            except Conflict:
                fresh = await self.store.get(migration.KIND, migration.NAME)
                fresh["status"] = self.record["status"]
                self.record = fresh
        raise CommandError("the migration record kept changing under this run")

    async def _entry(self, service: str, **fields: Any) -> None:
        entries = dict((self.record.get("status") or {}).get("services") or {})
        entries[service] = {**(entries.get(service) or {}), **fields}
        await self._save(services=entries)

    # ------------------------------------------------------------------ the Lease

    async def acquire(self) -> None:
        """Take the Lease (module docstring).

        Raises:
            CommandError: another run holds it and renewed it within its duration.
        """
        now = _now()
        lease: Resource = {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": LEASE_NAME, "namespace": LEASE_NAMESPACE},
            "spec": {"holderIdentity": self.identity, "renewTime": _micro(now),
                     "acquireTime": _micro(now),
                     "leaseDurationSeconds": max(1, round(self.lease_duration))},
        }  # fmt: skip
        current = await self._get("Lease", LEASE_NAME, LEASE_NAMESPACE)
        if current is None:
            try:
                await self.store.create(lease)
                return
            except AlreadyExists:
                current = await self.store.get("Lease", LEASE_NAME, LEASE_NAMESPACE)
        spec = current.get("spec") or {}
        renewed = model.parse_time(str(spec.get("renewTime") or ""))
        age = (now - renewed).total_seconds() if renewed else float("inf")
        holder = spec.get("holderIdentity")
        if (
            holder
            and holder != self.identity
            and age < float(spec.get("leaseDurationSeconds") or 0)
        ):
            raise CommandError(f"another 'servicecidr migrate' ({holder}) is running this "
                               f"migration (its lease {LEASE_NAMESPACE}/{LEASE_NAME} was renewed "
                               f"{age:.0f} s ago): wait for it, or run again once it stopped "
                               f"(the lease expires {spec.get('leaseDurationSeconds')} s after "
                               "its last renewal)")  # fmt: skip
        if holder and holder != self.identity:
            self.say(f"taking over from {holder} (its lease expired {age:.0f} s after its last "
                     "renewal: that run was interrupted)")  # fmt: skip
        lease["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        try:
            await self.store.update(lease)
        except Conflict:
            raise CommandError("another 'servicecidr migrate' took the lease "
                               f"{LEASE_NAMESPACE}/{LEASE_NAME} just now") from None  # fmt: skip

    async def renew_forever(self) -> None:
        """Renew the Lease every third of its duration until cancelled."""
        while True:
            await asyncio.sleep(self.lease_duration / 3)
            try:
                lease = await self.store.get("Lease", LEASE_NAME, LEASE_NAMESPACE)
                if (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    return
                lease["spec"]["renewTime"] = _micro(_now())
                await self.store.update(lease)
            except StoreError:
                continue

    async def release(self) -> None:
        """Delete the Lease if this run still holds it."""
        try:
            lease = await self.store.get("Lease", LEASE_NAME, LEASE_NAMESPACE)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                await self.store.delete("Lease", LEASE_NAME, LEASE_NAMESPACE,
                                        lease["metadata"]["resourceVersion"])  # fmt: skip
        except StoreError:
            pass

    # ------------------------------------------------------------------ planning

    async def plan(
        self, target: Net, node_networks: list[Net]
    ) -> tuple[migration.Plan, Resource | None, Resource | None]:
        """Check ``target`` and plan; returns ``(plan, the kubernetes Service to move or
        None, the current record or None)``.

        Raises:
            CommandError: a bad target (overlaps) or another migration unfinished.
        """
        record = await self._get(migration.KIND, migration.NAME)
        cidr_name = migration.default_cidr_name(target)
        if record is not None:
            spec = record.get("spec") or {}
            state = migration.phase(record)
            if state != "Done" and spec.get("to") != str(target):
                raise CommandError(f"a migration to {spec.get('to')} is {state}: finish it first "
                                   f"(servicecidr migrate --kubernetes --to {spec.get('to')})")  # fmt: skip
            if state != "Done":
                cidr_name = str(spec.get("serviceCIDRName") or cidr_name)
        services = await self._list(model.SERVICE_KIND)
        cidrs = await self._list(model.CIDR_KIND)
        pods = recreate.pod_ranges(await self._list("Node"), await self._list("CiliumNode"),
                                   await self._list("CiliumPodIPPool"))  # fmt: skip
        try:
            recreate.check_target_k8s(target, pods, recreate.node_addresses(
                await self._list("Node")), node_networks)  # fmt: skip
            plan, api = recreate.plan_k8s(services, cidrs, target, cidr_name)
        except migration.MigrationRefused as exc:
            raise CommandError(str(exc)) from None
        return plan, api, record

    # ------------------------------------------------------------------ the run

    async def run(
        self,
        target: Net,
        *,
        dry_run: bool,
        grace: float | None,
        grace_text: str,
        apiserver_updated: bool,
        node_networks: list[Net],
    ) -> None:
        """The whole command (module docstring).

        Raises:
            CommandError: refused (nothing changed) or a step failed (the record says
                where; run again to resume).
        """
        plan, api, record = await self.plan(target, node_networks)
        if record is not None and migration.phase(record) == "Done" and \
                (record.get("spec") or {}).get("to") == str(target) and not plan.moves and api is None:  # fmt: skip
            self.say(f"the migration to {target} is done (servicecidr status --kubernetes)")
            return
        for line in recreate.plan_lines(plan, api, grace_text, dry_run):
            self.say(line)
        if dry_run:
            return
        await self.acquire()
        renewer = asyncio.ensure_future(self.renew_forever())
        try:
            await self._execute(target, plan, api, record, grace, apiserver_updated)
        finally:
            renewer.cancel()
            await self.release()

    async def _execute(
        self,
        target: Net,
        plan: migration.Plan,
        api: Resource | None,
        record: Resource | None,
        grace: float | None,
        apiserver_updated: bool,
    ) -> None:
        if record is not None and migration.phase(record) == "Done":
            await self.store.delete(migration.KIND, migration.NAME)
            record = None
        if record is None:
            spec: dict[str, Any] = {"to": str(target), "serviceCIDRName": plan.cidr_name}
            if grace is not None:
                spec["aliasGracePeriodSeconds"] = grace
            self.record = await self.store.create({
                "apiVersion": migration.API_VERSION, "kind": migration.KIND,
                "metadata": {"name": migration.NAME}, "spec": spec,
                "status": {"phase": "Moving", "startedAt": model.rfc3339(_now()),
                           "serviceCIDR": plan.cidr_name,
                           "sources": sorted(n for n, _, _ in plan.sources), "services": {}},
            })  # fmt: skip
        else:
            self.record = record
            self.say(f"resuming the migration to {target} ({migration.phase(record)})")
        await self._start(target, plan.cidr_name)
        await self._finish_half_done()
        for move in plan.moves:
            done = ((self.record.get("status") or {}).get("services") or {}).get(move.service)
            if done and done.get("state") == "moved":
                continue
            await self._move(move)
        half: dict[str, Any] = ((self.record.get("status") or {}).get("services") or {}).get(
            "default/kubernetes") or {}  # fmt: skip
        if api is not None or half.get("state") == "recreating":
            if not apiserver_updated:
                await self._save(phase="AwaitingAPIServer")
                old = model.service_ips(api) if api is not None else [Addr(str(half["old"]))]
                self.say(f"every Service but default/kubernetes moved. Next: set "
                         f"--service-cluster-ip-range={target} on every kube-apiserver (and "
                         "kube-controller-manager), with the new address "
                         f"{target[1]} in the API server certificate; then run this command "
                         f"again with --apiserver-updated. Meanwhile {old[0] if old else '?'} "
                         "keeps serving the API")  # fmt: skip
                return
            await self._move_api(target, api)
        await self._save(phase="Aliased")
        await self._release_aliases()
        await self._release_cidrs()
        await self._save(phase="Done", finishedAt=model.rfc3339(_now()))
        self.say(
            f"done: every Service is in {target}; the old ServiceCIDRs "
            f"{', '.join((self.record.get('status') or {}).get('sources') or [])} are gone"
        )

    async def _start(self, target: Net, cidr_name: str) -> None:
        existing = await self._get(model.CIDR_KIND, cidr_name)
        if existing is None:
            await self.store.create({"apiVersion": model.CIDR_API_VERSION, "kind": model.CIDR_KIND,
                                     "metadata": {"name": cidr_name},
                                     "spec": {"cidrs": [str(target)]}})  # fmt: skip
            self.say(f"created ServiceCIDR {cidr_name} {target}")
        for name in (self.record.get("status") or {}).get("sources") or []:
            cidr = await self._get(model.CIDR_KIND, name)
            if cidr is None or all(n.subnet_of(target) for n in model.cidr_networks(cidr)):
                continue  # gone, or kube-apiserver's default again, from the new range
            finalizers = list((cidr.get("metadata") or {}).get("finalizers") or [])
            if recreate.ALIAS_FINALIZER not in finalizers and \
                    not (cidr.get("metadata") or {}).get("deletionTimestamp"):  # fmt: skip
                cidr["metadata"]["finalizers"] = [*finalizers, recreate.ALIAS_FINALIZER]
                cidr = await self.store.update(cidr)
            if not (cidr.get("metadata") or {}).get("deletionTimestamp"):
                await self.store.delete(model.CIDR_KIND, name)
                self.say(f"deleted ServiceCIDR {name}: terminating (nothing new is allocated "
                         "from it) until no ClusterIP or alias is in it")  # fmt: skip

    async def _finish_half_done(self) -> None:
        """Entries left ``recreating`` by an interrupted run: finish them."""
        entries = (self.record.get("status") or {}).get("services") or {}
        for name, entry in sorted(entries.items()):
            if entry.get("state") != "recreating":
                continue
            self.say(f"finishing {name}, interrupted while it was re-created")
            if tuple(name.split("/", 1)) == recreate.KUBERNETES_SERVICE:
                continue  # _move_api runs again from the top
            await self._recreate(name, Addr(entry["old"]), Addr(entry["new"]))

    async def _move(self, move: migration.Move) -> None:
        await self._entry(move.service, old=str(move.old), new=str(move.new), state="recreating",
                          released=False)  # fmt: skip
        started = time.monotonic()
        await self._recreate(move.service, move.old, move.new)
        await self._entry(move.service, state="moved", movedAt=model.rfc3339(_now()))
        self.say(f"moved {move.service}: {move.old} -> {move.new} ({move.old} stays an alias "
                 f"until unused) in {time.monotonic() - started:.1f} s")  # fmt: skip

    async def _copies(self, key: tuple[str, str], old: Addr) -> list[Resource]:
        slices = await self._slices_of(key)
        made = []
        for obj in recreate.copy_slices(slices, old):
            try:
                made.append(await self.store.create(obj))
            except AlreadyExists:
                made.append(await self.store.get(model.SLICE_KIND, obj["metadata"]["name"],
                                                 key[0]))  # fmt: skip
        made += [s for s in slices if model.migration_slice(s)
                 and s["metadata"]["name"] not in {m["metadata"]["name"] for m in made}]  # fmt: skip
        return made

    async def _drop_copies(self, key: tuple[str, str], copies: list[Resource]) -> None:
        for obj in copies:
            with contextlib.suppress(NotFound):
                await self.store.delete(model.SLICE_KIND, obj["metadata"]["name"], key[0])

    async def _recreate(self, name: str, old: Addr, new: Addr) -> None:
        """Move Service ``name`` (``ns/name``) from ``old`` to ``new`` under the hold
        (:mod:`cilia_operator.service.recreate`); idempotent from any point."""
        ns, _, svc_name = name.partition("/")
        key = (ns, svc_name)
        current = await self._get(model.SERVICE_KIND, svc_name, ns)
        copies = await self._copies(key, old)
        while current is not None and model.service_ips(current)[:1] == [old]:
            # what to create is written down before the delete: an interruption in between
            # is finished from the record
            await self._entry(name, manifest=recreate.recreated(
                current, new, {old: model.rfc3339(_now())}))  # fmt: skip
            await self.sleep(self.settle)  # the operator sees the copies first
            try:
                current = await self.store.update(_marked(current, new))
                await self.store.delete(model.SERVICE_KIND, svc_name, ns,
                                        current["metadata"]["resourceVersion"])  # fmt: skip
            except Conflict:
                current = await self._get(model.SERVICE_KIND, svc_name, ns)
                continue
            except NotFound:
                pass
            current = None
        if current is None:
            entry = ((self.record.get("status") or {}).get("services") or {}).get(name) or {}
            if not entry.get("manifest"):
                raise CommandError(f"Service {name} is gone (deleted by someone else during "
                                   "the move): nothing to re-create")  # fmt: skip
            try:
                current = await self.store.create(entry["manifest"])
            except AlreadyExists:
                current = await self.store.get(model.SERVICE_KIND, svc_name, ns)
        await self._entry(name, manifest=None)
        want = recreate.ready_endpoints(copies)
        deadline = time.monotonic() + self.endpoints_timeout
        while True:
            own = [s for s in await self._slices_of(key) if not model.migration_slice(s)]
            if want <= recreate.ready_endpoints(own):
                break
            if time.monotonic() > deadline:
                missing = sorted(want - recreate.ready_endpoints(own))
                self.say(f"warning: {name}: its own EndpointSlices do not list {missing} after "
                         f"{self.endpoints_timeout:g} s (--endpoints-timeout); the copies stay "
                         "and keep serving them")  # fmt: skip
                return
            await self.sleep(self.poll / 4)
        await self.sleep(self.settle)  # the agents have the new slices
        await self._drop_copies(key, copies)

    async def _move_api(self, target: Net, api: Resource | None) -> None:
        """Re-create ``default/kubernetes`` through the API server (module docstring)."""
        name = "default/kubernetes"
        key = recreate.KUBERNETES_SERVICE
        started = time.monotonic()
        if api is not None:
            old = model.service_ips(api)[0]
            await self._entry(name, old=str(old), new=str(target[1]), state="recreating",
                              released=False)  # fmt: skip
            copies = await self._copies(key, old)
            await self.sleep(self.settle)
            current: Resource | None = api
            for _ in range(10):  # kube-apiserver may rewrite it in between: read it again
                if current is None:
                    break
                try:
                    current = await self.store.update(_marked(current, target[1]))
                    await self.store.delete(model.SERVICE_KIND, "kubernetes", "default",
                                            current["metadata"]["resourceVersion"])  # fmt: skip
                    break
                except NotFound:
                    break
                except Conflict:
                    current = await self._get(model.SERVICE_KIND, "kubernetes", "default")
        else:  # deleted by an earlier run, not re-created then
            old = Addr(((self.record.get("status") or {}).get("services") or {})[name]["old"])
            copies = [s for s in await self._slices_of(key) if model.migration_slice(s)]
        deadline = time.monotonic() + self.apiserver_timeout
        while True:
            current = await self._get(model.SERVICE_KIND, "kubernetes", "default")
            if current is not None and model.service_ips(current):
                break
            if time.monotonic() > deadline:
                raise CommandError(f"kube-apiserver did not re-create default/kubernetes in "
                                   f"{self.apiserver_timeout:g} s (an API server still on the "
                                   "old --service-cluster-ip-range cannot: that ServiceCIDR is "
                                   f"terminating); Cilia keeps serving {old} from the "
                                   "EndpointSlice copies: update every API server, then run "
                                   "this command again with --apiserver-updated")  # fmt: skip
            await self.sleep(self.poll / 4)
        new = model.service_ips(current)[0]
        if new not in target:
            await self.sleep(self.settle)
            await self._drop_copies(key, copies)
            await self._entry(name, state="moved-back", new=str(new))
            raise CommandError(f"kube-apiserver re-created default/kubernetes at {new}, not in "
                               f"{target}: an API server still runs with the old "
                               "--service-cluster-ip-range. Update every API server, then run "
                               "this command again with --apiserver-updated")  # fmt: skip
        for _ in range(10):
            fresh = await self.store.get(model.SERVICE_KIND, "kubernetes", "default")
            try:
                await self.store.update(model.with_aliases(
                    fresh, {**model.alias_ips(fresh), old: model.rfc3339(_now())}))  # fmt: skip
                break
            except Conflict:
                continue
        want = recreate.ready_endpoints(copies)
        deadline = time.monotonic() + self.endpoints_timeout
        while time.monotonic() < deadline:
            own = [s for s in await self._slices_of(key) if not model.migration_slice(s)]
            if want <= recreate.ready_endpoints(own):
                break
            await self.sleep(self.poll / 4)
        await self.sleep(self.settle)
        await self._drop_copies(key, copies)
        await self._entry(name, state="moved", new=str(new), movedAt=model.rfc3339(_now()))
        self.say(f"moved {name}: {old} -> {new} (re-created by kube-apiserver; {old} stays an "
                 f"alias until unused) in {time.monotonic() - started:.1f} s")  # fmt: skip

    async def _release_aliases(self) -> None:
        grace = migration.grace_of(self.record, aliases.DEFAULT_GRACE_SECONDS)
        deadline = time.monotonic() + self.wait_timeout
        last_said = 0.0
        while True:
            entries = dict((self.record.get("status") or {}).get("services") or {})
            olds = {Addr(e["old"]): n for n, e in entries.items()
                    if e.get("state") == "moved" and not e.get("released")}  # fmt: skip
            if not olds:
                return
            services = await self._list(model.SERVICE_KIND)
            uses = await self._list(aliases.USE_KIND)
            now = _now()
            verdicts = [v for v in aliases.judge(services, uses, now, grace) if v.ip in olds]
            held = {v.ip for v in verdicts}
            for ip, n in olds.items():
                if ip not in held:  # its Service was deleted or its alias removed by hand
                    entries[n] = {**entries[n], "released": True, "releasedAt": model.rfc3339(now)}
            for v in verdicts:
                n = olds[v.ip]
                if v.last_used is not None:
                    entries[n] = {**entries[n], "lastUsed": model.rfc3339(v.last_used)}
                if not v.release:
                    continue
                ns, _, svc_name = v.service.partition("/")
                for _ in range(10):
                    fresh = await self.store.get(model.SERVICE_KIND, svc_name, ns)
                    keep = {ip: t for ip, t in model.alias_ips(fresh).items() if ip != v.ip}
                    try:
                        await self.store.update(model.with_aliases(fresh, keep))
                        break
                    except Conflict:
                        continue
                entries[n] = {**entries[n], "released": True, "releasedAt": model.rfc3339(now)}
                used = model.rfc3339(v.last_used) if v.last_used else "never"
                self.say(f"released alias {v.ip} of {v.service} (last used: {used})")
            await self._save(services=entries)
            pending = [v for v in verdicts if not v.release]
            if not pending:
                continue
            if time.monotonic() > deadline:
                raise CommandError(f"{len(pending)} alias(es) still in use after "
                                   f"{self.wait_timeout:g} s (--wait-timeout); run the same "
                                   "command again to go on waiting (servicecidr status "
                                   "--kubernetes shows their last use)")  # fmt: skip
            if time.monotonic() - last_said > 10:
                last_said = time.monotonic()
                soonest = min(grace - v.idle_seconds for v in pending)
                self.say(f"waiting: {len(pending)} alias(es) within their grace period "
                         f"({grace:g} s); the next may go in {max(0.0, soonest):.0f} s")  # fmt: skip
            await self.sleep(self.poll)

    async def _release_cidrs(self) -> None:
        names = list((self.record.get("status") or {}).get("sources") or [])
        for name in names:
            for _ in range(10):
                cidr = await self._get(model.CIDR_KIND, name)
                if cidr is None:
                    break
                finalizers = list(cidr["metadata"].get("finalizers") or [])
                if recreate.ALIAS_FINALIZER not in finalizers:
                    break
                cidr["metadata"]["finalizers"] = [f for f in finalizers
                                                  if f != recreate.ALIAS_FINALIZER]  # fmt: skip
                try:
                    await self.store.update(cidr)
                    break
                except Conflict:
                    continue
        target = Net(str((self.record.get("spec") or {}).get("to")))

        async def still_there(name: str) -> bool:
            # kube-apiserver re-creates its default ServiceCIDR ("kubernetes") from its new
            # --service-cluster-ip-range once the old one is gone: that one is not the old
            cidr = await self._get(model.CIDR_KIND, name)
            return cidr is not None and not all(
                n.subnet_of(target) for n in model.cidr_networks(cidr))  # fmt: skip

        deadline = time.monotonic() + max(60.0, self.endpoints_timeout)
        while True:
            left = [n for n in names if await still_there(n)]
            if not left:
                return
            if time.monotonic() > deadline:
                services = await self._list(model.SERVICE_KIND)
                raise CommandError(f"ServiceCIDR(s) {', '.join(left)} still terminating: "
                                   "Kubernetes keeps them while a ClusterIP is in them; "
                                   f"Services outside the new range: "
                                   f"{_outside(services, self.record)}")  # fmt: skip
            await self.sleep(self.poll)


def _marked(service: Resource, new: Addr) -> Resource:
    """``service`` annotated :data:`model.MIGRATING_TO_ANNOTATION` ``new`` (the operator holds
    its deletion on that, see :mod:`cilia_operator.controlplane.service`)."""
    out = dict(service)
    meta = dict(out.get("metadata") or {})
    meta["annotations"] = {**(meta.get("annotations") or {}),
                           model.MIGRATING_TO_ANNOTATION: str(new)}  # fmt: skip
    out["metadata"] = meta
    return out


def _outside(services: list[Resource], record: Mapping[str, Any]) -> str:
    target = Net(str((record.get("spec") or {}).get("to")))
    names = [f"{k[0]}/{k[1]}" for s in services for k in [model.key_of(s)]
             if model.service_ips(s) and model.service_ips(s)[0] not in target]  # fmt: skip
    return ", ".join(names) or "none"
