"""Stand-ins for the operator's identity and endpoint calls, for tests of the identity
allocator and endpoint regeneration (beside ``local.py``, the operator-less control plane)."""

from __future__ import annotations

import asyncio
from typing import Any

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.controlplane import OperatorUnavailable
from cilia_agent.identity.local import LocalControlPlane


class FakeOperator:
    """The operator's IdentityService as one node's allocator calls it: numbers per label set
    from 256, this node's references, every call recorded (``calls``). Each call takes a
    5 ms round trip; ``allocate_gate``/``release_gate`` hold calls until set;
    ``fail_allocate``/``fail_release`` count calls that raise OperatorUnavailable."""

    def __init__(self) -> None:
        self.numbers: dict[tuple[str, ...], int] = {}
        self.referenced: set[int] = set()
        self.calls: list[tuple[str, Any]] = []
        self.allocate_gate: asyncio.Event | None = None
        self.release_gate: asyncio.Event | None = None
        self.fail_allocate = 0
        self.fail_release = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self._next = 256

    async def allocate_identity(self, labels: list[str]) -> cp.Identity:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.005)  # a round trip: lets other tasks run meanwhile
            if self.allocate_gate is not None:
                await self.allocate_gate.wait()
            if self.fail_allocate:
                self.fail_allocate -= 1
                raise OperatorUnavailable("operator down (test)")
            key = tuple(labels)
            if key not in self.numbers:
                self.numbers[key] = self._next
                self._next += 1
            identity = self.numbers[key]
            self.referenced.add(identity)
            self.calls.append(("allocate", identity))
            return cp.Identity(id=identity, labels=labels)
        finally:
            self.in_flight -= 1

    async def release_identity(self, identity: int) -> None:
        await asyncio.sleep(0.005)
        if self.release_gate is not None:
            await self.release_gate.wait()
        if self.fail_release:
            self.fail_release -= 1
            raise OperatorUnavailable("operator down (test)")
        self.referenced.discard(identity)
        self.calls.append(("release", identity))

    def forget(self, labels: tuple[str, ...]) -> int:
        """GC (or an admin) deleted the identity and the number went to other labels."""
        identity = self.numbers.pop(labels)
        self.referenced.discard(identity)
        self.numbers[("k8s:app=squatter",)] = identity
        return identity

    def allocations(self) -> int:
        return sum(1 for call, _ in self.calls if call == "allocate")

    def releases(self) -> list[int]:
        return [i for call, i in self.calls if call == "release"]


class FakeControl(LocalControlPlane):
    """:class:`LocalControlPlane` that also keeps what an operator would be told: endpoint
    records by name, released identities, deleted endpoints, the number of allocations;
    ``fail_upsert`` makes :meth:`upsert_endpoint` raise OperatorUnavailable."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[str, cp.EndpointRecord] = {}
        self.releases: list[int] = []
        self.deleted: list[tuple[str, str]] = []
        self.fail_upsert = False
        self.allocations = 0

    async def allocate_identity(self, labels: list[str]) -> cp.Identity:
        self.allocations += 1
        return await super().allocate_identity(labels)

    async def release_identity(self, identity: int) -> None:
        self.releases.append(identity)

    async def upsert_endpoint(self, record: cp.EndpointRecord) -> None:
        if self.fail_upsert:
            raise OperatorUnavailable("endpoint record at operator failed (test)")
        self.records[record.name] = record

    async def delete_endpoint(self, namespace: str, name: str, container_id: str = "") -> None:
        self.deleted.append((namespace, name))
