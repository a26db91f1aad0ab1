"""The relay against two contract-level fake agents (real gRPC on unix sockets).

Agents ``node-a`` and ``node-b`` serve Observer (``node-a`` also serves Peer and
announces ``node-a``, ``node-b`` and ``node-c``, whose socket does not exist).
The relay runs in-process; clients use real gRPC channels to its socket.
"""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from relay_fakes import NS, FakeAgent, agents, make_flow, wait_until

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia.hubble.peer import peer_pb2
from cilia.hubble.relay import relay_pb2
from cilia_relay.app import Relay
from cilia_relay.config import Config
from cilia_relay.merge import response_time_ns

pytestmark = pytest.mark.timeout(60)


def relay_config(sockdir: pathlib.Path, peer_service: str, **overrides: object) -> Config:
    values: dict[str, object] = {
        "peer_service": peer_service,
        "listen_address": f"unix:{sockdir}/relay.sock",
        "health_listen_address": f"unix:{sockdir}/health.sock",
        "sort_buffer_drain_timeout": "200ms",
        "dial_timeout": "1s",
        "retry_timeout": "300ms",
        "peer_update_interval": "200ms",
        "error_aggregation_window": "300ms",
        "shutdown_grace_period": "0",
    }
    values.update(overrides)
    return Config.model_validate(values)


def two_agents(
    sockdir: pathlib.Path, base_ns: int, count: int = 5, batches: tuple[bool, bool] = (False, False)
) -> tuple[FakeAgent, FakeAgent]:
    """node-a flows at base+0,2,4.. s; node-b at base+1,3,5.. s (interleaved); ``batches``:
    which of them serve FlowBatchService."""
    a_sock, b_sock = sockdir / "a.sock", sockdir / "b.sock"
    peers = {
        "node-a": f"unix:{a_sock}",
        "node-b": f"unix:{b_sock}",
        "node-c": f"unix:{sockdir}/missing.sock",
    }
    a = FakeAgent(
        "node-a",
        a_sock,
        [make_flow(base_ns + 2 * i * NS, "node-a") for i in range(count)],
        observer_pb2.ServerStatusResponse(
            num_flows=10,
            max_flows=4095,
            seen_flows=100,
            uptime_ns=5 * NS,
            flows_rate=1.5,
            version="fake-a",
        ),
        peers=peers,
        batches=batches[0],
    )
    b = FakeAgent(
        "node-b",
        b_sock,
        [make_flow(base_ns + (2 * i + 1) * NS, "node-b") for i in range(count)],
        observer_pb2.ServerStatusResponse(
            num_flows=20,
            max_flows=4095,
            seen_flows=200,
            uptime_ns=9 * NS,
            flows_rate=2.0,
            version="fake-b",
        ),
        batches=batches[1],
    )
    return a, b


async def started_relay(config: Config, names: set[str]) -> Relay:
    relay = Relay(config)
    await relay.start()
    assert await relay.peers.wait_for_peers(names, timeout=10), relay.peers.list()
    return relay


def observer_stub(config: Config) -> tuple[grpc.aio.Channel, observer_pb2_grpc.ObserverStub]:
    channel = grpc.aio.insecure_channel(config.listen_address)
    return channel, observer_pb2_grpc.ObserverStub(channel)


def run(
    sockdir: pathlib.Path,
    scenario: Callable[[Relay, Config, FakeAgent, FakeAgent, int], Awaitable[None]],
    batches: tuple[bool, bool] = (False, False),
    **overrides: object,
) -> None:
    async def main() -> None:
        base = time.time_ns() - 60 * NS
        a, b = two_agents(sockdir, base, batches=batches)
        async with agents(a, b):
            config = relay_config(sockdir, a.address, **overrides)
            relay = await started_relay(config, {"node-a", "node-b"})
            try:
                await scenario(relay, config, a, b, base)
            finally:
                await relay.stop(0)

    asyncio.run(main())


async def collect(
    stream: AsyncIterator[observer_pb2.GetFlowsResponse],
) -> list[observer_pb2.GetFlowsResponse]:
    return [response async for response in stream]


def kinds(responses: list[observer_pb2.GetFlowsResponse]) -> list[str]:
    return [str(r.WhichOneof("response_types")) for r in responses]


def test_flows_of_two_agents_are_merged_in_time_order(sockdir: pathlib.Path) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        channel, stub = observer_stub(config)
        async with channel:
            responses = await collect(stub.GetFlows(observer_pb2.GetFlowsRequest(number=5)))
        flows = [r for r in responses if r.HasField("flow")]
        assert len(flows) == 10
        times = [response_time_ns(r) for r in flows]
        assert times == sorted(times)
        assert [r.node_name for r in flows] == ["node-a", "node-b"] * 5

    run(sockdir, scenario)


def test_flows_from_batching_and_plain_agents_merge_the_same(sockdir: pathlib.Path) -> None:
    """node-a serves FlowBatchService (its flows come in one batch and pass the relay
    undecoded), node-b only GetFlows (the relay falls back): the client sees the same
    time-ordered stream; a follow stream gets node-a's new flows too."""

    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        channel, stub = observer_stub(config)
        async with channel:
            request = observer_pb2.GetFlowsRequest(
                number=5, whitelist=[flow_pb2.FlowFilter(source_pod=["default/"])]
            )
            responses = await collect(stub.GetFlows(request))
            flows = [r for r in responses if r.HasField("flow")]
            assert [r.node_name for r in flows] == ["node-a", "node-b"] * 5
            times = [response_time_ns(r) for r in flows]
            assert times == sorted(times)
            assert flows[0] == a.flows[0]  # byte for byte what the agent had
            assert [r.request for r in a.batch_requests] == [request]
            assert a.batch_requests[0].max_batch == 256
            assert a.requests == b.requests == [request]

            follow = stub.GetFlows(observer_pb2.GetFlowsRequest(follow=True))
            await wait_until(lambda: len(a.batch_requests) == 2 and len(b.requests) == 2)
            new = make_flow(time.time_ns(), "node-a")
            await a.push(new)
            seen: list[
                observer_pb2.GetFlowsResponse
            ] = []  # the stored flows come first (follow without number sends them all)
            while len(seen) < 30 and (not seen or seen[-1] != new):
                seen.append(await asyncio.wait_for(follow.read(), 5))
            assert seen[-1] == new
            follow.cancel()

    run(sockdir, scenario, batches=(True, False))


def test_first_events_are_node_connected_then_node_unavailable(sockdir: pathlib.Path) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        channel, stub = observer_stub(config)
        async with channel:
            responses = await collect(stub.GetFlows(observer_pb2.GetFlowsRequest(number=2)))
        assert kinds(responses)[:2] == ["node_status", "node_status"]
        assert set(kinds(responses)[2:]) == {"flow"}
        connected, unavailable = responses[0].node_status, responses[1].node_status
        assert connected.state_change == relay_pb2.NODE_CONNECTED
        assert list(connected.node_names) == ["node-a", "node-b"]
        assert unavailable.state_change == relay_pb2.NODE_UNAVAILABLE
        assert list(unavailable.node_names) == ["node-c"]

    run(sockdir, scenario)


def test_request_filters_and_metadata_are_forwarded_unchanged(sockdir: pathlib.Path) -> None:
    request = observer_pb2.GetFlowsRequest(
        number=3,
        whitelist=[
            flow_pb2.FlowFilter(source_pod=["default/frontend"], verdict=[flow_pb2.DROPPED]),
            flow_pb2.FlowFilter(destination_pod=["default/frontend"], destination_port=["80"]),
        ],
        blacklist=[flow_pb2.FlowFilter(protocol=["udp"])],
    )

    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        channel, stub = observer_stub(config)
        async with channel:
            await collect(stub.GetFlows(request, metadata=(("x-trace", "abc"),)))
        for agent in (a, b):
            assert agent.requests == [request]
            assert agent.metadata[0]["x-trace"] == "abc"

    run(sockdir, scenario)


def test_agent_stopped_mid_stream_does_not_end_the_client_stream(sockdir: pathlib.Path) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        channel, stub = observer_stub(config)
        got: list[observer_pb2.GetFlowsResponse] = []

        async def reader() -> None:
            async for response in stub.GetFlows(
                observer_pb2.GetFlowsRequest(number=2, follow=True)
            ):
                got.append(response)

        async with channel:
            task = asyncio.create_task(reader())
            # both agents' history arrives (flushed after the drain timeout)
            await wait_until(lambda: sum(r.HasField("flow") for r in got) >= 4)
            await b.stop()
            await wait_until(lambda: not b.followers)
            for i in range(3):
                await a.push(
                    make_flow(time.time_ns(), "node-a", src=("default", "late", 5000 + i, 1003))
                )
                await asyncio.sleep(0.05)
            await wait_until(
                lambda: sum(r.flow.source.pod_name == "late" for r in got) == 3, timeout=10
            )
            await wait_until(
                lambda: any(
                    r.node_status.state_change == relay_pb2.NODE_ERROR
                    and "node-b" in r.node_status.node_names
                    for r in got
                ),
                timeout=10,
            )
            assert not task.done(), "the client stream must stay open"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        errors = [r for r in got if r.node_status.state_change == relay_pb2.NODE_ERROR]
        assert errors[0].node_status.message.startswith("rpc error: code = ")
        late = [response_time_ns(r) for r in got if r.flow.source.pod_name == "late"]
        assert late == sorted(late)

    run(sockdir, scenario)


def test_follow_picks_up_an_agent_that_appears_later(sockdir: pathlib.Path) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        d = FakeAgent("node-d", sockdir / "d.sock", [make_flow(time.time_ns(), "node-d")])
        channel, stub = observer_stub(config)
        got: list[observer_pb2.GetFlowsResponse] = []

        async def reader() -> None:
            async for response in stub.GetFlows(
                observer_pb2.GetFlowsRequest(number=1, follow=True)
            ):
                got.append(response)

        async with channel, agents(d):
            task = asyncio.create_task(reader())
            await wait_until(lambda: sum(r.HasField("flow") for r in got) >= 2)
            await a.announce("node-d", d.address)
            await wait_until(lambda: any(r.flow.node_name == "node-d" for r in got), timeout=10)
            # the event is stamped when the stream starts, so it may follow D's older flow
            await wait_until(
                lambda: any(
                    r.node_status.state_change == relay_pb2.NODE_CONNECTED
                    and list(r.node_status.node_names) == ["node-d"]
                    for r in got
                ),
                timeout=10,
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(sockdir, scenario)


def test_server_status_sums_counters_over_connected_agents(sockdir: pathlib.Path) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        channel, stub = observer_stub(config)
        async with channel:
            status = await stub.ServerStatus(observer_pb2.ServerStatusRequest())
        assert status.num_flows == 30
        assert status.max_flows == 8190
        assert status.seen_flows == 300
        assert status.flows_rate == pytest.approx(3.5)
        assert status.uptime_ns == 9 * NS
        assert status.num_connected_nodes.value == 2
        assert status.num_unavailable_nodes.value == 1
        assert list(status.unavailable_nodes) == ["node-c"]
        assert status.version.startswith("cilia-relay")

    run(sockdir, scenario)


def test_get_nodes_reports_connected_unavailable_and_error_states(sockdir: pathlib.Path) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        e = FakeAgent("node-e", sockdir / "e.sock", fail_status=True)
        async with agents(e):
            await a.announce("node-e", e.address)
            assert await relay.peers.wait_for_peers({"node-e"}, timeout=10)
            channel, stub = observer_stub(config)
            async with channel:
                nodes = {
                    n.name: n for n in (await stub.GetNodes(observer_pb2.GetNodesRequest())).nodes
                }
        assert sorted(nodes) == ["node-a", "node-b", "node-c", "node-e"]
        assert nodes["node-a"].state == relay_pb2.NODE_CONNECTED
        assert nodes["node-a"].version == "fake-a"
        assert nodes["node-a"].num_flows == 10
        assert nodes["node-a"].uptime_ns == 5 * NS
        assert nodes["node-a"].address == a.address
        assert nodes["node-b"].state == relay_pb2.NODE_CONNECTED
        assert nodes["node-c"].state == relay_pb2.NODE_UNAVAILABLE
        assert nodes["node-e"].state == relay_pb2.NODE_ERROR

    run(sockdir, scenario)


def test_deleted_peer_is_no_longer_listed(sockdir: pathlib.Path) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        await a.announce("node-c", "", kind=peer_pb2.PEER_DELETED)
        await wait_until(lambda: [p.name for p in relay.peers.list()] == ["node-a", "node-b"])
        channel, stub = observer_stub(config)
        async with channel:
            status = await stub.ServerStatus(observer_pb2.ServerStatusRequest())
        assert status.num_unavailable_nodes.value == 0

    run(sockdir, scenario)


def test_health_is_serving_only_while_the_peer_stream_is_established(sockdir: pathlib.Path) -> None:
    async def health(address: str) -> int:
        async with grpc.aio.insecure_channel(address) as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
            return int(response.status)

    async def main() -> None:
        peer = FakeAgent("node-a", sockdir / "a.sock", peers={})
        config = relay_config(sockdir, peer.address)
        relay = Relay(config)
        await relay.start()
        try:
            assert (
                await health(config.health_listen_address)
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
            async with agents(peer):
                await wait_until(lambda: relay.peers.peer_service_connected, timeout=10)
                for address in (config.health_listen_address, config.listen_address):
                    assert await health(address) == health_pb2.HealthCheckResponse.SERVING
            await wait_until(lambda: not relay.peers.peer_service_connected, timeout=10)
            assert (
                await health(config.health_listen_address)
                == health_pb2.HealthCheckResponse.NOT_SERVING
            )
        finally:
            await relay.stop(0)

    asyncio.run(main())


def test_get_namespaces_merges_connected_agents_sorted_and_skips_a_failing_one(
    sockdir: pathlib.Path,
) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        a.namespaces = [("", "kube-system"), ("", "default")]
        b.namespaces = [("", "default"), ("", "apps")]
        e = FakeAgent("node-e", sockdir / "e.sock", fail_status=True, namespaces=[("", "zz")])
        async with agents(e):
            await a.announce("node-e", e.address)
            assert await relay.peers.wait_for_peers({"node-e"}, timeout=10)
            channel, stub = observer_stub(config)
            async with channel:
                answer = await stub.GetNamespaces(observer_pb2.GetNamespacesRequest())
        assert [(n.cluster, n.namespace) for n in answer.namespaces] == [
            ("", "apps"),
            ("", "default"),
            ("", "kube-system"),
        ]

    run(sockdir, scenario)


def test_agent_and_debug_events_are_unimplemented_on_the_relay_as_upstream(
    sockdir: pathlib.Path,
) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        channel, stub = observer_stub(config)
        async with channel:
            for call, request in (
                (stub.GetAgentEvents, observer_pb2.GetAgentEventsRequest(number=5)),
                (stub.GetDebugEvents, observer_pb2.GetDebugEventsRequest(number=5)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await collect(call(request))
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert "not yet implemented" in (err.value.details() or "")

    run(sockdir, scenario)


def test_hubble_status_health_name_is_serving_on_the_observer_listener(
    sockdir: pathlib.Path,
) -> None:
    """``hubble status`` checks ``hubble.server.Observer`` on the address it talks to."""

    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        for address in (config.listen_address, config.health_listen_address):
            async with grpc.aio.insecure_channel(address) as channel:
                response = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="hubble.server.Observer"), timeout=2
                )
            assert response.status == health_pb2.HealthCheckResponse.SERVING, address

    run(sockdir, scenario)


def test_peer_flow_batch_size_zero_reads_agents_through_getflows_only(
    sockdir: pathlib.Path,
) -> None:
    async def scenario(relay: Relay, config: Config, a: FakeAgent, b: FakeAgent, base: int) -> None:
        channel, stub = observer_stub(config)
        async with channel:
            responses = await collect(stub.GetFlows(observer_pb2.GetFlowsRequest(number=2)))
        assert [r.node_name for r in responses if r.HasField("flow")] == ["node-a", "node-b"] * 2
        assert a.batch_requests == b.batch_requests == []
        assert len(a.requests) == len(b.requests) == 1

    run(sockdir, scenario, batches=(True, True), peer_flow_batch_size=0)
