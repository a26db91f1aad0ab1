"""The whole agent: Services from the operator's stream reach the maps and are served; they
keep being served while the agent is down and across its restart; nothing stays attached
once its pins are gone.

The operator is a stand-in serving only ``ServiceService`` (sync gRPC, port 0): the agent's
other streams and its session get UNIMPLEMENTED and retry, which the load balancer does not
depend on.
"""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc
from cilia_agent.loadbalancer import socklb

from ..conftest import Env
from .conftest import BACKENDS, TCP_PORT, Topology, link_exists, link_ids

VIP = "198.18.77.40"


class Services(cp_grpc.ServiceServiceServicer):  # type: ignore[misc]
    """WatchServices: the listing, ``synced``, then what :meth:`publish` sends."""

    def __init__(self, listing: list[cp.Service]) -> None:
        self.listing = listing
        self.queues: list[queue.Queue[cp.ServiceEvent]] = []

    def WatchServices(  # noqa: N802 (gRPC method name)
        self, request: cp.WatchServicesRequest, context: Any
    ) -> Iterator[cp.WatchServicesResponse]:
        q: queue.Queue[cp.ServiceEvent] = queue.Queue()
        self.queues.append(q)
        yield cp.WatchServicesResponse(
            events=[cp.ServiceEvent(type=cp.EVENT_TYPE_UPSERT, service=s) for s in self.listing],
            synced=True,
        )
        while context.is_active():
            try:
                yield cp.WatchServicesResponse(events=[q.get(timeout=0.1)])
            except queue.Empty:
                continue

    def publish(self, event: cp.ServiceEvent) -> None:
        for q in self.queues:
            q.put(event)


def web(ready: tuple[str, ...]) -> cp.Service:
    return cp.Service(
        namespace="e",
        name="web",
        type="ClusterIP",
        cluster_ips=[VIP],
        ports=[
            cp.ServicePort(
                protocol="TCP",
                port=80,
                backends=[cp.ServiceBackend(ip=ip, port=TCP_PORT, ready=True) for ip in ready],
            )
        ],
    )


def reach(timeout: float = 10.0) -> str:
    """The greeting of the backend ``VIP:80`` leads to, retried until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((VIP, 80), timeout=2) as conn:
                assert conn.getpeername() == (VIP, 80)
                return conn.recv(64).decode().strip()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_agent_serves_services_from_the_operator_across_a_restart(
    topology: Topology, env: Env, sock_config: socklb.SockConfig
) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    services = Services([web(BACKENDS[:1])])
    cp_grpc.add_ServiceServiceServicer_to_server(services, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    flags = {
        "enable_bpf": True,
        "operator": f"127.0.0.1:{port}",
        "cgroup_root": sock_config.cgroup_root,
        "operator_reconnect_max_backoff": 1.0,
    }
    try:
        agent = env.start_agent(**flags)
        assert reach() == f"be {BACKENDS[0]}"
        assert agent.agent.lb is not None
        services.publish(cp.ServiceEvent(type=cp.EVENT_TYPE_UPSERT, service=web(BACKENDS[1:2])))
        deadline = time.monotonic() + 10
        while reach() != f"be {BACKENDS[1]}":
            assert time.monotonic() < deadline, "the change never reached the maps"
            time.sleep(0.05)
        ids = link_ids(env.pin_dir)
        assert len(ids) == len(socklb.PROGRAMS)

        agent.stop()
        assert reach() == f"be {BACKENDS[1]}"  # served while the agent is down

        services.listing = [web(BACKENDS[2:])]  # changed while it was down
        env.start_agent(**flags)
        deadline = time.monotonic() + 10
        while reach() != f"be {BACKENDS[2]}":
            assert time.monotonic() < deadline, "the restarted agent never resynced"
            time.sleep(0.05)
        assert link_ids(env.pin_dir) == ids  # the same links, their programs swapped
    finally:
        server.stop(None)
        env.cleanup()  # stops the agent, removes its pins
    assert not [i for i in link_ids(env.pin_dir) if link_exists(i)]
    assert not any(link_exists(i) for i in ids)
