"""The Service watcher against a real gRPC ServiceService (in-process, port 0) over the
agent's own operator client, writing real pinned maps (created, not attached).

The server is a small stand-in written here (the operator side is built elsewhere): each
WatchServices stream gets the current Services as UPSERTs, ``synced``, then the events the
test publishes; :meth:`ServiceServer.cut` ends every open stream (the agent reconnects).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
from prometheus_client import CollectorRegistry

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc
from cilia_agent.controlplane import OperatorAPI, run_watch
from cilia_agent.loadbalancer.layout import BE_STATE_ACTIVE, BE_STATE_TERMINATING
from cilia_agent.loadbalancer.maps import ServiceMapWriter, frontend_key
from cilia_agent.loadbalancer.model import Frontend
from cilia_agent.loadbalancer.watcher import ServiceMetrics, ServiceWatcher

TCP, UDP = 6, 17
_END = object()


def svc(name: str, vip: str, backends: dict[str, str]) -> cp.Service:
    """TCP 80 -> :8080 and UDP 53 -> :5353; ``backends`` maps ip -> "ready"|"terminating"."""

    def port(proto: str, number: int, target: int) -> cp.ServicePort:
        return cp.ServicePort(
            protocol=proto,
            port=number,
            backends=[
                cp.ServiceBackend(
                    ip=ip, port=target, ready=s == "ready", terminating=s == "terminating"
                )
                for ip, s in backends.items()
            ],
        )

    return cp.Service(
        namespace="w",
        name=name,
        type="ClusterIP",
        cluster_ips=[vip],
        ports=[port("TCP", 80, 8080), port("UDP", 53, 5353)],
    )


class ServiceServer(cp_grpc.ServiceServiceServicer):  # type: ignore[misc]
    """An in-process ServiceService (see the module docstring)."""

    def __init__(self) -> None:
        self.services: dict[str, cp.Service] = {}
        self.streams: list[asyncio.Queue[object]] = []
        self.opened = 0

    async def WatchServices(  # noqa: N802 (gRPC method name)
        self, request: cp.WatchServicesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cp.WatchServicesResponse]:
        self.opened += 1
        queue: asyncio.Queue[object] = asyncio.Queue()
        self.streams.append(queue)
        try:
            listing = [
                cp.ServiceEvent(type=cp.EVENT_TYPE_UPSERT, service=s)
                for s in self.services.values()
            ]
            yield cp.WatchServicesResponse(events=listing)
            yield cp.WatchServicesResponse(synced=True)
            while (item := await queue.get()) is not _END:
                assert isinstance(item, cp.ServiceEvent)
                yield cp.WatchServicesResponse(events=[item])
        finally:
            self.streams.remove(queue)

    def upsert(self, service: cp.Service) -> None:
        self.services[service.name] = service
        for q in self.streams:
            q.put_nowait(cp.ServiceEvent(type=cp.EVENT_TYPE_UPSERT, service=service))

    def delete(self, name: str) -> None:
        self.services.pop(name)
        gone = cp.Service(namespace="w", name=name)
        for q in self.streams:
            q.put_nowait(cp.ServiceEvent(type=cp.EVENT_TYPE_DELETE, service=gone))

    def cut(self) -> None:
        for q in self.streams:
            q.put_nowait(_END)


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``check()`` holds (polled every 10 ms)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def programmed(writer: ServiceMapWriter, vip: str, port: int = 80, proto: int = TCP) -> bool:
    """True when the pinned services map has the master entry of ``vip:port``."""
    return writer.maps.services.lookup(frontend_key(Frontend(vip, port, proto))) is not None


def backend_states(writer: ServiceMapWriter) -> dict[tuple[str, int], int]:
    """``(ip, port) -> BE_STATE_*`` read back from the pinned backends map."""
    from cilia_agent.loadbalancer.maps import backend_of

    return {
        (backend_of(v).address, backend_of(v).port): v.flags
        for _, v in writer.maps.backends.items()
    }


def test_watcher_applies_the_stream_and_resyncs_after_a_reconnect(
    writer: ServiceMapWriter,
) -> None:
    async def scenario() -> None:
        server = grpc.aio.server()
        op = ServiceServer()
        cp_grpc.add_ServiceServiceServicer_to_server(op, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        op.services["a"] = svc("a", "198.18.78.1", {"10.252.79.1": "ready", "10.252.79.2": "ready"})
        op.services["b"] = svc("b", "198.18.78.2", {"10.252.79.3": "ready"})
        api = OperatorAPI(
            address=f"127.0.0.1:{port}",
            node_name="n1",
            timeout=5,
            min_backoff=0.05,
            max_backoff=0.1,
        )
        registry = CollectorRegistry()
        watcher = ServiceWatcher(writer, ServiceMetrics(registry))
        task = asyncio.create_task(
            run_watch(
                "services", api.watch_services, watcher.consume, min_backoff=0.05, max_backoff=0.1
            )
        )
        try:
            await until(lambda: watcher.synced)
            assert programmed(writer, "198.18.78.1") and programmed(writer, "198.18.78.2", 53, UDP)
            assert len(writer.frontends) == 4

            op.delete("b")
            await until(lambda: not programmed(writer, "198.18.78.2"))
            assert not programmed(writer, "198.18.78.2", 53, UDP)
            assert ("10.252.79.3", 8080) not in backend_states(writer)

            op.upsert(
                svc("a", "198.18.78.1", {"10.252.79.1": "ready", "10.252.79.2": "terminating"})
            )
            await until(
                lambda: backend_states(writer).get(("10.252.79.2", 8080)) == BE_STATE_TERMINATING
            )
            master = writer.maps.services.lookup(frontend_key(Frontend("198.18.78.1", 80, TCP)))
            assert master is not None and master.count == 1
            assert backend_states(writer)[("10.252.79.1", 8080)] == BE_STATE_ACTIVE

            # while the agent is disconnected: a deleted, a new Service
            op.services.pop("a")
            op.services["c"] = svc("c", "198.18.78.3", {"10.252.79.4": "ready"})
            op.cut()
            await until(lambda: op.opened == 2 and programmed(writer, "198.18.78.3"))
            await until(lambda: not programmed(writer, "198.18.78.1"))
            assert {f.address for f in writer.frontends} == {"198.18.78.3"}
            assert set(backend_states(writer)) == {("10.252.79.4", 8080), ("10.252.79.4", 5353)}

            events = {
                s.labels["action"]: s.value
                for m in registry.collect()
                if m.name == "cilium_services_events"
                for s in m.samples
                if s.name.endswith("_total")
            }
            assert events == {"add": 3.0, "update": 1.0, "delete": 1.0}, events
            assert registry.get_sample_value("cilia_lb_frontends") == 2.0
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await api.close()
            await server.stop(None)

    asyncio.run(scenario())


def test_a_service_that_does_not_fit_is_counted_and_the_stream_goes_on(
    writer: ServiceMapWriter,
) -> None:
    small = ServiceMapWriter(writer.maps, capacity=4)  # four backend ids at most
    registry = CollectorRegistry()
    watcher = ServiceWatcher(small, ServiceMetrics(registry))

    async def stream() -> AsyncIterator[cp.WatchServicesResponse]:
        big = svc("big", "198.18.78.10", {f"10.252.79.{i}": "ready" for i in range(1, 6)})
        fits = svc("fits", "198.18.78.11", {})
        yield cp.WatchServicesResponse(
            events=[
                cp.ServiceEvent(type=cp.EVENT_TYPE_UPSERT, service=big),
                cp.ServiceEvent(type=cp.EVENT_TYPE_UPSERT, service=fits),
            ],
            synced=True,
        )

    assert asyncio.run(watcher.consume(stream())) is True
    assert registry.get_sample_value("cilia_lb_service_errors_total") == 1.0
    assert programmed(small, "198.18.78.11")
    assert watcher.synced
    assert small.backends == {}  # the ids the failed Service took are free again
