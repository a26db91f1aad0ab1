"""The Pods of this node as the operator streams them (Kubernetes mode).

In Kubernetes mode a CNI ADD carries only ``K8S_POD_NAMESPACE``/``K8S_POD_NAME`` (the
container runtimes send no labels), so the endpoint's identity comes from the Pod object:
the operator's ``PodService.WatchPods`` stream (enabled when ``RegisterResponse.
pods_from_api`` says so) fills a :class:`PodCache`; an Add looks its Pod up there,
waiting up to ``--k8s-pod-wait-timeout`` for a Pod not seen yet (the kubelet may call the
plugin before the watch event arrives), and fails with a retryable error
(:class:`PodUnknown`, CNI code 11) when it still is not known.

The labels an endpoint's identity is built from (:meth:`PodInfo.endpoint_labels`) are, as
upstream's agent builds them: the Pod's labels, its Namespace's labels under
``io.cilium.k8s.namespace.labels.<key>``, ``io.cilium.k8s.policy.serviceaccount`` and
``io.cilium.k8s.policy.cluster`` (``--cluster-name``); the endpoint code adds
``io.kubernetes.pod.namespace`` and the ``k8s:`` source and applies the label filter.

A change of those labels on a running Pod (``kubectl label pod …``, a Namespace label
edit) is handed to the ``on_change`` observers, which re-compute the endpoint's identity
and policy without restarting the Pod.

Standalone mode (no ``pods_from_api``): :meth:`PodCache.endpoint_labels` returns None and
the CNI call's labels are used as before.

Source: upstream ``pkg/k8s/watchers`` (Pod/Namespace watchers), ``pkg/labels`` and
``pkg/k8s/apis/cilium.io`` label keys.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from cilia.controlplane.v1 import controlplane_pb2 as cp

log = logging.getLogger(__name__)

NAMESPACE_LABELS_PREFIX = "io.cilium.k8s.namespace.labels."
"""Key prefix of a Namespace's labels copied onto its Pods' identity labels."""
SERVICE_ACCOUNT_KEY = "io.cilium.k8s.policy.serviceaccount"
"""Key of the Pod's service account label."""
CLUSTER_KEY = "io.cilium.k8s.policy.cluster"
"""Key of the cluster name label."""

PodKey = tuple[str, str]  # namespace, name


class PodUnknown(Exception):
    """The Pod of a CNI ADD was not seen from the operator within the wait timeout
    (retryable: CNI code 11, the runtime tries again)."""


class PodRequired(ValueError):
    """Kubernetes mode needs the Pod's namespace and name in the CNI call (``CNI_ARGS``
    ``K8S_POD_NAMESPACE``/``K8S_POD_NAME``)."""


@dataclass(frozen=True)
class PodInfo:
    """What the agent keeps of one Pod (``controlplane.v1.Pod``)."""

    namespace: str
    name: str
    uid: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    service_account: str = "default"
    ips: tuple[str, ...] = ()  # status.podIPs
    named_ports: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """``(port name, protocol TCP|UDP|SCTP) → port`` of its named container ports."""

    @classmethod
    def of(cls, pod: cp.Pod) -> PodInfo:
        """From the stream's message."""
        return cls(
            namespace=pod.namespace,
            name=pod.name,
            uid=pod.uid,
            labels=dict(pod.labels),
            namespace_labels=dict(pod.namespace_labels),
            service_account=pod.service_account or "default",
            ips=tuple(pod.ips),
            named_ports={
                (p.name, p.protocol or "TCP"): int(p.port) for p in pod.container_ports if p.name
            },
        )

    def endpoint_labels(self, cluster_name: str) -> dict[str, str]:
        """Plain ``key → value`` labels of the Pod's endpoint (see the module docstring):
        ``{"app": "web", "io.cilium.k8s.namespace.labels.team": "a",
        "io.cilium.k8s.policy.serviceaccount": "default",
        "io.cilium.k8s.policy.cluster": "default"}``."""
        out = dict(self.labels)
        for key, value in self.namespace_labels.items():
            out[NAMESPACE_LABELS_PREFIX + key] = value
        out[SERVICE_ACCOUNT_KEY] = self.service_account
        if cluster_name:
            out[CLUSTER_KEY] = cluster_name
        return out


PodObserver = Callable[[str, str, dict[str, str]], Awaitable[None]]
"""``(namespace, name, endpoint labels)`` of a Pod whose endpoint labels changed."""


class PodCache:
    """This node's Pods from ``PodService.WatchPods``.

    Args:
        node_name: this node.
        cluster_name: ``--cluster-name`` (the ``io.cilium.k8s.policy.cluster`` label).
        wait_timeout: ``--k8s-pod-wait-timeout``: seconds an Add waits for its Pod (> 0).

    Create it inside the running event loop. Not thread-safe.
    """

    def __init__(self, node_name: str, cluster_name: str, wait_timeout: float) -> None:
        self.node_name = node_name
        self.cluster_name = cluster_name
        self.wait_timeout = wait_timeout
        self._pods: dict[PodKey, PodInfo] = {}
        self._enabled: bool | None = None  # None until the operator said
        self._decided = asyncio.Event()
        self._changed = asyncio.Condition()
        self._synced = False
        self._observers: list[PodObserver] = []

    # ------------------------------------------------------------------ mode

    @property
    def enabled(self) -> bool:
        """True when the operator streams Pods (Kubernetes mode)."""
        return bool(self._enabled)

    def set_enabled(self, enabled: bool) -> None:
        """The operator's ``RegisterResponse.pods_from_api`` (every registration)."""
        if self._enabled is not None and self._enabled != enabled:
            log.warning(
                "the operator's mode changed: Pods %s streamed",
                "are now" if enabled else "are no longer",
            )
        self._enabled = enabled
        self._decided.set()

    def on_change(self, observer: PodObserver) -> None:
        """Await ``observer`` for each Pod seen for the first time and each whose endpoint
        labels changed (it must change nothing when the labels are its endpoint's)."""
        self._observers.append(observer)

    # ------------------------------------------------------------------ the stream

    async def stream(
        self, open_stream: Callable[[str], AsyncIterable[cp.WatchPodsResponse]]
    ) -> AsyncIterator[cp.WatchPodsResponse]:
        """``open_stream(node_name)`` once the operator said it streams Pods; never yields
        (waits) in standalone mode."""
        await self._decided.wait()
        while not self._enabled:
            self._decided.clear()
            await self._decided.wait()
        async for response in open_stream(self.node_name):
            yield response

    async def consume(self, stream: AsyncIterable[cp.WatchPodsResponse]) -> bool:
        """Apply one ``WatchPods`` stream (its listing replaces what an earlier stream
        gave); returns True when it delivered anything."""
        delivered = False
        seen: set[PodKey] | None = set()
        async for response in stream:
            delivered = True
            changed: list[tuple[PodKey, PodInfo]] = []
            for event in response.events:
                key = (event.pod.namespace, event.pod.name)
                if seen is not None:
                    seen.add(key)
                if event.type == cp.EVENT_TYPE_DELETE:
                    self._pods.pop(key, None)
                    continue
                info = PodInfo.of(event.pod)
                old = self._pods.get(key)
                self._pods[key] = info
                # a Pod seen for the first time goes to the observers too: after an agent
                # restart its endpoint may still carry labels changed while it was down
                # (the observers change nothing when the labels are the same)
                if old is None or old.endpoint_labels(self.cluster_name) != info.endpoint_labels(
                    self.cluster_name
                ):
                    changed.append((key, info))
            if response.synced and seen is not None:
                for key in [k for k in self._pods if k not in seen]:
                    del self._pods[key]
                seen = None
                self._synced = True
            async with self._changed:
                self._changed.notify_all()
            for (namespace, name), info in changed:
                labels = info.endpoint_labels(self.cluster_name)
                log.info("pod labels changed", extra={"namespace": namespace, "pod": name})
                for observer in self._observers:
                    try:
                        await observer(namespace, name, labels)
                    except Exception:
                        log.exception("pod label change of %s/%s not applied", namespace, name)
        return delivered

    # ------------------------------------------------------------------ lookups

    def named_ports(self, namespace: str, name: str) -> Mapping[tuple[str, str], int]:
        """``(port name, protocol) → port`` of a known Pod's named container ports (empty
        for an unknown Pod): what a policy's named port resolves to on it."""
        info = self._pods.get((namespace, name))
        return info.named_ports if info is not None else {}

    def get(self, namespace: str, name: str) -> PodInfo | None:
        """The Pod, or None when not (yet) seen."""
        return self._pods.get((namespace, name))

    def __len__(self) -> int:
        return len(self._pods)

    def holder(self, address: str, exclude: tuple[str, str]) -> tuple[str, str] | None:
        """``(namespace, name)`` of a Pod of this node other than ``exclude`` whose
        ``status.podIPs`` hold ``address`` (a running Pod that keeps an address the agent
        has no endpoint record of: e.g. after ``helm uninstall``'s cleanup removed the
        state dir and a reinstall), or None (also in standalone mode)."""
        if not self.enabled:
            return None
        for key, info in self._pods.items():
            if key != exclude and address in info.ips:
                return key
        return None

    async def endpoint_labels(self, namespace: str, name: str) -> dict[str, str] | None:
        """The endpoint labels of Pod ``namespace/name`` (waiting for it up to
        ``wait_timeout``), or None in standalone mode (use the CNI call's labels).

        Raises:
            PodRequired: Kubernetes mode and no namespace or name given.
            PodUnknown: the Pod was not seen within ``wait_timeout`` seconds.
        """
        if not self.enabled:
            return None
        if not namespace or not name:
            raise PodRequired(
                "Kubernetes mode: the CNI call must name the Pod (CNI_ARGS "
                "K8S_POD_NAMESPACE and K8S_POD_NAME); its labels come from the Pod object"
            )
        key = (namespace, name)

        def known() -> bool:  # and the listing complete (holder() sees every Pod)
            return key in self._pods and self._synced

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(known), self.wait_timeout)
            except TimeoutError:
                raise PodUnknown(
                    f"pod {namespace}/{name} is not known on node {self.node_name} after "
                    f"{self.wait_timeout:g}s (--k8s-pod-wait-timeout): the operator has not "
                    "streamed it (is it scheduled to this node? is the operator watching "
                    f"Pods? {'synced' if self._synced else 'the Pod stream has not synced'})"
                ) from None
        return self._pods[key].endpoint_labels(self.cluster_name)
