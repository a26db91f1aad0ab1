"""Every relay listener is announced once, with the address it bound (port 0 read back)."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cilia_relay.app import Relay
from cilia_relay.config import Config


def test_observer_health_and_metrics_are_announced_with_their_bound_ports(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = Config(
        peer_service=f"unix:{tmp_path}/no-agent.sock",
        listen_address="127.0.0.1:0",
        health_listen_address="127.0.0.1:0",
        prometheus_serve_addr="127.0.0.1:0",
    )

    async def scenario() -> dict[str, str]:
        relay = Relay(config)
        await relay.start()
        try:
            listening = {
                r.listener: r.address  # type: ignore[attr-defined]
                for r in caplog.records
                if r.getMessage() == "listening"
            }
            async with grpc.aio.insecure_channel(listening["health"]) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no agent
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://{listening['metrics']}/metrics").read()
            )
            assert b"hubble_relay_pool_peer_connection_status" in body
            return listening
        finally:
            await relay.stop(0)

    with caplog.at_level(logging.INFO, logger="cilia_relay"):
        listening = asyncio.run(scenario())
    assert set(listening) == {"observer", "health", "metrics"}
    assert len([r for r in caplog.records if r.getMessage() == "listening"]) == 3
    for address in listening.values():
        host, _, port = address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
