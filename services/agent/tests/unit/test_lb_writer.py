"""The map writer over in-memory maps (no root): what a failed write leaves is repaired by
the next one."""

from __future__ import annotations

import ctypes
import errno
import pathlib
from typing import Any

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.libbpf import LibbpfError
from cilia_agent.loadbalancer.maps import LBMapFull, ServiceMapWriter, frontend_key
from cilia_agent.loadbalancer.model import Frontend


class MemoryMap:
    """A dict with the :class:`PinnedMap` calls the writer makes; ``fail_on`` makes the
    update of one key fail once with E2BIG."""

    def __init__(self, name: str) -> None:
        self.path = pathlib.Path("/sys/fs/bpf/memory") / name
        self.entries: dict[bytes, tuple[Any, Any]] = {}
        self.fail_on: bytes | None = None

    @staticmethod
    def _copy(value: Any) -> Any:
        out = type(value)()
        ctypes.memmove(ctypes.byref(out), ctypes.byref(value), ctypes.sizeof(value))
        return out

    def lookup(self, key: Any) -> Any:
        hit = self.entries.get(bytes(key))
        return None if hit is None else self._copy(hit[1])

    def update(self, key: Any, value: Any) -> None:
        if self.fail_on == bytes(key):
            self.fail_on = None
            raise LibbpfError(f"cannot update {self.path.name}", errno.E2BIG)
        self.entries[bytes(key)] = (self._copy(key), self._copy(value))

    def delete(self, key: Any) -> bool:
        return self.entries.pop(bytes(key), None) is not None

    def items(self) -> list[tuple[Any, Any]]:
        return [(self._copy(k), self._copy(v)) for k, v in self.entries.values()]


class MemoryMaps:
    def __init__(self) -> None:
        self.pin_dir = pathlib.Path("/sys/fs/bpf/memory")
        self.services = MemoryMap("cilium_lb4_services_v2")
        self.backends = MemoryMap("cilium_lb4_backends_v3")
        self.revnat = MemoryMap("cilium_lb4_reverse_nat")
        self.affinity_match = MemoryMap("cilium_lb_affinity_match")


def web(*ips: str) -> cp.Service:
    return cp.Service(
        namespace="u",
        name="web",
        cluster_ips=["198.18.82.1"],
        ports=[
            cp.ServicePort(
                protocol="TCP",
                port=80,
                backends=[cp.ServiceBackend(ip=ip, port=8080, ready=True) for ip in ips],
            )
        ],
    )


def test_a_write_that_failed_half_way_is_repaired_by_the_next() -> None:
    maps = MemoryMaps()
    writer = ServiceMapWriter(maps, capacity=1024)  # type: ignore[arg-type]
    writer.upsert_service(web("10.0.0.1", "10.0.0.2", "10.0.0.3"))
    front = Frontend("198.18.82.1", 80, 6)
    maps.services.fail_on = bytes(frontend_key(front, 2))

    with pytest.raises(LBMapFull, match="--bpf-lb-map-max 1024"):
        writer.upsert_service(web("10.0.0.4", "10.0.0.5"))
    writer.upsert_service(web("10.0.0.4", "10.0.0.5"))

    clean = MemoryMaps()
    ServiceMapWriter(clean, capacity=1024).upsert_service(web("10.0.0.4", "10.0.0.5"))  # type: ignore[arg-type]
    assert len(maps.services.entries) == len(clean.services.entries) == 3
    slots = {
        k.backend_slot: writer.backends[v.backend_id].address
        for k, v in maps.services.items()
        if k.backend_slot
    }
    assert slots == {1: "10.0.0.4", 2: "10.0.0.5"}
    assert sorted(b.address for b in writer.backends.values()) == ["10.0.0.4", "10.0.0.5"]
    assert len(maps.backends.entries) == 2
    master = maps.services.lookup(frontend_key(front))
    assert master is not None and master.count == 2


def test_restore_marks_a_frontend_with_a_missing_slot_for_a_full_rewrite() -> None:
    maps = MemoryMaps()
    ServiceMapWriter(maps, capacity=1024).upsert_service(web("10.0.0.1", "10.0.0.2"))  # type: ignore[arg-type]
    front = Frontend("198.18.82.1", 80, 6)
    maps.services.delete(frontend_key(front, 1))  # lost: count 2, only slot 2 left

    again = ServiceMapWriter(maps, capacity=1024)  # type: ignore[arg-type]
    again.restore()
    again.begin_resync()
    again.upsert_service(web("10.0.0.1", "10.0.0.2"))
    again.end_resync()

    assert {k.backend_slot for k, _ in maps.services.items()} == {0, 1, 2}
