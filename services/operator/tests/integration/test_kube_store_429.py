"""The Kubernetes store retries HTTP 429 as the server asks (Retry-After), then gives up.

A real kube-apiserver answers 429 "storage is (re)initializing" for a moment right after a
CRD is created (the operator died of it at start before this was handled), and under API
priority and fairness; neither comes on demand, so a small aiohttp server plays that part.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from cilia_operator.store.base import StoreUnavailable
from cilia_operator.store.kubernetes import KubernetesStore

POOLS = "/apis/cilium.io/v2alpha1/ciliumpodippools"


class TooManyFirst:
    """Answers ``refusals`` 429s (Retry-After ``retry_after``), then an empty list."""

    def __init__(self, refusals: int, retry_after: str) -> None:
        self.refusals = refusals
        self.retry_after = retry_after
        self.calls: list[float] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append(time.monotonic())
        if len(self.calls) <= self.refusals:
            return web.json_response(
                {"kind": "Status", "reason": "TooManyRequests",
                 "message": "storage is (re)initializing"},
                status=429,
                headers={"Retry-After": self.retry_after},
            )  # fmt: skip
        return web.json_response({"items": [], "metadata": {"resourceVersion": "7"}})


async def _served(app_handler: Any) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get(POOLS, app_handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _store(url: str, timeout: float) -> KubernetesStore:
    from kubernetes.aio import client

    cfg = client.Configuration()
    cfg.host = url
    return KubernetesStore(configuration=cfg, request_timeout=timeout)


@pytest.mark.parametrize("retry_after", ["1", ""])
async def test_429_is_retried_after_the_servers_delay_and_then_succeeds(retry_after: str) -> None:
    server = TooManyFirst(2, retry_after)
    async for url in _served(server.handle):
        store = _store(url, timeout=10.0)
        try:
            listed = await store.list("CiliumPodIPPool")
        finally:
            await store.close()
        assert listed.resource_version == "7" and len(server.calls) == 3
        gaps = [b - a for a, b in zip(server.calls, server.calls[1:], strict=False)]
        assert all(gap >= 0.9 for gap in gaps), gaps


async def test_429_for_longer_than_the_request_timeout_is_store_unavailable() -> None:
    server = TooManyFirst(1000, "1")
    async for url in _served(server.handle):
        store = _store(url, timeout=2.5)
        started = time.monotonic()
        try:
            with pytest.raises(StoreUnavailable, match="429"):
                await store.list("CiliumPodIPPool")
        finally:
            await store.close()
        assert 2.0 <= time.monotonic() - started < 6.0
        assert 2 <= len(server.calls) <= 4
