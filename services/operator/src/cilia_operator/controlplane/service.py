"""ServiceService: every Service with its backends, for the agents' eBPF load balancer.

Services and EndpointSlices are followed from the shared per-kind informers
(:func:`.streams.watch_stream`), in both store modes: with ``--store kubernetes`` they are
the API server's (ClusterIPs allocated by kube-apiserver, EndpointSlices kept by
kube-controller-manager), in standalone mode the operator's own (``apply``, and the
Service controller of :mod:`cilia_operator.service.controller`).

A ``Service`` message joins one Service with every EndpointSlice labelled
``kubernetes.io/service-name: <its name>`` in its namespace; it is sent whole again when the
Service or any of those slices changes (and only when the message differs from the one
sent). Per Service port, the backends are the slices' endpoints whose slice port has the
same name and protocol (kube-controller-manager names slice ports after the Service
ports): each address with that slice port (the targetPort resolved for the pod), its
conditions (``ready`` absent means true, ``serving`` absent means ``ready``,
``terminating`` absent means false: the EndpointSlice API's rules), ``nodeName`` and
``targetRef`` (``namespace/name`` of a Pod). An address listed twice (two slices during a
controller's rewrite) is sent once.

``alias_ips``: the Service's former ClusterIPs kept by a ServiceCIDR migration
(annotation ``service.cilia.io/alias-ips``, :mod:`cilia_operator.service.migration`).

Re-creation hold (Kubernetes-mode migration, ``servicecidr migrate --kubernetes``): a
ClusterIP is immutable, so the migration deletes a Service and creates it again with the
same name in the new range. Before that it writes copies of the Service's EndpointSlices
labelled ``endpointslice.kubernetes.io/managed-by: servicecidr-migration.cilia.io`` and
annotated ``service.cilia.io/migrating-from: <old ClusterIP>`` (no ownerReferences: the
garbage collector leaves them). While such a slice names a Service:

- a DELETE of the Service is held: the last message (old ClusterIP, backends from the
  copies) stays what the agents serve, so no connect finds the address unserved. The
  migration also annotates the Service ``service.cilia.io/migrating-to: <new ip>`` just
  before deleting it: the DELETE event carries it, on the same watch as the re-creation,
  so the deletion is held even when the EndpointSlice watch lags behind the Service watch
  (the copies, written before the delete, still come before the originals' removal on
  that watch). Such a hold ends when the Service is created again;
- the re-created Service's message carries the old ClusterIP in ``alias_ips`` and the
  copies' endpoints among its backends until the migration has written the alias
  annotation and the new slices exist, and deletes the copies.

With no copy left, a held Service is deleted as usual.

Not sent (a DELETE when a sent Service becomes one): ExternalName Services, headless ones
(``clusterIP: None``) and Services without an IPv4 ClusterIP yet.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from cilia.controlplane.v1 import controlplane_pb2 as pb

from ..service import model
from ..store import Resource, Store, resource_version
from .errors import streaming
from .streams import WATCH_MESSAGE_MAX_BYTES, Changed, Listed, Sent, watch_stream

log = logging.getLogger(__name__)

Key = tuple[str, str]  # namespace, name


def _flag(conditions: Mapping[str, Any], name: str, default: bool) -> bool:
    value = conditions.get(name)
    return default if value is None else bool(value)


SlicePorts = list[tuple[Resource, dict[tuple[str, str], int]]]


def _slice_ports(slices: Sequence[Resource]) -> SlicePorts:
    """Each IPv4 slice with its ports by ``(name, protocol)`` (the first of a pair wins):
    built once per Service, so joining its ports costs O(ports + slice ports), not their
    product (a Service of 20,000 ports made that product stall the operator)."""
    out: SlicePorts = []
    for obj in slices:
        if obj.get("addressType") not in (None, "IPv4"):
            continue
        ports: dict[tuple[str, str], int] = {}
        for p in obj.get("ports") or []:
            if isinstance(p, Mapping):
                key = (str(p.get("name") or ""), str(p.get("protocol") or "TCP"))
                ports.setdefault(key, int(p.get("port") or 0))
        out.append((obj, ports))
    return out


def _backends(port: Mapping[str, Any], slices: SlicePorts) -> list[pb.ServiceBackend]:
    name = str(port.get("name") or "")
    protocol = str(port.get("protocol") or "TCP")
    out: dict[tuple[str, int], pb.ServiceBackend] = {}
    for obj, slice_ports in slices:
        target_port = slice_ports.get((name, protocol), 0)
        if not 1 <= target_port <= 65535:
            continue
        for ep in obj.get("endpoints") or []:
            if not isinstance(ep, Mapping):
                continue
            conditions = ep.get("conditions") or {}
            ready = _flag(conditions, "ready", True)
            ref = ep.get("targetRef") or {}
            target = (
                f"{ref.get('namespace') or model.key_of(obj)[0]}/{ref.get('name')}"
                if ref.get("kind") == "Pod" and ref.get("name")
                else ""
            )
            for address in ep.get("addresses") or []:
                try:
                    ip = str(ipaddress.IPv4Address(str(address)))
                except ValueError:
                    continue
                out.setdefault(
                    (ip, target_port),
                    pb.ServiceBackend(
                        ip=ip,
                        port=target_port,
                        ready=ready,
                        serving=_flag(conditions, "serving", ready),
                        terminating=_flag(conditions, "terminating", False),
                        node_name=str(ep.get("nodeName") or ""),
                        target=target,
                    ),
                )
    return [out[k] for k in sorted(out, key=lambda k: (ipaddress.IPv4Address(k[0]), k[1]))]


def service_message(service: Resource, slices: Sequence[Resource]) -> pb.Service | None:
    """The ``Service`` message of a Service record and its EndpointSlices; None when it is
    not load-balanced (ExternalName, headless, no IPv4 ClusterIP)."""
    spec = service.get("spec") or {}
    kind = str(spec.get("type") or "ClusterIP")
    ips = [str(ip) for ip in model.service_ips(service)]
    if kind == "ExternalName" or not ips:
        return None
    namespace, name = model.key_of(service)
    affinity = str(spec.get("sessionAffinity") or "None")
    timeout = 0
    if affinity == "ClientIP":
        config = (spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}
        timeout = int(config.get("timeoutSeconds") or model.DEFAULT_AFFINITY_TIMEOUT)
    indexed = _slice_ports(slices)
    ports = [
        pb.ServicePort(
            name=str(port.get("name") or ""),
            protocol=str(port.get("protocol") or "TCP"),
            port=int(port.get("port") or 0),
            node_port=int(port.get("nodePort") or 0) if kind in ("NodePort", "LoadBalancer") else 0,
            backends=_backends(port, indexed),
        )
        for port in spec.get("ports") or []
        if isinstance(port, Mapping)
    ]
    return pb.Service(
        namespace=namespace,
        name=name,
        type=kind,
        cluster_ips=ips,
        session_affinity=affinity,
        session_affinity_timeout_seconds=timeout,
        ports=ports,
        external_traffic_policy=str(spec.get("externalTrafficPolicy") or "Cluster"),
        internal_traffic_policy=str(spec.get("internalTrafficPolicy") or "Cluster"),
        alias_ips=[str(a) for a in model.alias_ips(service) if str(a) not in ips],
        resource_version=resource_version(service),
    )


class ServiceJoin:
    """Services and EndpointSlices as one client knows them; :meth:`apply` turns one
    list/watch item of either kind into the ``(key, message)`` events to send (message None
    = delete), deduplicated against what was sent."""

    def __init__(self) -> None:
        self.services: dict[Key, Resource] = {}
        self.slices: dict[Key, Resource] = {}  # slice key -> slice
        self.owner: dict[Key, Key] = {}  # slice key -> service key
        self.by_owner: dict[Key, set[Key]] = {}  # service key -> slice keys
        self.held: dict[Key, Resource] = {}  # deleted Services, as they were last
        self.sent: Sent[Key, pb.Service] = Sent()

    def _message(self, key: Key) -> pb.Service | None:
        slices = [self.slices[s] for s in sorted(self.by_owner.get(key, ()))]
        copies = [s for s in slices if model.migration_slice(s)]
        service = self.services.get(key)
        held = self.held.get(key)
        if service is None and held is not None and (copies or model.migrating_service(held)):
            service = held
        if service is None:
            return None
        message = service_message(service, slices)
        if message is not None:
            for obj in copies:
                old = model.migrating_from(obj)
                if old is not None and str(old) not in [*message.cluster_ips, *message.alias_ips]:
                    message.alias_ips.append(str(old))
        return message

    def _set_slice(self, obj: Resource, deleted: bool = False) -> set[Key]:
        key = model.key_of(obj)
        touched = set()
        old = self.owner.pop(key, None)
        self.slices.pop(key, None)
        if old is not None:
            touched.add(old)
            self.by_owner[old].discard(key)
            if not self.by_owner[old]:
                del self.by_owner[old]
        owner = model.slice_service(obj)
        if not deleted and owner is not None:
            self.slices[key] = obj
            self.owner[key] = owner
            self.by_owner.setdefault(owner, set()).add(key)
            touched.add(owner)
        return touched

    def apply(self, item: Listed | Changed) -> list[tuple[Key, pb.Service | None]]:
        """The events ``item`` causes (see the class docstring)."""
        if item.kind == model.SLICE_KIND:
            if isinstance(item, Listed):
                self.slices, self.owner, self.by_owner = {}, {}, {}
                for obj in item.items:
                    self._set_slice(obj)
                return self._resend(set(self.services))
            return self._resend(self._set_slice(item.event.object, item.event.type == "DELETED"))
        if isinstance(item, Listed):
            self.services = {model.key_of(o): o for o in item.items}
            keys = set(self.services) | set(self.held)
            current = {k: m for k in keys if (m := self._message(k)) is not None}
            return self.sent.replace(current)
        key = model.key_of(item.event.object)
        if item.event.type == "DELETED":
            self.services.pop(key, None)
            self.held[key] = item.event.object
        else:
            self.services[key] = item.event.object
            self.held.pop(key, None)
        touched = {key}
        # a held Service whose last migration copy went, and that no migration deleted (no
        # migrating-to annotation: that hold ends with the re-creation), is gone for good
        for gone in [
            k
            for k in self.held
            if k not in self.services
            and not model.migrating_service(self.held[k])
            and not any(model.migration_slice(self.slices[s]) for s in self.by_owner.get(k, ()))
        ]:
            del self.held[gone]
            touched.add(gone)
        return self._resend(touched)

    def _resend(self, keys: set[Key]) -> list[tuple[Key, pb.Service | None]]:
        out: list[tuple[Key, pb.Service | None]] = []
        for key in sorted(keys):
            out += self.sent.set(key, self._message(key))
        return out


class ServiceServicer:
    """``cilia.controlplane.v1.ServiceService``.

    Args:
        store: the Store; chunk_size / queue_size: ``--watch-list-chunk-size`` /
        ``--watch-buffer-size``; max_bytes: ``--watch-max-message-bytes`` (bytes of one
        stream message at most).
    """

    def __init__(
        self,
        store: Store,
        *,
        chunk_size: int,
        queue_size: int,
        max_bytes: int = WATCH_MESSAGE_MAX_BYTES,
    ) -> None:
        self.store = store
        self.chunk_size = chunk_size
        self.queue_size = queue_size
        self.max_bytes = max_bytes

    @streaming
    async def WatchServices(  # noqa: N802 (gRPC method name)
        self, request: pb.WatchServicesRequest, context: Any
    ) -> AsyncIterator[pb.WatchServicesResponse]:
        """Every Service (UPSERT, whole), ``synced`` on the last message of the listing,
        then each change (UPSERT whole, DELETE with namespace and name only).

        Errors: UNAVAILABLE (store down).
        """
        state = ServiceJoin()
        log.debug("services watched", extra={"node": request.node_name})

        def apply(item: Listed | Changed) -> list[pb.ServiceEvent]:
            return [
                pb.ServiceEvent(type=pb.EVENT_TYPE_UPSERT, service=message)
                if message is not None
                else pb.ServiceEvent(
                    type=pb.EVENT_TYPE_DELETE, service=pb.Service(namespace=key[0], name=key[1])
                )
                for key, message in state.apply(item)
            ]

        def respond(events: Sequence[pb.ServiceEvent], synced: bool) -> pb.WatchServicesResponse:
            return pb.WatchServicesResponse(events=events, synced=synced)

        async for response in watch_stream(
            self.store,
            [model.SERVICE_KIND, model.SLICE_KIND],
            apply,
            respond,
            key=lambda e: (e.service.namespace, e.service.name),
            chunk_size=self.chunk_size,
            queue_size=self.queue_size,
            max_bytes=self.max_bytes,
        ):
            yield response
