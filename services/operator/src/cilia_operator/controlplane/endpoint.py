"""EndpointService: CiliumEndpoint records in, the cluster ipcache streamed out."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_common.tls import peer_identity

from ..endpoint import records
from ..endpoint.ipcache import Entry, IPCache, host_ip, node_addresses
from ..kinds import ENDPOINT_SLICE, NODE
from ..store import AlreadyExists, Conflict, Contention, NotFound, Store, resource_version
from . import authz
from .errors import streaming, unary
from .pod import POD_KIND
from .streams import WATCH_MESSAGE_MAX_BYTES, Changed, Listed, Sent, watch_stream

log = logging.getLogger(__name__)

UPSERT_METHOD = "/cilia.controlplane.v1.EndpointService/UpsertEndpoint"


def entry_message(entry: Entry) -> pb.IPCacheEntry:
    """An ipcache entry as ``IPCacheEntry``."""
    return pb.IPCacheEntry(
        cidr=entry.cidr,
        identity=entry.identity,
        node_name=entry.node_name,
        host_ip=entry.host_ip,
        owner=entry.owner,
    )


class EndpointServicer:
    """``cilia.controlplane.v1.EndpointService``.

    Args:
        store: the Store; conflict_retries: write attempts per request;
        chunk_size / queue_size: ``--watch-list-chunk-size`` / ``--watch-buffer-size``;
        max_bytes: ``--watch-max-message-bytes`` (bytes of one stream message at most).
    """

    def __init__(
        self,
        store: Store,
        *,
        conflict_retries: int,
        chunk_size: int,
        queue_size: int,
        max_bytes: int = WATCH_MESSAGE_MAX_BYTES,
        pods_from_api: bool = False,
    ) -> None:
        self.store = store
        self.pods_from_api = pods_from_api
        self.conflict_retries = max(1, conflict_retries)
        self.chunk_size = chunk_size
        self.queue_size = queue_size
        self.max_bytes = max_bytes

    async def _node_ip(self, node_name: str) -> str:
        try:
            return host_ip(node_addresses(await self.store.get(NODE.kind, node_name)))
        except NotFound:
            return ""

    @unary
    async def UpsertEndpoint(  # noqa: N802 (gRPC method name)
        self, request: pb.UpsertEndpointRequest, context: Any
    ) -> pb.UpsertEndpointResponse:
        """Create or update the endpoint's CiliumEndpoint (namespace "" = ``default``).

        With mutual TLS, an agent may not take over a record another node owns (the pod
        name was reused there): PERMISSION_DENIED naming the owner, nothing written
        (``authz.foreign_record_refusal``). An administrator may, and so may any node once
        the owner's CiliumNode is gone (the node left; its records are stale, as
        upstream's operator would garbage-collect them). With the Kubernetes store
        (``pods_from_api``) the API server decides first: a node may take over the record
        of a Pod whose ``spec.nodeName`` is that node (a StatefulSet pod rescheduled from
        a node that is down but still registered), and only then.

        Errors: INVALID_ARGUMENT (bad name/namespace/node/IP, identity 0),
        PERMISSION_DENIED (another node's record), ABORTED (record changing too fast),
        UNAVAILABLE.
        """
        ep = request.endpoint
        desired = records.endpoint_record(
            namespace=ep.namespace,
            name=ep.name,
            node_name=ep.node_name,
            node_ip=await self._node_ip(ep.node_name) if ep.node_name else "",
            ipv4=ep.ipv4,
            identity=ep.identity,
            labels=list(ep.labels),
            endpoint_id=ep.endpoint_id,
            container_id=ep.container_id,
        )
        namespace, name = desired["metadata"]["namespace"], desired["metadata"]["name"]
        # A pod's first upsert finds no record: create it at once (one store round trip,
        # not a get that misses and then a create). A record that exists -- a restored or
        # relabelled endpoint, a reused name -- makes the create fail with AlreadyExists
        # and nothing written; the loop below then reads it and applies every rule.
        if await self._create(desired, ep):
            return pb.UpsertEndpointResponse()
        for _ in range(self.conflict_retries):
            try:
                current = await self.store.get(records.KIND, name, namespace)
            except NotFound:
                if await self._create(desired, ep):
                    return pb.UpsertEndpointResponse()
                continue
            await self._check_owner(context, current, ep.node_name)
            if current.get("status") == desired["status"]:
                return pb.UpsertEndpointResponse()
            updated = dict(current, status=desired["status"])  # the store copies what it writes
            try:
                await self.store.update(updated)
            except (Conflict, NotFound):
                continue
            return pb.UpsertEndpointResponse()
        raise Contention(records.KIND, namespace, name)

    async def _create(self, desired: dict[str, Any], ep: pb.EndpointRecord) -> bool:
        """Create the record ``desired``; False when one exists already (nothing written)."""
        try:
            await self.store.create(desired)
        except AlreadyExists:
            return False
        meta = desired["metadata"]
        log.info("endpoint recorded", extra={"endpoint": f"{meta['namespace']}/{meta['name']}",
                 "node": ep.node_name, "ipv4": ep.ipv4, "identity": ep.identity})  # fmt: skip
        return True

    async def _check_owner(self, context: Any, current: Any, node: str) -> None:
        """Abort with PERMISSION_DENIED when the caller's certificate may not overwrite
        ``current`` as node ``node`` and its owner is still a registered node."""
        owner = records.node_name_of(current)
        who = peer_identity(context)
        why = authz.foreign_record_refusal(who, owner, node)
        if not why:
            return
        if self.pods_from_api and await self._pod_runs_on(current, node):
            log.info("endpoint taken over: the API server places its pod on this node", extra={
                "endpoint": current["metadata"]["name"], "from": owner, "node": node})  # fmt: skip
            return
        try:
            await self.store.get(NODE.kind, owner)
        except NotFound:
            log.warning("endpoint taken over from a departed node", extra={
                "endpoint": current["metadata"]["name"], "from": owner, "node": node})  # fmt: skip
            return
        namespace, name = current["metadata"].get("namespace", ""), current["metadata"]["name"]
        await authz.deny(
            context,
            UPSERT_METHOD,
            f"endpoint {namespace}/{name}: {why}; not written",
            {"identity": who.describe() if who else "", "node": node, "owner": owner},
        )

    async def _pod_runs_on(self, current: Any, node: str) -> bool:
        """Whether the API server's Pod of the record ``current`` has ``spec.nodeName`` ==
        ``node`` (False when the Pod is absent or not yet scheduled)."""
        meta = current["metadata"]
        try:
            pod = await self.store.get(POD_KIND, meta["name"], meta.get("namespace") or "default")
        except NotFound:
            return False
        spec = pod.get("spec")
        return bool(node) and isinstance(spec, dict) and spec.get("nodeName") == node

    @unary
    async def DeleteEndpoint(  # noqa: N802 (gRPC method name)
        self, request: pb.DeleteEndpointRequest, context: Any
    ) -> pb.DeleteEndpointResponse:
        """Delete the endpoint's record; succeeds when it is absent.

        With ``node_name`` set, a record owned by another node (the pod name was reused
        there) is left alone: FAILED_PRECONDITION naming that node. With ``container_id``
        set, a record of another container (a newer sandbox of the same pod) is left
        alone the same way, so a stale DEL never removes the newer sandbox's record.
        Errors: INVALID_ARGUMENT, FAILED_PRECONDITION, ABORTED, UNAVAILABLE.
        """
        namespace = records.check_namespace(request.namespace or records.DEFAULT_NAMESPACE)
        name = records.check_name(request.name)
        for _ in range(self.conflict_retries):
            try:
                current = await self.store.get(records.KIND, name, namespace)
            except NotFound:
                return pb.DeleteEndpointResponse()
            owner = records.node_name_of(current)
            if request.node_name and owner and owner != request.node_name:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"endpoint {namespace}/{name} belongs to node {owner!r}, "
                    f"not {request.node_name!r}; not deleted",
                )
            recorded = records.container_id_of(current)
            if request.container_id and recorded and recorded != request.container_id:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"endpoint {namespace}/{name} belongs to container {recorded!r}, "
                    f"not {request.container_id!r}; not deleted",
                )
            try:
                await self.store.delete(records.KIND, name, namespace, resource_version(current))
            except NotFound:
                return pb.DeleteEndpointResponse()
            except Conflict:
                continue
            log.info("endpoint deleted", extra={"endpoint": f"{namespace}/{name}"})
            return pb.DeleteEndpointResponse()
        raise Contention(records.KIND, namespace, name)

    @streaming
    async def WatchIPCache(  # noqa: N802 (gRPC method name)
        self, request: pb.WatchIPCacheRequest, context: Any
    ) -> AsyncIterator[pb.WatchIPCacheResponse]:
        """Every ipcache entry (endpoints' IP/32, nodes' addresses as identity 6, the API
        server's addresses from ``default/kubernetes``'s EndpointSlices as identity 7),
        ``synced`` on the last message of the listing, then changes. A watch that falls
        behind relists and sends the difference, ending with ``synced`` again.

        Errors: UNAVAILABLE.
        """
        cache = IPCache()
        sent: Sent[str, pb.IPCacheEntry] = Sent()

        def apply(item: Listed | Changed) -> list[pb.IPCacheEvent]:
            if isinstance(item, Listed):
                if item.kind == NODE.kind:
                    dirty = cache.replace_nodes(item.items)
                elif item.kind == ENDPOINT_SLICE.kind:
                    dirty = cache.replace_slices(item.items)
                else:
                    dirty = cache.replace_endpoints(item.items)
            else:
                obj = item.event.object
                if item.kind == NODE.kind:
                    name = obj["metadata"]["name"]
                    deleted = item.event.type == "DELETED"
                    dirty = cache.delete_node(name) if deleted else cache.set_node(obj)
                elif item.kind == ENDPOINT_SLICE.kind:
                    deleted = item.event.type == "DELETED"
                    key = records.owner_of(obj)
                    dirty = cache.delete_slice(key) if deleted else cache.set_slice(obj)
                elif item.event.type == "DELETED":
                    dirty = cache.delete_endpoint(records.owner_of(obj))
                else:
                    dirty = cache.set_endpoint(obj)
            events = []
            for cidr in sorted(dirty):
                previous = sent.sent.get(cidr)
                entry = cache.entry(cidr)
                for _, message in sent.set(cidr, None if entry is None else entry_message(entry)):
                    if message is None:
                        events.append(pb.IPCacheEvent(type=pb.EVENT_TYPE_DELETE, entry=previous))
                    else:
                        events.append(pb.IPCacheEvent(type=pb.EVENT_TYPE_UPSERT, entry=message))
            return events

        def respond(events: Sequence[pb.IPCacheEvent], synced: bool) -> pb.WatchIPCacheResponse:
            return pb.WatchIPCacheResponse(events=events, synced=synced)

        async for response in watch_stream(
            self.store,
            [NODE.kind, records.KIND, ENDPOINT_SLICE.kind],
            apply,
            respond,
            key=lambda e: e.entry.cidr,
            chunk_size=self.chunk_size,
            queue_size=self.queue_size,
            max_bytes=self.max_bytes,
        ):
            yield response
