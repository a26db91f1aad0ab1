"""PodService: the Pods of one node, with their Namespaces' labels (Kubernetes mode).

In Kubernetes mode the container runtime's CNI call carries only the Pod's namespace and
name (``K8S_POD_NAMESPACE``/``K8S_POD_NAME`` in ``CNI_ARGS``; containerd and CRI-O send no
labels), so the agent builds an endpoint's security identity from the Pod object and its
Namespace, as upstream's agent does from its Pod and Namespace watchers. The operator is
the only component that talks to the API server: each agent's ``WatchPods`` stream follows
Pods and Namespaces (list, then watch) and sends the Pods whose ``spec.nodeName`` is the
agent's node — host-network Pods excluded (they get no endpoint) — each with its
Namespace's labels; a Namespace label change re-sends that namespace's Pods of the node.

With the Redis store (standalone mode) there are no Pod objects: the RPC fails with
FAILED_PRECONDITION, reason ``PODS_NOT_WATCHED``, and ``RegisterResponse.pods_from_api``
is false so agents never call it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_common import grpcerrors

from ..store import Resource, Store
from .errors import streaming
from .streams import WATCH_MESSAGE_MAX_BYTES, Changed, Listed, Sent, watch_stream

log = logging.getLogger(__name__)

POD_KIND = "Pod"
"""Store kind of core v1 Pods (Kubernetes store only)."""
NAMESPACE_KIND = "Namespace"
"""Store kind of core v1 Namespaces."""
DEFAULT_SERVICE_ACCOUNT = "default"
"""What the API server sets ``spec.serviceAccountName`` to when a Pod leaves it empty."""

PodKey = tuple[str, str]  # namespace, name


def _meta(obj: Resource) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _labels(obj: Resource) -> dict[str, str]:
    labels = _meta(obj).get("labels")
    if not isinstance(labels, Mapping):
        return {}
    return {str(k): str(v) for k, v in labels.items()}


def pod_key(obj: Resource) -> PodKey:
    """``(namespace, name)`` of a Pod object."""
    meta = _meta(obj)
    return str(meta.get("namespace") or "default"), str(meta.get("name") or "")


def pod_node(obj: Resource) -> str:
    """``spec.nodeName`` of a Pod, "" when unscheduled or a host-network Pod (no endpoint)."""
    spec = obj.get("spec")
    if not isinstance(spec, Mapping) or spec.get("hostNetwork"):
        return ""
    return str(spec.get("nodeName") or "")


def pod_message(obj: Resource, namespace_labels: Mapping[str, str]) -> pb.Pod:
    """The ``Pod`` message of a Pod object and its Namespace's labels.

    ``service_account`` is ``spec.serviceAccountName`` (``default`` when empty, as the API
    server's defaulting does); ``ips`` are ``status.podIPs[].ip``; ``container_ports`` the
    named ``spec.containers[].ports[]`` (protocol TCP when unset).
    """
    namespace, name = pod_key(obj)
    spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
    status = obj.get("status") if isinstance(obj.get("status"), Mapping) else {}
    ips = [
        str(entry.get("ip"))
        for entry in (status or {}).get("podIPs") or []
        if isinstance(entry, Mapping) and entry.get("ip")
    ]
    return pb.Pod(
        namespace=namespace,
        name=name,
        uid=str(_meta(obj).get("uid") or ""),
        node_name=pod_node(obj),
        labels=_labels(obj),
        namespace_labels=dict(namespace_labels),
        service_account=str((spec or {}).get("serviceAccountName") or DEFAULT_SERVICE_ACCOUNT),
        ips=ips,
        container_ports=_named_ports(spec or {}),
    )


def _named_ports(spec: Mapping[str, Any]) -> list[pb.ContainerPort]:
    out = []
    for container in spec.get("containers") or []:
        if not isinstance(container, Mapping):
            continue
        for port in container.get("ports") or []:
            if not isinstance(port, Mapping) or not port.get("name"):
                continue
            number = port.get("containerPort")
            if isinstance(number, int) and 0 < number < 65536:
                out.append(
                    pb.ContainerPort(
                        name=str(port["name"]),
                        port=number,
                        protocol=str(port.get("protocol") or "TCP"),
                    )
                )
    return out


class NodePods:
    """What one node's stream knows: its Pods and every Namespace's labels.

    :meth:`apply` turns one list/watch item of either kind into the Pod events to send
    (``(key, message)``, message None = delete), deduplicated against what was sent.
    """

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.pods: dict[PodKey, Resource] = {}
        self.namespaces: dict[str, dict[str, str]] = {}
        self.sent: Sent[PodKey, pb.Pod] = Sent()

    def _message(self, key: PodKey) -> pb.Pod:
        return pod_message(self.pods[key], self.namespaces.get(key[0], {}))

    def _resend(self, namespace: str | None = None) -> list[tuple[PodKey, pb.Pod | None]]:
        current = {k: self._message(k) for k in self.pods if namespace in (None, k[0])}
        scope = (lambda _k: True) if namespace is None else (lambda k: k[0] == namespace)
        return self.sent.replace(current, scope=scope)

    def apply(self, item: Listed | Changed) -> list[tuple[PodKey, pb.Pod | None]]:
        """The events ``item`` causes for this node (see the class docstring)."""
        if item.kind == NAMESPACE_KIND:
            if isinstance(item, Listed):
                self.namespaces = {str(_meta(o).get("name") or ""): _labels(o) for o in item.items}
                return self._resend()
            name = str(_meta(item.event.object).get("name") or "")
            if item.event.type == "DELETED":
                self.namespaces.pop(name, None)
            else:
                self.namespaces[name] = _labels(item.event.object)
            return self._resend(name)
        if isinstance(item, Listed):
            self.pods = {pod_key(o): o for o in item.items if pod_node(o) == self.node_name}
            return self._resend()
        obj = item.event.object
        key = pod_key(obj)
        if item.event.type == "DELETED" or pod_node(obj) != self.node_name:
            self.pods.pop(key, None)
            return self.sent.set(key, None)
        self.pods[key] = obj
        return self.sent.set(key, self._message(key))


class PodServicer:
    """``cilia.controlplane.v1.PodService``.

    Args:
        store: the Store; ``enabled``: the store holds Pods (``--store kubernetes``);
        chunk_size / queue_size: ``--watch-list-chunk-size`` / ``--watch-buffer-size``;
        max_bytes: ``--watch-max-message-bytes`` (bytes of one stream message at most).
    """

    def __init__(
        self,
        store: Store,
        *,
        enabled: bool,
        chunk_size: int,
        queue_size: int,
        max_bytes: int = WATCH_MESSAGE_MAX_BYTES,
    ) -> None:
        self.store = store
        self.enabled = enabled
        self.chunk_size = chunk_size
        self.queue_size = queue_size
        self.max_bytes = max_bytes

    @streaming
    async def WatchPods(  # noqa: N802 (gRPC method name)
        self, request: pb.WatchPodsRequest, context: Any
    ) -> AsyncIterator[pb.WatchPodsResponse]:
        """The node's Pods (``synced`` on the last message of the listing), then each
        change (UPSERT with the whole Pod message, DELETE with namespace and name).

        Errors: INVALID_ARGUMENT (no node name), FAILED_PRECONDITION ``PODS_NOT_WATCHED``
        (standalone mode), UNAVAILABLE (store down).
        """
        if not request.node_name:
            await grpcerrors.abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                "node_name: required",
                reason="INVALID_ARGUMENT",
                domain=grpcerrors.OPERATOR_DOMAIN,
            )
        if not self.enabled:
            await grpcerrors.abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "no Pods to stream: the operator does not run with --store kubernetes "
                "(standalone mode takes identity labels from the CNI call)",
                reason="PODS_NOT_WATCHED",
                domain=grpcerrors.OPERATOR_DOMAIN,
            )
        state = NodePods(request.node_name)

        def delete(key: PodKey) -> pb.PodEvent:
            return pb.PodEvent(
                type=pb.EVENT_TYPE_DELETE,
                pod=pb.Pod(namespace=key[0], name=key[1], node_name=request.node_name),
            )

        def apply(item: Listed | Changed) -> list[pb.PodEvent]:
            return [
                pb.PodEvent(type=pb.EVENT_TYPE_UPSERT, pod=message) if message else delete(key)
                for key, message in state.apply(item)
            ]

        def respond(events: Sequence[pb.PodEvent], synced: bool) -> pb.WatchPodsResponse:
            return pb.WatchPodsResponse(events=events, synced=synced)

        async for response in watch_stream(
            self.store,
            [NAMESPACE_KIND, POD_KIND],
            apply,
            respond,
            key=lambda e: (e.pod.namespace, e.pod.name),
            chunk_size=self.chunk_size,
            queue_size=self.queue_size,
            max_bytes=self.max_bytes,
        ):
            yield response
