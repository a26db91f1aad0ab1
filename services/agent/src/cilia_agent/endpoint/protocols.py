"""What the endpoint lifecycle needs from the rest of the agent, as protocols.

The node (readiness, router IP, default pool), the pod cache (Kubernetes labels), the pool
selector (which pool, waiting for addresses) and the enforcement layer (identity, policy, BPF
programs around plumbing). The real classes live in higher or sibling layers; the endpoint
package depends only on these shapes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.ipam import PoolExhausted


class NodeView(Protocol):
    """What endpoints read of the local node (``cilia_agent.node.LocalNode``)."""

    @property
    def router_ip(self) -> ipaddress.IPv4Address | None:
        """The pods' gateway (None until the first CIDR arrived)."""

    @property
    def default_pool(self) -> str:
        """The pool of a pod that names none."""

    @property
    def not_ready_reason(self) -> str | None:
        """None when Adds may proceed, else why not."""


class PodLabels(Protocol):
    """Where an Add's labels come from in Kubernetes mode (``cilia_agent.k8s.PodCache``)."""

    async def endpoint_labels(self, namespace: str, name: str) -> dict[str, str] | None:
        """The Pod's endpoint labels (waiting a bounded time for the Pod), or None when
        the CNI call's labels are used (standalone mode).

        Raises:
            ValueError: the call does not name the Pod (Kubernetes mode).
            Exception: the Pod is not known in time (a retryable error)."""

    def holder(self, address: str, exclude: tuple[str, str]) -> tuple[str, str] | None:
        """``(namespace, name)`` of another Pod of this node that holds ``address``
        (its ``status.podIPs``), or None."""


class PoolSelection(Protocol):
    """Chooses a new pod's pool (``cilia_agent.ipam.selection.PoolSelector``)."""

    async def select(
        self,
        requested: str,
        namespace: str,
        name: str,
        labels: Mapping[str, str],
        annotations: Mapping[str, str],
    ) -> str:
        """The pool for the pod. Raises ValueError (the pool cannot be served) or
        OperatorUnavailable."""

    async def wait_for_addresses(
        self, exc: PoolExhausted, container_id: str, deadline: float | None
    ) -> float:
        """Wait after ``exc`` and return the deadline for the next attempt, or raise
        PoolExhausted / PoolPending when the Add must fail."""


class EndpointHooks(Protocol):
    """What the manager calls around plumbing (``endpoint.enforcement.Enforcement``)."""

    async def create(
        self,
        rec: EndpointRecord,
        ifindex: int | Awaitable[int],
        on_identity: Callable[[int], Awaitable[None]] | None = None,
    ) -> int:
        """Enforce policy on a plumbed endpoint; returns its identity. Undoes itself on error.

        ``ifindex`` is the host veth's index, or a future of it while the veth is being
        plumbed (the veth must not be touched before it resolves; its error is the plumb
        error). ``on_identity`` is awaited as soon as the identity is allocated."""

    async def delete(self, rec: EndpointRecord, *, veth_deleted_next: bool = False) -> None:
        """Remove what :meth:`create` (or a restore) set up for ``rec``.

        ``veth_deleted_next``: the caller deletes the host veth right afterwards (anything
        attached to the device goes with it)."""

    async def health(self, rec: EndpointRecord) -> list[str]:
        """Problems of ``rec``'s enforcement (programs, map entries); [] when healthy."""

    async def relabel(self, rec: EndpointRecord) -> int:
        """``rec``'s labels changed: re-compute its identity and policy; returns the
        identity in force."""
