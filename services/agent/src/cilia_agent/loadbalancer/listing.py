"""What the pinned load-balancer maps hold, read back for ``cilia-agent service list``
(upstream ``cilium service list``): one row per frontend, its backends with their state.
Reads the pins only (no agent, no bcc); root is needed."""

from __future__ import annotations

import pathlib
from typing import Any

from cilia_agent.loadbalancer.layout import (
    BACKEND_STATE_TEXT,
    PROTOCOL_TEXT,
    SVC_FLAG_AFFINITY,
)
from cilia_agent.loadbalancer.maps import LBMaps, backend_of, frontend_of


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
        backends = {k.value: v for k, v in maps.backends.items()}
        masters: dict[Any, Any] = {}
        slots: dict[Any, dict[int, int]] = {}
        for key, value in maps.services.items():
            front = frontend_of(key)
            if key.backend_slot == 0:
                masters[front] = value
            else:
                slots.setdefault(front, {})[key.backend_slot] = value.backend_id
    finally:
        maps.close()
    rows = []
    for front, master in masters.items():
        listed = []
        for _, bid in sorted(slots.get(front, {}).items())[: master.count]:
            value = backends.get(bid)
            if value is None:
                continue
            be = backend_of(value)
            listed.append(
                {
                    "id": bid,
                    "address": f"{be.address}:{be.port}/{PROTOCOL_TEXT.get(be.proto, be.proto)}",
                    "state": BACKEND_STATE_TEXT.get(value.flags, str(value.flags)),
                }
            )
        rows.append(
            {
                "id": int(master.rev_nat_index),
                "frontend": f"{front.address}:{front.port}/"
                f"{PROTOCOL_TEXT.get(front.proto, front.proto)}",
                "type": "ClusterIP",
                "affinity_timeout": int(master.backend_id)
                if master.flags & SVC_FLAG_AFFINITY
                else 0,
                "backends": listed,
            }
        )
    rows.sort(key=lambda r: int(r["id"]))
    in_slots = {b["id"] for r in rows for b in r["backends"]}
    for bid, value in sorted(backends.items()):
        if bid in in_slots:
            continue
        be = backend_of(value)
        rows.append(
            {
                "id": 0,
                "frontend": "",
                "type": "",
                "affinity_timeout": 0,
                "backends": [
                    {
                        "id": bid,
                        "address": f"{be.address}:{be.port}/"
                        f"{PROTOCOL_TEXT.get(be.proto, be.proto)}",
                        "state": BACKEND_STATE_TEXT.get(value.flags, str(value.flags)),
                    }
                ],
            }
        )
    return rows
