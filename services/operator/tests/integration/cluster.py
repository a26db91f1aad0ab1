"""Helpers for integration tests: an in-process operator on port 0 with config overrides."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_operator.app import Operator
from cilia_operator.config import Config

POOL = "default=ipv4-cidrs:10.251.0.0/22;ipv4-mask-size:24"


def operator_settings(redis_url: str, **overrides: Any) -> dict[str, Any]:
    """Operator ``Config`` fields for an in-process test operator on ``redis_url``: port 0,
    no metrics, the test pool, fast watches and shutdown, no identity GC; ``overrides``
    win."""
    settings: dict[str, Any] = {
        "store": redis_url,
        "listen": "127.0.0.1:0",
        "prometheus_serve_addr": "",
        "auto_create_cilium_pod_ip_pools": [POOL],
        "store_watch_block_timeout": 0.5,
        "shutdown_grace_period": 0.1,
        "identity_gc_interval": 0,
    }
    settings.update(overrides)
    return settings


@asynccontextmanager
async def running_operator(redis_url: str, **overrides: Any) -> AsyncIterator[tuple[Operator, Any]]:
    """An operator against ``redis_url`` and an aio channel to it."""
    settings = operator_settings(redis_url, **overrides)
    op = Operator(Config(**settings))
    await op.start()
    channel = grpc.aio.insecure_channel(op.address)
    try:
        yield op, channel
    finally:
        await channel.close()
        await op.stop()


async def register(channel: Any, name: str, address: str = "192.0.2.10") -> None:
    await pb_grpc.NodeServiceStub(channel).Register(
        pb.RegisterRequest(node_name=name, addresses=[address])
    )


async def allocate(channel: Any, labels: list[str], node: str = "n1") -> pb.AllocateResponse:
    return await pb_grpc.IdentityServiceStub(channel).Allocate(
        pb.AllocateRequest(node_name=node, labels=labels)
    )
