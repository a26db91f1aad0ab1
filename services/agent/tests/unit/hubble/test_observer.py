"""observer.Observer served in-process on a unix socket: GetFlows, ServerStatus, GetNodes,
GetAgentEvents, GetDebugEvents, GetNamespaces and the health name ``hubble status`` checks."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format, timestamp_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia.hubble.relay import relay_pb2
from cilia_agent.hubble.eventlog import NAMESPACE_TTL_NS, NamespaceTracker
from cilia_agent.hubble.flowstore import FlowStore
from cilia_agent.hubble.service import Hubble, HubbleConfig

from . import helpers as h

SECOND = 1_000_000_000


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hb-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


Scenario = Callable[[Hubble, observer_pb2_grpc.ObserverStub], Awaitable[Any]]


def serve(sock_dir: Path, scenario: Scenario, capacity: int = 15) -> Any:
    """Run ``scenario`` against a real Hubble gRPC server on a unix socket."""

    async def main() -> Any:
        hubble = Hubble(
            HubbleConfig(
                node_name=h.NODE,
                capacity=capacity,
                advertise_address="10.0.0.1:4244",
                version="v-test",
            ),
            resolver=h.resolver(),
            registry=CollectorRegistry(),
            clock=h.parser().clock,
        )
        address = f"unix:{sock_dir}/hubble.sock"
        server, _ = await hubble.serve([address])
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                return await scenario(hubble, observer_pb2_grpc.ObserverStub(channel))
        finally:
            await server.stop(None)

    return asyncio.run(main())


def add(hubble: Hubble, n: int, start_s: int = 1, **overrides: Any) -> None:
    """n flows, one per second from ``start_s``, source ports 1, 2, 3 … (flow k has sport k)."""
    for k in range(n):
        ev = h.event(ts_ns=(start_s + k) * SECOND, sport=start_s + k, **overrides)
        hubble.store.add_flow(hubble.parser.parse(ev))


def sports(responses: list[observer_pb2.GetFlowsResponse]) -> list[int]:
    return [r.flow.l4.TCP.source_port for r in responses if r.HasField("flow")]


async def collect(stub: observer_pb2_grpc.ObserverStub, **req: Any) -> list[Any]:
    request = json_format.ParseDict(req, observer_pb2.GetFlowsRequest())
    return [r async for r in stub.GetFlows(request)]


def wall(second: int) -> str:
    ts = timestamp_pb2.Timestamp(seconds=h.BOOT_OFFSET_NS // SECOND + second)
    return ts.ToJsonString()


def test_number_returns_the_last_n_flows_oldest_first_with_node_and_time(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 10)
        out = await collect(stub, number=3)
        assert sports(out) == [8, 9, 10]
        assert all(r.node_name == h.NODE for r in out)
        assert out[0].time == out[0].flow.time
        assert out[0].flow.source.pod_name == "frontend-7d9f"

    serve(sock_dir, scenario)


def test_first_returns_the_oldest_n_flows(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 20)  # capacity 15: flows 6..20 remain
        assert sports(await collect(stub, number=3, first=True)) == [6, 7, 8]
        assert len(sports(await collect(stub, first=True))) == 15

    serve(sock_dir, scenario)


def test_number_zero_without_follow_returns_the_whole_ring(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 5)
        assert sports(await collect(stub)) == [1, 2, 3, 4, 5]

    serve(sock_dir, scenario)


def test_number_counts_only_flows_passing_the_filters(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 6)
        hubble.store.add_flow(hubble.parser.parse(h.dropped(ts_ns=7 * SECOND, sport=7)))
        add(hubble, 3, start_s=8)
        hubble.store.add_flow(hubble.parser.parse(h.dropped(ts_ns=11 * SECOND, sport=11)))
        dropped = await collect(stub, number=5, whitelist=[{"verdict": ["DROPPED"]}])
        assert sports(dropped) == [7, 11]
        forwarded = await collect(stub, number=2, blacklist=[{"verdict": ["DROPPED"]}])
        assert sports(forwarded) == [9, 10]

    serve(sock_dir, scenario)


def test_since_and_until_bound_the_time_range(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 10)
        assert sports(await collect(stub, since=wall(4), until=wall(6))) == [4, 5, 6]
        assert sports(await collect(stub, since=wall(9))) == [9, 10]
        assert sports(await collect(stub, until=wall(2))) == [1, 2]

    serve(sock_dir, scenario)


def test_follow_sends_new_flows_as_they_arrive(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 5)
        call = stub.GetFlows(observer_pb2.GetFlowsRequest(number=2, follow=True))
        got = [await call.read(), await call.read()]
        add(hubble, 2, start_s=6)
        got += [await asyncio.wait_for(call.read(), 2), await asyncio.wait_for(call.read(), 2)]
        call.cancel()
        assert sports(got) == [4, 5, 6, 7]

        only_new = stub.GetFlows(observer_pb2.GetFlowsRequest(follow=True))
        await asyncio.sleep(0.1)  # the server has started the follower
        add(hubble, 1, start_s=8)
        first = await asyncio.wait_for(only_new.read(), 2)
        only_new.cancel()
        assert sports([first]) == [8]

    serve(sock_dir, scenario)


def test_follow_with_until_ends_at_the_first_later_flow(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 3)
        call = stub.GetFlows(
            json_format.ParseDict(
                {"follow": True, "since": wall(2), "until": wall(4)}, observer_pb2.GetFlowsRequest()
            )
        )
        got = [await call.read(), await call.read()]
        add(hubble, 3, start_s=4)
        got.append(await asyncio.wait_for(call.read(), 2))
        assert await asyncio.wait_for(call.read(), 2) is grpc.aio.EOF
        assert sports(got) == [2, 3, 4]

    serve(sock_dir, scenario)


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"first": True, "follow": True}, "first cannot be specified with follow"),
        ({"number": 3, "since": "2024-01-01T00:00:00Z"}, "number is incompatible"),
        ({"number": 3, "until": "2024-01-01T00:00:00Z"}, "number is incompatible"),
        ({"whitelist": [{"protocol": ["gopher"]}]}, "unknown protocol"),
        ({"blacklist": [{"source_ip": ["nope"]}]}, "invalid IP"),
    ],
)
def test_invalid_requests_are_refused_with_invalid_argument(
    sock_dir: Path, request_fields: dict[str, Any], message: str
) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 2)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, **request_fields)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (err.value.details() or "")

    serve(sock_dir, scenario)


def test_unsupported_upstream_filter_field_is_invalid_argument(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        flt = flow_pb2.FlowFilter()
        flt.MergeFromString(bytes([0xEA, 0x01, 1]) + b"x")  # upstream uuid = 29 (tag varint)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [r async for r in stub.GetFlows(observer_pb2.GetFlowsRequest(whitelist=[flt]))]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "29 (uuid)" in (err.value.details() or "")

    serve(sock_dir, scenario)


def test_server_status_and_get_nodes_report_this_node(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 20)
        status = await stub.ServerStatus(observer_pb2.ServerStatusRequest())
        assert (status.num_flows, status.max_flows, status.seen_flows) == (15, 15, 20)
        assert status.uptime_ns > 0 and status.version == "v-test"
        nodes = (await stub.GetNodes(observer_pb2.GetNodesRequest())).nodes
        assert len(nodes) == 1
        node = nodes[0]
        assert (node.name, node.address, node.state) == (
            h.NODE,
            "10.0.0.1:4244",
            relay_pb2.NODE_CONNECTED,
        )
        assert (node.num_flows, node.max_flows, node.seen_flows) == (15, 15, 20)
        assert node.tls.enabled is False

    serve(sock_dir, scenario)


def test_flows_rate_counts_flows_of_the_last_minute() -> None:
    now = 1_000 * SECOND
    store = FlowStore(63, node_name="n", wall_clock_ns=lambda: now)
    old = h.flow()
    old.time.FromNanoseconds(now - 61 * SECOND)
    store.add_flow(old)
    for k in reversed(range(30)):
        f = h.flow()
        f.time.FromNanoseconds(now - 2 * k * SECOND)  # 58 s, 56 s, … 0 s ago
        store.add_flow(f)
    assert store.flows_rate() == pytest.approx(30 / 60)


def test_flows_rate_of_a_wrapped_ring_uses_the_span_it_holds() -> None:
    now = 1_000 * SECOND
    store = FlowStore(7, node_name="n", wall_clock_ns=lambda: now)
    for k in reversed(range(20)):  # one flow per second, the ring keeps the last 7 (6 s … 0 s)
        f = h.flow()
        f.time.FromNanoseconds(now - k * SECOND)
        store.add_flow(f)
    assert store.flows_rate() == pytest.approx(7 / 6)


async def _drain(stream: AsyncIterator[observer_pb2.GetFlowsResponse]) -> list[Any]:
    return [r async for r in stream]


def test_slow_follower_gets_a_hubble_ring_buffer_lost_event() -> None:
    async def scenario() -> list[observer_pb2.GetFlowsResponse]:
        store = FlowStore(7, node_name="n")
        stream = store.get_flows(observer_pb2.GetFlowsRequest(follow=True, number=1))
        store.add_flow(h.flow(sport=1))
        first = await stream.__anext__()
        for k in range(2, 22):  # 20 more flows into a ring of 7 while the reader sleeps
            store.add_flow(h.flow(sport=k))
        lost = await stream.__anext__()
        after = await stream.__anext__()
        await stream.aclose()  # type: ignore[attr-defined]
        return [first, lost, after]

    first, lost, after = h.run(scenario())
    assert first.flow.l4.TCP.source_port == 1
    assert lost.lost_events.source == flow_pb2.HUBBLE_RING_BUFFER
    assert lost.lost_events.num_events_lost == 13
    assert after.flow.l4.TCP.source_port == 15


def test_overtaken_follower_gets_the_losses_inside_the_missed_entries_by_source() -> None:
    async def scenario() -> list[observer_pb2.GetFlowsResponse]:
        store = FlowStore(7, node_name="n")
        store.add_lost(flow_pb2.OBSERVER_EVENTS_QUEUE, 5)  # before the follower: not its loss
        stream = store.get_flows(observer_pb2.GetFlowsRequest(follow=True, number=1))
        store.add_flow(h.flow(sport=1))
        first = await stream.__anext__()
        for k in range(2, 8):
            store.add_flow(h.flow(sport=k))
        store.add_lost(flow_pb2.PERF_EVENT_RING_BUFFER, 100)
        store.add_lost(flow_pb2.OBSERVER_EVENTS_QUEUE, 40)
        store.add_lost(flow_pb2.PERF_EVENT_RING_BUFFER, 7)
        for k in range(8, 18):  # the ring of 7 now holds flows 11..17 only
            store.add_flow(h.flow(sport=k))
        out = [first]
        while not out[-1].HasField("flow") or out[-1].flow.l4.TCP.source_port < 11:
            out.append(await stream.__anext__())
        await stream.aclose()  # type: ignore[attr-defined]
        return out

    first, *lost, after = h.run(scenario())
    assert first.flow.l4.TCP.source_port == 1
    assert sorted((r.lost_events.source, r.lost_events.num_events_lost) for r in lost) == [
        (flow_pb2.PERF_EVENT_RING_BUFFER, 107),
        (flow_pb2.OBSERVER_EVENTS_QUEUE, 40),
        (flow_pb2.HUBBLE_RING_BUFFER, 9),  # flows 2..10; the 3 lost entries are not flows
    ]
    assert after.flow.l4.TCP.source_port == 11


def test_lost_events_stored_in_the_ring_bypass_filters(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 2)
        hubble.store.add_lost(flow_pb2.OBSERVER_EVENTS_QUEUE, 42)
        add(hubble, 1, start_s=3)
        out = await collect(stub, whitelist=[{"verdict": ["DROPPED"]}])
        assert len(out) == 1
        assert out[0].lost_events.source == flow_pb2.OBSERVER_EVENTS_QUEUE
        assert out[0].lost_events.num_events_lost == 42

    serve(sock_dir, scenario)


# -- GetAgentEvents, GetDebugEvents, GetNamespaces, health (what `hubble` CLI commands call) --


async def agent_events(stub: observer_pb2_grpc.ObserverStub, **req: Any) -> list[Any]:
    request = json_format.ParseDict(req, observer_pb2.GetAgentEventsRequest())
    return [r async for r in stub.GetAgentEvents(request)]


def test_agent_events_start_with_agent_started_stamped_with_node_and_time(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        out = await agent_events(stub, number=10)
        assert len(out) == 1
        event = out[0]
        assert event.agent_event.type == flow_pb2.AGENT_STARTED
        assert event.node_name == h.NODE
        assert event.agent_event.agent_start.time == event.time
        assert abs(event.time.ToNanoseconds() - time.time_ns()) < 60 * SECOND

    serve(sock_dir, scenario)


def test_agent_events_number_first_since_until_and_follow(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        base = time.time_ns() + 10 * SECOND
        for k in range(1, 4):  # three later events, one second apart
            unknown = flow_pb2.AgentEventUnknown(type=f"t{k}")
            hubble.agent_events.add(
                flow_pb2.AgentEvent(type=flow_pb2.AGENT_EVENT_UNKNOWN, unknown=unknown),
                base + k * SECOND,
            )

        def names(out: list[Any]) -> list[str]:
            return [r.agent_event.unknown.type or "started" for r in out]

        assert names(await agent_events(stub, number=2)) == ["t2", "t3"]
        assert names(await agent_events(stub, number=2, first=True)) == ["started", "t1"]
        since = timestamp_pb2.Timestamp()
        since.FromNanoseconds(base + 2 * SECOND)
        until = timestamp_pb2.Timestamp()
        until.FromNanoseconds(base + 2 * SECOND)
        assert names(
            await agent_events(stub, since=since.ToJsonString(), until=until.ToJsonString())
        ) == ["t2"]

        request = observer_pb2.GetAgentEventsRequest(follow=True)
        call = stub.GetAgentEvents(request)
        follower = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.2)
        assert not follower.done(), "follow without number sends only new events"
        hubble.agent_events.add(
            flow_pb2.AgentEvent(unknown=flow_pb2.AgentEventUnknown(type="new")), time.time_ns()
        )
        got = await asyncio.wait_for(follower, 5)
        assert got.agent_event.unknown.type == "new"
        call.cancel()

    serve(sock_dir, scenario)


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({"first": True, "follow": True}, "first cannot be specified with follow"),
        ({"number": 3, "since": "2024-01-01T00:00:00Z"}, "incompatible with since/until"),
    ],
)
def test_bad_agent_and_debug_event_windows_are_invalid_argument(
    sock_dir: Path, request_fields: dict[str, Any], message: str
) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        for call, kind in (
            (stub.GetAgentEvents, observer_pb2.GetAgentEventsRequest),
            (stub.GetDebugEvents, observer_pb2.GetDebugEventsRequest),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [r async for r in call(json_format.ParseDict(request_fields, kind()))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (err.value.details() or "")

    serve(sock_dir, scenario)


def test_debug_events_are_an_empty_stream_as_an_agent_without_datapath_debug(
    sock_dir: Path,
) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        add(hubble, 5)
        request = observer_pb2.GetDebugEventsRequest(number=10)
        assert [r async for r in stub.GetDebugEvents(request)] == []
        event = flow_pb2.DebugEvent(type=flow_pb2.DBG_GENERIC, message="x")
        hubble.debug_events.add(event, time.time_ns())
        out = [r async for r in stub.GetDebugEvents(request)]
        assert [(r.debug_event.message, r.node_name) for r in out] == [("x", h.NODE)]

    serve(sock_dir, scenario)


def test_get_namespaces_lists_namespaces_of_recent_flows_sorted(sock_dir: Path) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        empty = await stub.GetNamespaces(observer_pb2.GetNamespacesRequest())
        assert list(empty.namespaces) == []
        add(hubble, 2)  # frontend -> backend, both in "demo"
        add(hubble, 1, start_s=5, daddr=h.REMOTE_IP, dst_identity=h.REMOTE_ID)  # -> prod/db-0
        answer = await stub.GetNamespaces(observer_pb2.GetNamespacesRequest())
        assert [(n.cluster, n.namespace) for n in answer.namespaces] == [("", "demo"), ("", "prod")]

    serve(sock_dir, scenario)


def test_namespaces_expire_an_hour_after_their_last_flow() -> None:
    now = [1_000 * SECOND]
    tracker = NamespaceTracker(wall_clock_ns=lambda: now[0])
    tracker.observe(h.flow())
    assert [n.namespace for n in tracker.namespaces()] == ["demo"]
    now[0] += NAMESPACE_TTL_NS - 1
    assert [n.namespace for n in tracker.namespaces()] == ["demo"]
    now[0] += 2
    assert tracker.namespaces() == []


def test_health_reports_hubble_server_observer_serving_as_hubble_status_checks(
    sock_dir: Path,
) -> None:
    async def scenario(hubble: Hubble, stub: observer_pb2_grpc.ObserverStub) -> None:
        async with grpc.aio.insecure_channel(f"unix:{sock_dir}/hubble.sock") as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="hubble.server.Observer"), timeout=2
            )
        assert response.status == health_pb2.HealthCheckResponse.SERVING

    serve(sock_dir, scenario)
