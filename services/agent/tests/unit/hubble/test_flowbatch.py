"""The Cilia-private ``FlowBatchService.GetFlowBatches``: the GetFlows stream in batches."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from prometheus_client import CollectorRegistry

from cilia.flowbatch.v1 import flowbatch_pb2, flowbatch_pb2_grpc
from cilia.hubble.flow import flow_pb2
from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia_agent.hubble.flowstore import flow_response_wire, node_name_wire
from cilia_agent.hubble.service import Hubble, HubbleConfig

from . import helpers as h
from .test_observer import SECOND, add, collect, sock_dir  # noqa: F401 - fixture

Stubs = tuple[observer_pb2_grpc.ObserverStub, flowbatch_pb2_grpc.FlowBatchServiceStub]


def serve(sock_dir: Path, scenario: Callable[[Hubble, Stubs], Awaitable[Any]]) -> Any:  # noqa: F811
    """Run ``scenario`` against a real Hubble gRPC server (capacity 15) on a unix socket."""

    async def main() -> Any:
        hubble = Hubble(
            HubbleConfig(node_name=h.NODE, capacity=15, version="v-test"),
            resolver=h.resolver(),
            registry=CollectorRegistry(),
            clock=h.parser().clock,
        )
        address = f"unix:{sock_dir}/hubble.sock"
        server, _ = await hubble.serve([address])
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stubs = (
                    observer_pb2_grpc.ObserverStub(channel),  # type: ignore[no-untyped-call]
                    flowbatch_pb2_grpc.FlowBatchServiceStub(channel),  # type: ignore[no-untyped-call]
                )
                return await scenario(hubble, stubs)
        finally:
            await server.stop(None)

    return asyncio.run(main())


def decode(batches: list[flowbatch_pb2.GetFlowBatchesResponse]) -> list[Any]:
    return [observer_pb2.GetFlowsResponse.FromString(raw) for b in batches for raw in b.responses]


def test_flow_response_wire_is_the_serialized_response() -> None:
    flow = h.parser().parse(h.event(ts_ns=5 * SECOND, sport=77))
    want = observer_pb2.GetFlowsResponse(flow=flow, node_name="node-ä", time=flow.time)
    got = flow_response_wire(flow, node_name_wire("node-ä"))
    assert observer_pb2.GetFlowsResponse.FromString(got) == want
    assert got == want.SerializeToString(deterministic=True)
    assert observer_pb2.GetFlowsResponse.FromString(
        flow_response_wire(flow_pb2.Flow(uuid="x"), b"")
    ) == observer_pb2.GetFlowsResponse(flow=flow_pb2.Flow(uuid="x"))


def test_batches_carry_the_getflows_stream_with_times_and_kinds(sock_dir: Path) -> None:  # noqa: F811
    async def scenario(hubble: Hubble, stubs: Stubs) -> None:
        stub, batch_stub = stubs
        add(hubble, 3)
        hubble.store.add_lost(flow_pb2.OBSERVER_EVENTS_QUEUE, 4)
        add(hubble, 6, start_s=4)
        plain = await collect(stub, number=0, whitelist=[{"source_port": ["2", "3", "5", "9"]}])
        req = flowbatch_pb2.GetFlowBatchesRequest(
            request=json_format.ParseDict(
                {"whitelist": [{"source_port": ["2", "3", "5", "9"]}]},
                observer_pb2.GetFlowsRequest(),
            ),
            max_batch=2,
        )
        batches = [b async for b in batch_stub.GetFlowBatches(req)]
        assert [len(b.responses) for b in batches] == [2, 2, 1]  # max_batch, then the rest
        assert decode(batches) == plain  # same responses, same order (lost event included)
        times = [t for b in batches for t in b.times_ns]
        assert times == [r.time.seconds * SECOND + r.time.nanos for r in plain]
        kinds = [k for b in batches for k in b.flows]
        assert kinds == [r.HasField("flow") for r in plain] == [True, True, False, True, True]

    serve(sock_dir, scenario)


def test_follow_batches_what_is_ready_and_refuses_bad_requests(sock_dir: Path) -> None:  # noqa: F811
    async def scenario(hubble: Hubble, stubs: Stubs) -> None:
        batches = stubs[1]
        call = batches.GetFlowBatches(
            flowbatch_pb2.GetFlowBatchesRequest(request=observer_pb2.GetFlowsRequest(follow=True))
        )
        await asyncio.sleep(0.1)  # the server has started the follower
        add(hubble, 5)  # written in one go: one batch
        first = await asyncio.wait_for(call.read(), 2)
        assert [r.flow.l4.TCP.source_port for r in decode([first])] == [1, 2, 3, 4, 5]
        add(hubble, 1, start_s=6)
        second = await asyncio.wait_for(call.read(), 2)
        assert [r.flow.l4.TCP.source_port for r in decode([second])] == [6]
        call.cancel()

        bad = flowbatch_pb2.GetFlowBatchesRequest(
            request=observer_pb2.GetFlowsRequest(first=True, follow=True)
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [b async for b in batches.GetFlowBatches(bad)]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    serve(sock_dir, scenario)


def test_event_queue_default_is_1024_per_cpu_capped_at_16384() -> None:
    from cilia_agent.hubble.service import default_event_queue_size

    assert default_event_queue_size(1) == 1024
    assert default_event_queue_size(2) == 2048
    assert default_event_queue_size(64) == 16384
