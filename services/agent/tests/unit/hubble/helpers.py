"""Shared builders for the Hubble unit tests."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable
from typing import Any, TypeVar

from cilia.hubble.flow import flow_pb2
from cilia_agent.hubble import events
from cilia_agent.hubble.enrich import MemoryResolver
from cilia_agent.hubble.parser import BootClock, Parser

T = TypeVar("T")

NODE = "node-a"
# Monotonic stamps are turned into wall time with this fixed offset (2024-01-01T00:00:00Z).
BOOT_OFFSET_NS = 1_704_067_200 * 1_000_000_000

FRONTEND_IP, BACKEND_IP, OTHER_IP, REMOTE_IP, WORLD_IP = (
    "10.200.0.10",
    "10.200.0.20",
    "10.200.0.30",
    "10.200.1.5",
    "198.51.100.7",
)
FRONTEND_ID, BACKEND_ID, OTHER_ID, REMOTE_ID = 1001, 1002, 1003, 1004
FRONTEND_EP, BACKEND_EP, OTHER_EP = 11, 12, 13


def resolver() -> MemoryResolver:
    """Three local pods in namespace "demo" and one remote pod in "prod"."""
    r = MemoryResolver(kernel_interface_names=False)
    for ep, ip, ident, name, app in (
        (FRONTEND_EP, FRONTEND_IP, FRONTEND_ID, "frontend-7d9f", "frontend"),
        (BACKEND_EP, BACKEND_IP, BACKEND_ID, "backend-5c4b", "backend"),
        (OTHER_EP, OTHER_IP, OTHER_ID, "other-1", "other"),
    ):
        labels = [f"k8s:app={app}", "k8s:io.kubernetes.pod.namespace=demo"]
        r.set_endpoint(ep, ipv4=ip, identity=ident, namespace="demo", pod_name=name, labels=labels)
        r.set_identity(ident, labels)
        r.set_interface(100 + ep, f"lxc{ep:011d}")
    r.set_ipcache(f"{REMOTE_IP}/32", REMOTE_ID, owner="prod/db-0")
    r.set_identity(REMOTE_ID, ["k8s:app=db", "k8s:io.kubernetes.pod.namespace=prod"])
    return r


def parser(res: MemoryResolver | None = None) -> Parser:
    return Parser(res or resolver(), NODE, BootClock(offset_ns=BOOT_OFFSET_NS))


_ts = itertools.count(1_000_000_000, 1_000_000)


def event(**overrides: Any) -> events.FlowEvent:
    """A forwarded TCP SYN frontend → backend:8080 seen at frontend's egress hook."""
    values: dict[str, Any] = {
        "ts_ns": next(_ts),
        "saddr": FRONTEND_IP,
        "daddr": BACKEND_IP,
        "sport": 40000,
        "dport": 8080,
        "proto": events.IPPROTO_TCP,
        "event_type": events.EVENT_TRACE,
        "verdict": events.VERDICT_FORWARDED,
        "drop_reason": 0,
        "src_identity": FRONTEND_ID,
        "dst_identity": BACKEND_ID,
        "ep_id": FRONTEND_EP,
        "ifindex": 100 + FRONTEND_EP,
        "length": 74,
        "direction": events.DIR_EGRESS,
        "is_reply": False,
        "tcp_flags": events.TCP_SYN,
    }
    values.update(overrides)
    return events.FlowEvent(**values)


def dropped(**overrides: Any) -> events.FlowEvent:
    """other → backend:8080 dropped at backend's ingress hook (POLICY_DENIED)."""
    values: dict[str, Any] = {
        "saddr": OTHER_IP,
        "src_identity": OTHER_ID,
        "ep_id": BACKEND_EP,
        "ifindex": 100 + BACKEND_EP,
        "direction": events.DIR_INGRESS,
        "event_type": events.EVENT_DROP,
        "verdict": events.VERDICT_DROPPED,
        "drop_reason": events.DROP_POLICY_DENIED,
    }
    values.update(overrides)
    return event(**values)


def flow(**overrides: Any) -> flow_pb2.Flow:
    return parser().parse(event(**overrides))


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())
