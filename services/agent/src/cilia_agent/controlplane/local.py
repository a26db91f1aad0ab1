"""The operator calls an agent's owners make.

:class:`ControlPlane` is the part of ``cilia.controlplane.v1`` the identity allocator and
endpoint regeneration call, implemented over gRPC by
:class:`~cilia_agent.controlplane.operator.OperatorAPI` and, for an agent run with
``--operator ''``, by :class:`cilia_agent.identity.local.LocalControlPlane`.
"""

from __future__ import annotations

from typing import Protocol

from cilia.controlplane.v1 import controlplane_pb2 as cp


class ControlPlane(Protocol):
    """The operator calls identity allocation and endpoint records need."""

    async def allocate_identity(self, labels: list[str]) -> cp.Identity:
        """Identity of a sorted, filtered label set. Raises OperatorUnavailable."""

    async def release_identity(self, identity: int) -> None:
        """Drop this node's reference."""

    async def upsert_endpoint(self, record: cp.EndpointRecord) -> None:
        """Record the endpoint (feeds every agent's ipcache)."""

    async def delete_endpoint(self, namespace: str, name: str, container_id: str = "") -> None:
        """Remove the endpoint record (only this container's, when ``container_id`` is set)."""
