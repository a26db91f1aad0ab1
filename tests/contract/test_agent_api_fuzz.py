"""Bad input on every method of the agent API (``cilia.agent.v1``: AttachmentService,
DebugService) sent straight to a real cilia-agent's socket, past the CNI plugin's own
checks: fuzzed messages (every field drawn from its type, enum numbers the schema does not
define), huge fields and arbitrary bytes. Every answer is a clear status
(``cilia_testkit.grpcfuzz.CLEAR_CODES``: never UNKNOWN or INTERNAL), a refused request
leaves the agent's endpoints and pool usage as they were, and the agent keeps serving. (Host
interfaces are not compared: other suites on the host add and remove ``lxc*`` links.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from realagent import RealAgent

from cilia.agent.v1 import agent_pb2
from cilia_testkit import grpcfuzz

METHODS = grpcfuzz.methods(agent_pb2)
#: Seconds one call may take.
CALL_TIMEOUT_SECONDS = 30.0
#: Bytes of each string/bytes field of the "huge" requests.
HUGE_BYTES = 1 << 20


class Client:
    """An aio channel to the agent's socket on a loop of its own."""

    def __init__(self, agent: RealAgent) -> None:
        self.agent = agent
        self.loop = asyncio.new_event_loop()
        self.channel: Any = self.loop.run_until_complete(self._open())

    async def _open(self) -> Any:
        return grpc.aio.insecure_channel("unix:" + self.agent.socket)

    def state(self) -> tuple[Any, ...]:
        return (self.agent.endpoints(), self.agent.usage())

    def call(self, method: grpcfuzz.Method, payload: bytes) -> None:
        before = self.state()
        code, details = self.loop.run_until_complete(
            grpcfuzz.call(self.channel, method, payload, CALL_TIMEOUT_SECONDS)
        )
        assert grpcfuzz.is_clear(code), f"{method.name}: {code} {details}"
        if code != grpc.StatusCode.OK:
            assert self.state() == before, f"{method.name} refused ({code}) yet changed state"

    def close(self) -> None:
        self.loop.run_until_complete(self.channel.close())
        self.loop.close()


@pytest.fixture
def client(real_agent: RealAgent) -> Iterator[Client]:
    c = Client(real_agent)
    try:
        yield c
    finally:
        c.close()
    assert real_agent.proc is not None and real_agent.proc.poll() is None, "agent died"
    real_agent.usage()  # still answers


def test_every_agent_method_is_fuzzed() -> None:
    assert {m.name.rsplit("/", 1)[1] for m in METHODS} == {
        "Add", "Del", "Check", "GC", "Status", "ListEndpoints"
    }  # fmt: skip


def test_empty_huge_and_unknown_enum_requests_get_a_clear_status(client: Client) -> None:
    for method in METHODS:
        for message in (
            method.request_class()(),
            grpcfuzz.huge(method.request, HUGE_BYTES),
            grpcfuzz.extreme(method.request),
        ):
            client.call(method, message.SerializeToString())
        client.call(method, b"\xff\xff\xff")  # not a message at all


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_fuzzed_requests_get_a_clear_status_and_refusals_change_nothing(
    client: Client, data: Any
) -> None:
    method = data.draw(st.sampled_from(METHODS), label="method")
    if data.draw(st.booleans(), label="raw bytes"):
        payload = data.draw(st.binary(max_size=64), label="payload")
    else:
        payload = data.draw(grpcfuzz.messages(method.request), label="request").SerializeToString()
    client.call(method, payload)
