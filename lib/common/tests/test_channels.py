"""cilia_common.channels.SwappableChannel against two real grpcio servers: a stub made once
follows a swap, a call already made keeps its channel, close closes the replaced ones."""

from __future__ import annotations

import asyncio
import pathlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cilia_common.channels import SwappableChannel
from cilia_common.grpcserver import set_serving, start_server


class _ToOne(SwappableChannel):
    """Dials ``target`` on first use; :meth:`move` swaps to another target."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def current(self) -> grpc.aio.Channel:
        if self._current is None:
            self.swap(grpc.aio.insecure_channel(self.target))
        return self._current

    def move(self, target: str) -> None:
        self.target = target
        self.swap(grpc.aio.insecure_channel(target))


def test_a_stub_made_once_follows_a_swap_and_close_closes_every_channel(
    tmp_path: pathlib.Path,
) -> None:
    async def scenario() -> tuple[list[int], int, list[grpc.aio.Channel]]:
        # server a says SERVING, server b NOT_SERVING: which one answered is in the reply
        a, health_a = await start_server([], [f"unix:{tmp_path / 'a.sock'}"])
        b, _ = await start_server([], [f"unix:{tmp_path / 'b.sock'}"])
        await set_serving(health_a, [])
        channel = _ToOne(f"unix:{tmp_path / 'a.sock'}")
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            seen = [(await stub.Check(health_pb2.HealthCheckRequest())).status]
            first = channel.current()
            channel.move(f"unix:{tmp_path / 'b.sock'}")
            seen.append((await stub.Check(health_pb2.HealthCheckRequest())).status)
            both = [first, channel.current()]
            await channel.close()
            return seen, channel.generation, both
        finally:
            await a.stop(None)
            await b.stop(None)

    seen, generation, both = asyncio.run(scenario())
    assert seen == [
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    ]
    assert generation == 1
    for closed in both:  # the replaced channel was closed too
        with pytest.raises(grpc.aio.UsageError):
            closed.unary_unary("/x.Y/Z")(b"")
