"""A contract-level stand-in for cilia-operator (the real one is built elsewhere).

It speaks ``cilia.controlplane.v1`` over a real TCP gRPC server in this process:
NodeService (Register, WatchNodes), IPAMService (static allocation), IdentityService
(Allocate/Release/WatchIdentities, numbers from 256), EndpointService (Upsert/Delete/
WatchIPCache), PolicyService (WatchPolicies) and ServiceService (WatchServices, no Services;
its listing held back while ``services_ready`` is clear). Tests drive it: ``apply_policy``,
``delete_policy``, ``fail_allocate``; every watch stream sends the current listing,
``synced=True``, then changes.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc

UPSERT, DELETE = cp.EVENT_TYPE_UPSERT, cp.EVENT_TYPE_DELETE


class _Hub:
    """Fan-out of one kind of event to every open watch stream."""

    def __init__(self) -> None:
        self.subscribers: list[queue.Queue[Any]] = []

    def subscribe(self) -> queue.Queue[Any]:
        q: queue.Queue[Any] = queue.Queue()
        self.subscribers.append(q)
        return q

    def publish(self, item: Any) -> None:
        for q in list(self.subscribers):
            q.put(item)


class FakeOperator(
    cp_grpc.NodeServiceServicer,  # type: ignore[misc]
    cp_grpc.IPAMServiceServicer,  # type: ignore[misc]
    cp_grpc.IdentityServiceServicer,  # type: ignore[misc]
    cp_grpc.EndpointServiceServicer,  # type: ignore[misc]
    cp_grpc.PolicyServiceServicer,  # type: ignore[misc]
    cp_grpc.ServiceServiceServicer,  # type: ignore[misc]
):
    def __init__(
        self, cidr: str, host: str = "127.0.0.1", credentials: grpc.ServerCredentials | None = None
    ) -> None:
        self.cidr = cidr
        self.lock = threading.RLock()
        self.registrations: list[cp.RegisterRequest] = []
        self.nodes: dict[str, cp.Node] = {}
        self.identities: dict[tuple[str, ...], int] = {}
        self.releases: list[int] = []
        self.endpoints: dict[tuple[str, str], cp.EndpointRecord] = {}
        self.deleted_endpoints: list[tuple[str, str]] = []
        self.policies: dict[tuple[str, str, str], str] = {}
        #: ipcache entries that are not endpoints' (nodes, the API server), by cidr
        self.extra_ipcache: dict[str, cp.IPCacheEntry] = {}
        self.fail_allocate = False
        self.hubs = {k: _Hub() for k in ("identities", "policies", "ipcache", "nodes", "services")}
        #: WatchServices holds its first (synced) message until this is set
        self.services_ready = threading.Event()
        self.services_ready.set()
        self.server = grpc.server(futures.ThreadPoolExecutor(48))
        for add in (
            cp_grpc.add_NodeServiceServicer_to_server,
            cp_grpc.add_IPAMServiceServicer_to_server,
            cp_grpc.add_IdentityServiceServicer_to_server,
            cp_grpc.add_EndpointServiceServicer_to_server,
            cp_grpc.add_PolicyServiceServicer_to_server,
            cp_grpc.add_ServiceServiceServicer_to_server,
        ):
            add(self, self.server)
        if credentials is not None:  # TLS (mutual when the credentials ask for it)
            self.port = self.server.add_secure_port(f"{host}:0", credentials)
        else:
            self.port = self.server.add_insecure_port(f"{host}:0")
        self.address = f"{host}:{self.port}"
        self.server.start()

    def stop(self) -> None:
        for hub in self.hubs.values():
            hub.publish(None)
        self.server.stop(0)

    # ------------------------------------------------------------------ driving

    def apply_policy(self, manifest: dict[str, Any]) -> None:
        meta = manifest["metadata"]
        key = (manifest["kind"], meta.get("namespace", "default"), meta["name"])
        text = json.dumps(manifest)
        with self.lock:
            self.policies[key] = text
            self.hubs["policies"].publish(
                cp.PolicyEvent(type=UPSERT, kind=key[0], namespace=key[1], name=key[2], json=text)
            )

    def delete_policy(self, kind: str, namespace: str, name: str) -> None:
        with self.lock:
            self.policies.pop((kind, namespace, name), None)
            self.hubs["policies"].publish(
                cp.PolicyEvent(type=DELETE, kind=kind, namespace=namespace, name=name)
            )

    def replace_policies(self, manifests: list[dict[str, Any]]) -> None:
        with self.lock:
            for kind, ns, name in list(self.policies):
                self.delete_policy(kind, ns, name)
            for m in manifests:
                self.apply_policy(m)

    # ------------------------------------------------------------------ streams

    def _stream(self, context: Any, hub: str, snapshot: Any, wrap: Any) -> Iterator[Any]:
        with self.lock:  # listing and subscription are atomic: no change falls between
            q = self.hubs[hub].subscribe()
            first = list(snapshot())
        try:
            yield wrap(first, True)
            while context.is_active():
                try:
                    item = q.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item is None:
                    return
                yield wrap([item], False)
        finally:
            self.hubs[hub].subscribers.remove(q)

    # NodeService
    def Register(self, request: cp.RegisterRequest, context: Any) -> cp.RegisterResponse:  # noqa: N802
        with self.lock:
            self.registrations.append(request)
            node = cp.Node(
                name=request.node_name,
                addresses=list(request.addresses),
                hubble_address=request.hubble_address,
                version=request.version,
            )
            self.nodes[request.node_name] = node
            self.hubs["nodes"].publish(cp.NodeEvent(type=UPSERT, node=node))
        return cp.RegisterResponse(default_pool="default")

    def WatchNodes(self, request: Any, context: Any) -> Iterator[cp.WatchNodesResponse]:  # noqa: N802
        def snap() -> list[Any]:
            return [cp.NodeEvent(type=UPSERT, node=n) for n in self.nodes.values()]

        yield from self._stream(
            context, "nodes", snap, lambda ev, s: cp.WatchNodesResponse(events=ev, synced=s)
        )

    # IPAMService
    def UpdateDemand(self, request: Any, context: Any) -> cp.UpdateDemandResponse:  # noqa: N802
        return cp.UpdateDemandResponse()

    def ResolvePool(  # noqa: N802
        self, request: cp.ResolvePoolRequest, context: Any
    ) -> cp.ResolvePoolResponse:
        return cp.ResolvePoolResponse(pool="default", reason="default pool (test)")

    def WatchAllocations(  # noqa: N802
        self, request: cp.WatchAllocationsRequest, context: Any
    ) -> Iterator[cp.WatchAllocationsResponse]:
        yield cp.WatchAllocationsResponse(
            allocation=cp.NodeAllocation(
                node_name=request.node_name, pools=[cp.PoolCIDRs(pool="default", cidrs=[self.cidr])]
            )
        )
        while context.is_active():
            threading.Event().wait(0.1)

    # IdentityService
    def Allocate(self, request: cp.AllocateRequest, context: Any) -> cp.AllocateResponse:  # noqa: N802
        if self.fail_allocate:
            context.abort(grpc.StatusCode.UNAVAILABLE, "store unreachable (test)")
        key = tuple(sorted(request.labels))
        with self.lock:
            created = key not in self.identities
            if created:
                self.identities[key] = 256 + len(self.identities)
            ident = cp.Identity(id=self.identities[key], labels=list(key))
            if created:
                self.hubs["identities"].publish(cp.IdentityEvent(type=UPSERT, identity=ident))
        return cp.AllocateResponse(identity=ident, created=created)

    def Release(self, request: cp.ReleaseRequest, context: Any) -> cp.ReleaseResponse:  # noqa: N802
        with self.lock:
            self.releases.append(request.id)
        return cp.ReleaseResponse()

    def WatchIdentities(  # noqa: N802
        self, request: Any, context: Any
    ) -> Iterator[cp.WatchIdentitiesResponse]:
        def snap() -> list[Any]:
            return [
                cp.IdentityEvent(type=UPSERT, identity=cp.Identity(id=i, labels=list(k)))
                for k, i in self.identities.items()
            ]

        yield from self._stream(
            context,
            "identities",
            snap,
            lambda ev, s: cp.WatchIdentitiesResponse(events=ev, synced=s),
        )

    # EndpointService
    @staticmethod
    def _entry(rec: cp.EndpointRecord) -> cp.IPCacheEntry:
        return cp.IPCacheEntry(
            cidr=f"{rec.ipv4}/32",
            identity=rec.identity,
            node_name=rec.node_name,
            owner=f"{rec.namespace}/{rec.name}",
        )

    def UpsertEndpoint(  # noqa: N802
        self, request: cp.UpsertEndpointRequest, context: Any
    ) -> cp.UpsertEndpointResponse:
        rec = request.endpoint
        with self.lock:
            self.endpoints[(rec.namespace, rec.name)] = rec
            self.hubs["ipcache"].publish(cp.IPCacheEvent(type=UPSERT, entry=self._entry(rec)))
        return cp.UpsertEndpointResponse()

    def DeleteEndpoint(  # noqa: N802
        self, request: cp.DeleteEndpointRequest, context: Any
    ) -> cp.DeleteEndpointResponse:
        with self.lock:
            self.deleted_endpoints.append((request.namespace, request.name))
            rec = self.endpoints.pop((request.namespace, request.name), None)
            if rec is not None:
                self.hubs["ipcache"].publish(cp.IPCacheEvent(type=DELETE, entry=self._entry(rec)))
        return cp.DeleteEndpointResponse()

    def set_ipcache_entry(self, entry: cp.IPCacheEntry) -> None:
        """Publish an ipcache entry that is no endpoint's (e.g. an API server address with
        identity 7, as the operator does from ``default/kubernetes``'s EndpointSlices)."""
        with self.lock:
            self.extra_ipcache[entry.cidr] = entry
            self.hubs["ipcache"].publish(cp.IPCacheEvent(type=UPSERT, entry=entry))

    def delete_ipcache_entry(self, cidr: str) -> None:
        """Withdraw an entry published with :meth:`set_ipcache_entry`."""
        with self.lock:
            entry = self.extra_ipcache.pop(cidr, None)
            if entry is not None:
                self.hubs["ipcache"].publish(cp.IPCacheEvent(type=DELETE, entry=entry))

    def WatchIPCache(self, request: Any, context: Any) -> Iterator[cp.WatchIPCacheResponse]:  # noqa: N802
        def snap() -> list[Any]:
            return [
                cp.IPCacheEvent(type=UPSERT, entry=self._entry(r)) for r in self.endpoints.values()
            ] + [cp.IPCacheEvent(type=UPSERT, entry=e) for e in self.extra_ipcache.values()]

        yield from self._stream(
            context, "ipcache", snap, lambda ev, s: cp.WatchIPCacheResponse(events=ev, synced=s)
        )

    # ServiceService: no Services; the listing waits for ``services_ready``
    def WatchServices(self, request: Any, context: Any) -> Iterator[cp.WatchServicesResponse]:  # noqa: N802
        while not self.services_ready.wait(0.1):
            if not context.is_active():
                return
        yield from self._stream(
            context, "services", list, lambda ev, s: cp.WatchServicesResponse(events=ev, synced=s)
        )

    # PolicyService
    def WatchPolicies(self, request: Any, context: Any) -> Iterator[cp.WatchPoliciesResponse]:  # noqa: N802
        def snap() -> list[Any]:
            return [
                cp.PolicyEvent(type=UPSERT, kind=k, namespace=ns, name=n, json=text)
                for (k, ns, n), text in self.policies.items()
            ]

        yield from self._stream(
            context, "policies", snap, lambda ev, s: cp.WatchPoliciesResponse(events=ev, synced=s)
        )
