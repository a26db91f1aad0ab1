"""What the pinned load-balancer maps hold, read back for ``cilia-agent service list``
(upstream ``cilium service list``): one row per frontend, its backends with their state.
Reads the pins only (no agent); root is needed."""

from __future__ import annotations

import pathlib
from typing import Any

from cilia_agent.loadbalancer.layout import (
    BACKEND_STATE_TEXT,
    PROTOCOL_TEXT,
    SVC_FLAG_AFFINITY,
    SVC_FLAG_NODEPORT,
    Lb4Backend,
    Lb4Service,
)
from cilia_agent.loadbalancer.maps import LBMaps, backend_of, frontend_of
from cilia_agent.loadbalancer.model import Frontend


def read_frontends(pin_dir: pathlib.Path) -> list[dict[str, Any]]:
    """Every frontend under ``pin_dir``, sorted by ID (its rev-NAT index)::

        {"id": 3, "frontend": "10.96.0.10:53/UDP", "type": "ClusterIP",
         "affinity_timeout": 0, "backends": [{"address": "10.0.1.5:5353/UDP",
         "state": "active", "id": 7}, ...]}

    The slots name only active backends. A terminating backend is in no slot (the maps do
    not say which frontend keeps it), so it is listed in a row of its own with ``"id": 0``
    and ``"frontend": ""`` after the frontends.

    Raises:
        LibbpfError: the maps are not pinned there, or no permission.
    """
    maps = LBMaps(pin_dir)
    try:
        backends: dict[int, Lb4Backend] = {k.value: v for k, v in maps.backends.items()}
        masters: dict[Frontend, Lb4Service] = {}
        slots: dict[Frontend, dict[int, int]] = {}
        for key, entry in maps.services.items():
            front = frontend_of(key)
            if key.backend_slot == 0:
                masters[front] = entry
            else:
                slots.setdefault(front, {})[key.backend_slot] = entry.backend_id
    finally:
        maps.close()
    rows: list[dict[str, Any]] = []
    in_slots: set[int] = set()
    for front, master in masters.items():
        ids = [bid for _, bid in sorted(slots.get(front, {}).items())[: master.count]]
        in_slots.update(ids)
        rows.append(
            {
                "id": int(master.rev_nat_index),
                "frontend": f"{front.address}:{front.port}/"
                f"{PROTOCOL_TEXT.get(front.proto, front.proto)}",
                "type": "NodePort" if master.flags & SVC_FLAG_NODEPORT else "ClusterIP",
                "affinity_timeout": int(master.backend_id)
                if master.flags & SVC_FLAG_AFFINITY
                else 0,
                "backends": [_backend_row(bid, backends[bid]) for bid in ids if bid in backends],
            }
        )
    rows.sort(key=lambda r: int(r["id"]))
    for bid, value in sorted(backends.items()):
        if bid not in in_slots:
            row = {"id": 0, "frontend": "", "type": "", "affinity_timeout": 0}
            rows.append({**row, "backends": [_backend_row(bid, value)]})
    return rows


def _backend_row(bid: int, value: Lb4Backend) -> dict[str, Any]:
    be = backend_of(value)
    return {
        "id": bid,
        "address": f"{be.address}:{be.port}/{PROTOCOL_TEXT.get(be.proto, be.proto)}",
        "state": BACKEND_STATE_TEXT.get(value.flags, str(value.flags)),
    }
