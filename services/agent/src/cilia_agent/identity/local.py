"""Identities numbered by the agent alone, for an agent without an operator.

:class:`LocalControlPlane` answers the :class:`~cilia_agent.controlplane.ControlPlane` calls
for ``--operator ''`` (tests, a single host): identities from 256 up, one per label set;
endpoint records go nowhere.
"""

from __future__ import annotations

from collections.abc import Iterable

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_common.reserved_identities import MINIMAL_CLUSTER_IDENTITY


class LocalControlPlane:
    """:class:`ControlPlane` for an agent without an operator (``--operator ''``).

    Identities are numbered by this agent alone from 256 up, one per label set (seeded
    from restored endpoints so numbers survive restarts); endpoint records go nowhere.
    Meant for tests and single-host setups: identities are not shared with other nodes.
    """

    def __init__(self) -> None:
        self._by_labels: dict[tuple[str, ...], int] = {}
        self._next = MINIMAL_CLUSTER_IDENTITY

    def seed(self, labels: Iterable[str], identity: int) -> None:
        """Reuse ``identity`` for ``labels`` (restored endpoint)."""
        key = tuple(sorted(labels))
        self._by_labels.setdefault(key, identity)
        self._next = max(self._next, identity + 1)

    async def allocate_identity(self, labels: list[str]) -> cp.Identity:
        """See :class:`ControlPlane`."""
        key = tuple(sorted(labels))
        identity = self._by_labels.get(key)
        if identity is None:
            identity = self._by_labels[key] = self._next
            self._next += 1
        return cp.Identity(id=identity, labels=list(key))

    async def release_identity(self, identity: int) -> None:
        """Identities stay numbered for the life of the process."""

    async def upsert_endpoint(self, record: cp.EndpointRecord) -> None:
        """No operator: nothing to record."""

    async def delete_endpoint(self, namespace: str, name: str, container_id: str = "") -> None:
        """No operator: nothing to delete."""
