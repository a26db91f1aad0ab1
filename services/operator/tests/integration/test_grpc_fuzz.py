"""Bad input on every gRPC method of the operator: fuzzed messages (every field drawn from
its type, enum numbers the schema does not define), huge fields, arbitrary bytes. Every
answer is a clear status (``cilia_testkit.grpcfuzz.CLEAR_CODES``: never UNKNOWN, an escaped
exception, nor INTERNAL; bytes that do not parse get INVALID_ARGUMENT from
``cilia_common.grpcinput``), a refused request changes nothing in the store, and the
operator keeps serving.

The operator runs in this process on a real Redis, as a follower replica (its leader-only
controllers stopped), so only the handlers write: the store's keys are compared byte for
byte around every refused call. Plaintext, so no authorisation stands between the input and
the handlers (test_mtls.py covers authorisation).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import redis
from cluster import operator_settings
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cilia.controlplane.v1 import controlplane_pb2
from cilia_operator.app import Operator
from cilia_operator.config import Config
from cilia_testkit import grpcfuzz

METHODS = grpcfuzz.methods(controlplane_pb2)
PREFIX = "fuzz/"
#: Seconds one fuzzed call may take (a stream: until its first message).
CALL_TIMEOUT_SECONDS = 10.0
#: Bytes of each string/bytes field of the "huge" requests (the manifest limit is 3 MiB).
HUGE_BYTES = 1 << 20


class Follower:
    """An in-process operator (follower: handlers only) on its own event loop."""

    def __init__(self, redis_url: str) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        for key in self.redis.scan_iter(match=f"{PREFIX}*"):
            self.redis.delete(key)
        self.loop = asyncio.new_event_loop()
        self.op = Operator(Config(**operator_settings(redis_url, store_key_prefix=PREFIX)))
        self.loop.run_until_complete(self.op.start())
        self.loop.run_until_complete(self.op._stop_leading())
        self.channel: Any = self.loop.run_until_complete(self._channel())

    async def _channel(self) -> Any:
        return grpc.aio.insecure_channel(self.op.address)

    def snapshot(self) -> dict[bytes, bytes | None]:
        """Every key of the operator's store, dumped."""
        return {k: self.redis.dump(k) for k in sorted(self.redis.scan_iter(match=f"{PREFIX}*"))}

    def call(self, method: grpcfuzz.Method, payload: bytes) -> None:
        """Call; assert a clear status and, when refused, an unchanged store."""
        before = self.snapshot()
        code, details = self.loop.run_until_complete(
            grpcfuzz.call(self.channel, method, payload, CALL_TIMEOUT_SECONDS)
        )
        assert grpcfuzz.is_clear(code), f"{method.name}: {code} {details}"
        if code != grpc.StatusCode.OK:
            assert self.snapshot() == before, f"{method.name} refused ({code}) yet wrote"

    def serving(self) -> bool:
        async def check() -> bool:
            stub = health_pb2_grpc.HealthStub(self.channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

        return self.loop.run_until_complete(check())

    def close(self) -> None:
        self.loop.run_until_complete(self.channel.close())
        self.loop.run_until_complete(self.op.stop())
        self.loop.close()


@pytest.fixture(scope="module")
def follower(redis_server: str) -> Iterator[Follower]:
    f = Follower(redis_server)
    try:
        yield f
    finally:
        f.close()


def test_every_method_is_fuzzed() -> None:
    """The list covers the whole control-plane API (20 methods in 8 services)."""
    services = {m.name.split("/")[1] for m in METHODS}
    assert len(services) == 8 and len(METHODS) >= 20, [m.name for m in METHODS]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name.rsplit(".", 1)[-1])
def test_empty_huge_and_unknown_enum_requests_get_a_clear_status(
    follower: Follower, method: grpcfuzz.Method
) -> None:
    for message in (
        method.request_class()(),
        grpcfuzz.huge(method.request, HUGE_BYTES),
        grpcfuzz.extreme(method.request),
    ):
        follower.call(method, message.SerializeToString())
    assert follower.serving()


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_requests_get_a_clear_status_and_refusals_change_nothing(
    follower: Follower, data: Any
) -> None:
    method = data.draw(st.sampled_from(METHODS), label="method")
    message = data.draw(grpcfuzz.messages(method.request), label="request")
    follower.call(method, message.SerializeToString())


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(method=st.sampled_from(METHODS), payload=st.binary(max_size=64))
def test_arbitrary_bytes_get_a_clear_status(
    follower: Follower, method: grpcfuzz.Method, payload: bytes
) -> None:
    follower.call(method, payload)
