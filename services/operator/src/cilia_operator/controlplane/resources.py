"""ResourceService: apply/get/list/delete manifests (``cilia-operator apply|get``)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import ipaddress
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb

from ..errors import FieldError, InvalidResource
from ..identity.allocator import IdentityAllocator
from ..ipam import claims
from ..ipam import node as nodes
from ..ipam.changes import NodeNetworks, PoolChange, plan_pool_change
from ..ipam.pool import (
    DEFAULT_POOL,
    DRAINING_FIELD,
    PoolSpec,
    pool_specs,
    to_pool_spec,
    validate_pool,
)
from ..kinds import (
    ENDPOINT_SLICE,
    IDENTITY,
    NODE,
    POOL,
    SERVICE_CIDR,
    KindInfo,
    UnknownKind,
    kind_of,
    resolve_kind,
)
from ..kinds import SERVICE as SERVICE_INFO
from ..manifests import (
    Document,
    DocumentError,
    InvalidManifest,
    ManifestLimits,
    ManifestTooLarge,
    parse_manifest,
    validate_documents,
)
from ..service import allocation
from ..service import model as svc
from ..store import (
    Conflict,
    Contention,
    ListResult,
    NotFound,
    Resource,
    Snapshot,
    Store,
    Write,
    resource_version,
)
from . import deletion
from .applyfence import ApplyAbandoned, ApplyFences, Fence, Outcome
from .deletion import pool_in_use_message
from .errors import unary

log = logging.getLogger(__name__)


def _resource(obj: Resource) -> pb.Resource:
    return pb.Resource(json=json.dumps(obj, sort_keys=True), resource_version=resource_version(obj))


def _merged(current: Resource, doc: Document) -> Resource:
    """``current`` with the document's content; metadata labels/annotations replaced
    when the document gives them, everything else in metadata kept."""
    out = copy.deepcopy(current)
    for key, value in doc.obj.items():
        if key != "metadata":
            out[key] = copy.deepcopy(value)
    for key in [k for k in out if k not in doc.obj and k not in ("metadata", "status")]:
        del out[key]
    for key in ("labels", "annotations"):
        if key in doc.obj["metadata"]:
            out["metadata"][key] = copy.deepcopy(doc.obj["metadata"][key])
    return out


def _namespace(info: KindInfo, requested: str) -> str:
    """The store namespace of a request: "" for cluster-scoped kinds, else the requested
    one or ``default``."""
    return (requested or "default") if info.namespaced else ""


SERVICE = "cilia.controlplane.v1.ResourceService"

_REQUEST_OVERHEAD = 16
"""Bytes an ApplyRequest adds around its manifest (field tags, a length varint of at most
5 bytes, ``dry_run``): a request longer than the manifest limit plus this cannot hold an
acceptable manifest."""


@dataclass(frozen=True)
class OversizedApply:
    """What :meth:`ResourceServicer.deserialize_apply` gives for a request too large to
    hold an acceptable manifest: never decoded, only measured."""

    size: int


def add_to_server(servicer: ResourceServicer, server: Any) -> None:
    """Register ``servicer`` as ``cilia.controlplane.v1.ResourceService`` on ``server``,
    as the generated ``add_ResourceServiceServicer_to_server`` does, except that Apply's
    request goes through :meth:`ResourceServicer.deserialize_apply` (an oversized request
    is refused by its length, without decoding 100 MB on the event loop)."""
    handlers = {
        "Apply": grpc.unary_unary_rpc_method_handler(
            servicer.Apply,
            request_deserializer=servicer.deserialize_apply,
            response_serializer=pb.ApplyResponse.SerializeToString,
        ),
        "Get": grpc.unary_unary_rpc_method_handler(
            servicer.Get,
            request_deserializer=pb.GetRequest.FromString,
            response_serializer=pb.GetResponse.SerializeToString,
        ),
        "List": grpc.unary_unary_rpc_method_handler(
            servicer.List,
            request_deserializer=pb.ListRequest.FromString,
            response_serializer=pb.ListResponse.SerializeToString,
        ),
        "ApplyOutcome": grpc.unary_unary_rpc_method_handler(
            servicer.ApplyOutcome,
            request_deserializer=pb.ApplyOutcomeRequest.FromString,
            response_serializer=pb.ApplyOutcomeResponse.SerializeToString,
        ),
        "Delete": grpc.unary_unary_rpc_method_handler(
            servicer.Delete,
            request_deserializer=pb.DeleteRequest.FromString,
            response_serializer=pb.DeleteResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a shielded apply's exception when its RPC was cancelled meanwhile (it is
    recorded on the fence; this keeps asyncio from logging it as never retrieved)."""
    if not task.cancelled():
        task.exception()


def _find(listed: ListResult, namespace: str, name: str) -> Resource | None:
    for obj in listed.items:
        meta = obj.get("metadata") or {}
        if meta.get("name") == name and (meta.get("namespace") or "") == namespace:
            return obj
    return None


def _kinds(raw: Sequence[Any]) -> list[str]:
    """The store kinds the parsed documents name (unknown ones are left to validation)."""
    out = []
    for doc in raw:
        if isinstance(doc, dict):
            try:
                out.append(
                    kind_of(str(doc.get("apiVersion") or ""), str(doc.get("kind") or "")).kind
                )
            except UnknownKind:
                continue
    return out


def _selectorless(raw: Sequence[Any]) -> bool:
    """Whether a parsed document is a Service without ``spec.selector``."""
    for doc in raw:
        if isinstance(doc, dict) and doc.get("kind") == SERVICE_INFO.kind:
            spec = doc.get("spec")
            if not isinstance(spec, dict) or not spec.get("selector"):
                return True
    return False


def _plan_one(
    doc: Document, current: Resource | None, change: PoolChange | None
) -> tuple[str, Write | None]:
    """The action for one document (``created|configured|unchanged``) and its write
    (None when unchanged); an update carries ``current``'s resourceVersion."""
    if current is None:
        return "created", Write("create", doc.obj)
    desired = _merged(current, doc)
    if change is not None:
        status = desired.setdefault("status", {})
        status[DRAINING_FIELD] = [str(c) for c in change.draining]
        if not change.draining:
            del status[DRAINING_FIELD]
        if not status:
            del desired["status"]
    if desired == current:
        return "unchanged", None
    return "configured", Write("update", desired)


class ResourceServicer:
    """``cilia.controlplane.v1.ResourceService``.

    Args:
        store: the Store.
        identities: deletes CiliumIdentity records and frees the number in its cache
            (None: identities are deleted like any record).
        service_cidrs: ``--service-cluster-ip-range`` (no pool may overlap them).
        limits: bounds on an ``apply`` manifest (:class:`ManifestLimits`).
        attempts: times an apply transaction is tried when pools, nodes or the applied
            kinds change under it (``--store-conflict-retries``); then ABORTED.
        default_pool: ``--ipam-default-ip-pool``: the one pool whose blocks must leave a
            pod address after the agent's router IP (others may use ``maskSize: 32``).
        parse_concurrency: manifests parsed at once (``--apply-max-concurrent-parses``);
            the others wait their turn without using CPU, so hostile manifests take at
            most that many threads from the event loop serving every other call.
        fences: the outcomes of applies by request id (``ApplyOutcome``).
        services: Service settings (ServiceCIDR default range, NodePort range, whether
            the operator allocates; default: standalone with ``service_cidrs``).
    """

    def __init__(
        self,
        store: Store,
        identities: IdentityAllocator | None = None,
        service_cidrs: Sequence[ipaddress.IPv4Network] = (),
        limits: ManifestLimits | None = None,
        attempts: int = 5,
        default_pool: str = DEFAULT_POOL,
        parse_concurrency: int = 1,
        fences: ApplyFences | None = None,
        services: allocation.ServiceSettings | None = None,
    ) -> None:
        if parse_concurrency < 1:
            raise ValueError(f"parse_concurrency must be >= 1, got {parse_concurrency}")
        self._parsing = asyncio.Semaphore(parse_concurrency)
        self.default_pool = default_pool
        self.store = store
        self.identities = identities
        self.service_cidrs = tuple(service_cidrs)
        self.limits = limits or ManifestLimits()
        self.attempts = attempts
        self.fences = fences or ApplyFences()
        self.services = services or allocation.ServiceSettings(service_cidrs=self.service_cidrs)

    def _pool_changes(
        self,
        docs: Sequence[Document],
        stored: Mapping[str, PoolSpec],
        records: list[Resource],
        service_cidrs: Sequence[Resource] = (),
    ) -> tuple[dict[str, PoolChange], list[str]]:
        """Check every pool document against nodes and services; effects per node.

        Raises:
            InvalidManifest: an overlap with a node network, a service CIDR or a draining
                CIDR (every problem listed; nothing written).
        """
        pool_docs = [d for d in docs if d.info is POOL]
        if not pool_docs:
            return {}, []
        holdings = {
            nodes.node_name(r): [
                *((p, b) for p, bs in nodes.allocated(r).items() for b in bs),
                *(("", b) for b in nodes.pod_cidrs(r)),
            ]
            for r in records
        }
        networks = [
            NodeNetworks(
                nodes.node_name(r),
                tuple(nodes.local_networks(r)),
                tuple(b for _, b in holdings[nodes.node_name(r)]),
            )
            for r in records
        ]
        named = allocation.named_service_cidrs(service_cidrs, self.service_cidrs)
        changes: dict[str, PoolChange] = {}
        effects: list[str] = []
        errors: list[DocumentError] = []
        for doc in pool_docs:
            label = f"{doc.info.kind} {doc.name}"
            try:
                spec = to_pool_spec(validate_pool(doc.obj, default_pool=self.default_pool))
            except InvalidResource as exc:  # the router-IP rule of a renamed default pool
                errors += [DocumentError(doc.index, label, e) for e in exc.errors]
                continue
            change = plan_pool_change(
                spec,
                stored.get(doc.name),
                holdings,
                service_cidrs=self.service_cidrs,
                node_networks=networks,
                named_service_cidrs=named,
            )
            errors += [DocumentError(doc.index, label, e) for e in change.errors]
            changes[doc.name] = change
            effects += change.effects
        if errors:
            raise InvalidManifest(errors)
        return changes, effects

    def _prepare_services(
        self, docs: Sequence[Document], snapshot: Snapshot, stored: Mapping[str, PoolSpec]
    ) -> None:
        """The Service registry step (:func:`cilia_operator.service.allocation.prepare`):
        defaults, ClusterIP and NodePort allocation into the Service documents, ServiceCIDR
        checks.

        Raises:
            InvalidManifest: every problem (nothing written).
        """
        wanted = (SERVICE_INFO, SERVICE_CIDR, ENDPOINT_SLICE)
        for doc in docs:
            if doc.info is SERVICE_INFO and "spec" in doc.obj:
                # the parsed manifest is shared by every attempt of the transaction: the
                # allocations of one attempt must not show up as "given" in the next
                doc.obj["spec"] = copy.deepcopy(doc.obj["spec"])
        service_docs = [
            allocation.ServiceDoc(d.index, d.info.kind, d.namespace, d.name, d.obj)
            for d in docs
            if d.info in wanted
        ]
        if not any(d.kind in (SERVICE_INFO.kind, SERVICE_CIDR.kind) for d in service_docs):
            return
        specs = {**stored}
        for doc in docs:
            if doc.info is POOL:
                with contextlib.suppress(InvalidResource):
                    specs[doc.name] = to_pool_spec(validate_pool(doc.obj))
        pools = [allocation.PoolRanges(n, (*p.cidrs, *p.draining)) for n, p in specs.items()]
        problems = allocation.prepare(service_docs, snapshot, self.services, pools)
        if problems:
            labels = {d.index: f"{d.info.kind} {d.namespace + '/' if d.namespace else ''}{d.name}"
                      for d in docs}  # fmt: skip
            raise InvalidManifest([DocumentError(i, labels[i], e) for i, e in problems])

    def deserialize_apply(self, raw: bytes) -> pb.ApplyRequest | OversizedApply:
        """Decode an ApplyRequest, or only measure it when it is too large to hold a
        manifest within ``limits.max_bytes`` (runs on the event loop: O(1) then)."""
        if len(raw) > self.limits.max_bytes + _REQUEST_OVERHEAD:
            return OversizedApply(len(raw))
        return pb.ApplyRequest.FromString(raw)

    @unary
    async def Apply(  # noqa: N802 (gRPC method name)
        self, request: pb.ApplyRequest | OversizedApply, context: Any
    ) -> pb.ApplyResponse:
        """Validate every document, then create or update all of them in one store
        transaction (or only report: dry_run).

        Order: parse within :attr:`limits` (in a thread, so other calls are served
        meanwhile); then, in :meth:`Store.transact` on a snapshot of pools, nodes and
        the applied kinds: validate (schema, immutable fields, overlaps with pools,
        services and node networks), compute each document's action and write them all.
        With the Redis store the checks hold when the writes land -- two concurrent
        applies of overlapping pools cannot both succeed -- and an apply cut off by its
        deadline has written all of its documents or none.

        Errors: INVALID_ARGUMENT naming document index, field path and reason, or the
        limit flag exceeded (nothing written); ABORTED (the store kept changing during
        every attempt; nothing written); UNAVAILABLE.
        """
        if isinstance(request, OversizedApply):
            raise InvalidManifest([DocumentError(0, "", FieldError("", str(ManifestTooLarge(
                "apply-max-manifest-bytes", self.limits.max_bytes,
                f"manifest is about {request.size} bytes",
            ))))])  # fmt: skip
        fence = self.fences.start(request.request_id, context.time_remaining())
        # the commit runs to its end even when the RPC is cancelled (deadline, client gone),
        # so that ApplyOutcome can wait for it and tell exactly what was written
        task = asyncio.ensure_future(self._apply(request, fence))
        task.add_done_callback(_consume)
        return await asyncio.shield(task)

    async def _apply(self, request: pb.ApplyRequest, fence: Fence) -> pb.ApplyResponse:
        """The body of :meth:`Apply`; records the outcome on ``fence``."""
        try:
            response = await self._apply_unfenced(request, fence)
        except (ApplyAbandoned, Contention, InvalidManifest) as exc:
            self.fences.finish(fence, Outcome.NOT_WRITTEN, str(exc))
            raise
        except BaseException as exc:
            written = Outcome.UNKNOWN if fence.writing else Outcome.NOT_WRITTEN
            self.fences.finish(fence, written, f"{type(exc).__name__}: {exc}")
            raise
        self.fences.finish(
            fence, Outcome.NOT_WRITTEN if request.dry_run else Outcome.WRITTEN,
            "dry run" if request.dry_run else "",
        )  # fmt: skip
        return response

    async def _apply_unfenced(self, request: pb.ApplyRequest, fence: Fence) -> pb.ApplyResponse:
        async with self._parsing:
            raw = await asyncio.to_thread(parse_manifest, request.manifest, self.limits)
        outcome: dict[str, Any] = {}

        async def plan(snapshot: Snapshot) -> list[Write]:
            stored = pool_specs(snapshot[POOL.kind].items)
            async with self._parsing:
                docs = await asyncio.to_thread(validate_documents, raw, stored)
            records = snapshot[NODE.kind].items if NODE.kind in snapshot else []
            cidr_records = (
                snapshot[SERVICE_CIDR.kind].items if SERVICE_CIDR.kind in snapshot else []
            )
            # checks of every pool against every node and service: seconds for 1,000 pools,
            # so in a thread (the event loop keeps serving agents and GetStatus)
            changes, effects = await asyncio.to_thread(
                self._pool_changes, docs, stored, records, cidr_records
            )
            self._prepare_services(docs, snapshot, stored)
            writes: list[Write] = []
            applied = []
            for doc in docs:
                change = changes.get(doc.name) if doc.info is POOL else None
                current = _find(snapshot[doc.info.kind], doc.namespace, doc.name)
                action, write = _plan_one(doc, current, change)
                if write is not None:
                    writes.append(write)
                applied.append(
                    pb.AppliedResource(
                        api_version=doc.info.api_version,
                        kind=doc.info.kind,
                        name=doc.name,
                        namespace=doc.namespace,
                        action=action,
                    )
                )
            outcome.update(applied=applied, effects=effects, docs=docs)
            if request.dry_run or not writes:
                return []
            self.fences.begin_write(fence)  # no await from here to the commit
            return writes

        kinds = _kinds(raw)
        # node records change often (demand, allocations): read them only when pools
        # are applied (their networks and blocks are checked), so a policy apply is not
        # retried for every node update
        nodes_too = [NODE.kind] if POOL.kind in kinds else []
        # Services are planned on every Service and ServiceCIDR (addresses held, ranges),
        # a selector-less one also on the EndpointSlices (the controller's slice writes
        # would otherwise make every concurrent Service apply start again); pools on the
        # ServiceCIDRs
        if SERVICE_INFO.kind in kinds or SERVICE_CIDR.kind in kinds:
            kinds = [*kinds, SERVICE_INFO.kind, SERVICE_CIDR.kind]
            if _selectorless(raw):
                kinds.append(ENDPOINT_SLICE.kind)
        elif POOL.kind in kinds:
            kinds = [*kinds, SERVICE_CIDR.kind]
        await self.store.transact(
            list(dict.fromkeys([POOL.kind, *nodes_too, *kinds])), plan, attempts=self.attempts
        )
        if not request.dry_run:
            for doc, res in zip(outcome["docs"], outcome["applied"], strict=True):
                log.info(
                    "resource applied",
                    extra={"resource": doc.info.display(doc.name), "action": res.action},
                )
            for effect in outcome["effects"]:
                log.info("pool change applied", extra={"effect": effect})
        return pb.ApplyResponse(resources=outcome["applied"], effects=outcome["effects"])

    @unary
    async def ApplyOutcome(  # noqa: N802 (gRPC method name)
        self, request: pb.ApplyOutcomeRequest, context: Any
    ) -> pb.ApplyOutcomeResponse:
        """What became of the Apply sent with ``request.request_id``: an apply that has not
        begun writing (or has not arrived) is fenced and will write nothing; one writing is
        waited for (see :mod:`.applyfence`).

        Errors: INVALID_ARGUMENT (empty request_id).
        """
        outcome, detail = await self.fences.outcome(request.request_id)
        return pb.ApplyOutcomeResponse(
            outcome=pb.ApplyOutcomeResponse.Outcome.Name(outcome.value), detail=detail
        )

    async def _delete_service_cidr(self, name: str, context: Any) -> None:
        """Delete a ServiceCIDR as kube-apiserver and its servicecidrs controller do
        (standalone): in one transaction with the Services it is marked terminating
        (``metadata.deletionTimestamp``, finalizer ``networking.k8s.io/service-cidr-finalizer``,
        condition Ready=False reason Terminating) so nothing new is allocated from it; it
        is deleted at once when no Service holds an address only it covers, else by the
        leader's Service controller when the last such Service goes.

        Errors: NOT_FOUND; FAILED_PRECONDITION for the default ServiceCIDR ``kubernetes``
        (it is ``--service-cluster-ip-range``: change the flag).
        """
        if name == svc.DEFAULT_CIDR_NAME:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"servicecidr/{name} is the operator's --service-cluster-ip-range: change "
                "that flag instead",
            )
        holders: list[str] = []
        marked: list[Resource] = []

        async def plan(snapshot: Snapshot) -> list[Write]:
            items = snapshot[SERVICE_CIDR.kind].items
            current = _find(snapshot[SERVICE_CIDR.kind], "", name)
            if current is None:
                raise NotFound(SERVICE_CIDR.kind, "", name)
            holders[:] = allocation.cidr_holders(current, snapshot[SERVICE_INFO.kind].items, items)
            marked[:] = [current]
            if svc.cidr_terminating(current):
                return []
            return [Write("update", svc.terminating(current))]

        written = await self.store.transact(
            [SERVICE_CIDR.kind, SERVICE_INFO.kind], plan, attempts=self.attempts
        )
        record = written[0] if written else marked[0]
        if holders:
            log.info(
                "ServiceCIDR terminating: Services hold addresses in it",
                extra={"servicecidr": name, "services": holders[:20], "count": len(holders)},
            )
            return
        # changed or gone meanwhile: the leader's controller finishes the delete
        with contextlib.suppress(Conflict, NotFound):
            await self.store.delete(SERVICE_CIDR.kind, name, "", resource_version(record))
        log.info("resource deleted", extra={"resource": f"servicecidr/{name}"})

    @unary
    async def Get(self, request: pb.GetRequest, context: Any) -> pb.GetResponse:  # noqa: N802
        """One resource as JSON (namespaced kinds: namespace "" means ``default``).

        Errors: INVALID_ARGUMENT (unknown kind), NOT_FOUND.
        """
        info = resolve_kind(request.kind)
        obj = await self.store.get(info.kind, request.name, _namespace(info, request.namespace))
        return pb.GetResponse(resource=_resource(obj))

    @unary
    async def List(self, request: pb.ListRequest, context: Any) -> pb.ListResponse:  # noqa: N802
        """Every resource of a kind (every namespace), sorted by namespace and name.

        Errors: INVALID_ARGUMENT (unknown kind).
        """
        info = resolve_kind(request.kind)
        listed = await self.store.list(info.kind)
        return pb.ListResponse(items=[_resource(o) for o in listed.items])

    async def _delete_many(self, request: pb.DeleteRequest, context: Any) -> pb.DeleteResponse:
        """``Delete`` of a manifest's objects or of a kind's labelled objects."""
        try:
            if request.manifest:
                if request.kind or request.name or request.label_selector:
                    raise deletion.DeleteRefused(grpc.StatusCode.INVALID_ARGUMENT,
                        "manifest: give no kind, name or label_selector with it")  # fmt: skip
                raw = await asyncio.to_thread(parse_manifest, request.manifest, self.limits)
                targets = deletion.manifest_targets(raw, _namespace)
                done = await deletion.delete_all(
                    self.store, targets=targets, in_use=self._in_use, attempts=self.attempts
                )
            else:
                if request.name:
                    raise deletion.DeleteRefused(grpc.StatusCode.INVALID_ARGUMENT,
                        "label_selector: give a kind and no name with it")  # fmt: skip
                info = resolve_kind(request.kind)
                selected = (info, _namespace(info, request.namespace),
                            deletion.parse_selector(request.label_selector))  # fmt: skip
                done = await deletion.delete_all(
                    self.store, selected=selected, in_use=self._in_use, attempts=self.attempts
                )
        except deletion.DeleteRefused as exc:
            await context.abort(exc.code, str(exc))
        for target in done:
            log.info("resource deleted", extra={"resource": target.info.display(target.name),
                     "namespace": target.namespace})  # fmt: skip
        return pb.DeleteResponse(resources=[
            pb.AppliedResource(api_version=t.info.api_version, kind=t.info.kind, name=t.name,
                               namespace=t.namespace, action="deleted")
            for t in done
        ])  # fmt: skip

    @staticmethod
    def _in_use(pool: str, holders: list[str], records: list[Resource]) -> str:
        return pool_in_use_message(POOL.display(pool), pool, holders, records)

    @unary
    async def Delete(  # noqa: N802 (gRPC method name)
        self, request: pb.DeleteRequest, context: Any
    ) -> pb.DeleteResponse:
        """Delete one resource (namespaced kinds: namespace "" means ``default``).

        A CiliumIdentity delete leaves its label-set key: the labels get the same number
        back on their next Allocate while it is free.

        With ``manifest`` (every object its documents name) or ``kind`` +
        ``label_selector`` (every object of the kind whose labels match): all or nothing,
        see :mod:`.deletion`; the response lists what was deleted.

        Errors: NOT_FOUND; FAILED_PRECONDITION for a pool some node holds CIDRs of
        (the message names the nodes); INVALID_ARGUMENT (unknown kind, bad manifest or
        selector, both or neither of name and selector).
        """
        if request.manifest or request.label_selector:
            return await self._delete_many(request, context)
        info = resolve_kind(request.kind)
        namespace = _namespace(info, request.namespace)
        if info is SERVICE_CIDR and self.services.allocate:
            await self._delete_service_cidr(request.name, context)
            return pb.DeleteResponse()
        current = await self.store.get(info.kind, request.name, namespace)
        if info is POOL:
            records = (await self.store.list(NODE.kind)).items
            holders = nodes.pools_in_use(records).get(request.name, [])
            claimed = sorted({c.node for c in await claims.list_claims(self.store)
                              if c.pool == request.name})  # fmt: skip
            holders = sorted({*holders, *claimed})
            if holders:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    pool_in_use_message(info.display(request.name), request.name, holders,
                                        records),
                )  # fmt: skip
        try:
            if info is IDENTITY and self.identities is not None and request.name.isdigit():
                await self.identities.delete(int(request.name), resource_version(current))
            else:
                await self.store.delete(
                    info.kind, request.name, namespace, resource_version(current)
                )
        except Conflict:
            await context.abort(
                grpc.StatusCode.ABORTED, f"{info.display(request.name)} changed; retry"
            )
        log.info("resource deleted", extra={"resource": info.display(request.name),
                 "namespace": namespace})  # fmt: skip
        return pb.DeleteResponse()
