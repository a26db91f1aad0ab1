"""The agent's operator session against an in-process cilia.controlplane.v1 server.

The server below is a small stand-in that speaks the real contract over a real
TCP gRPC channel (the operator service itself is built elsewhere).
"""

from __future__ import annotations

import ipaddress
import json
import queue
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from cilia.agent.v1 import agent_pb2
from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc

from .conftest import Env


class StandInOperator(cp_grpc.NodeServiceServicer, cp_grpc.IPAMServiceServicer):  # type: ignore[misc]
    def __init__(self, cidr: str) -> None:
        self.cidr = cidr
        self.registrations: list[cp.RegisterRequest] = []
        self.demands: list[cp.UpdateDemandRequest] = []
        self.updates: queue.Queue[cp.NodeAllocation | None] = queue.Queue()

    def Register(self, request: cp.RegisterRequest, context: Any) -> cp.RegisterResponse:  # noqa: N802
        self.registrations.append(request)
        return cp.RegisterResponse(default_pool="default")

    def UpdateDemand(  # noqa: N802
        self, request: cp.UpdateDemandRequest, context: Any
    ) -> cp.UpdateDemandResponse:
        self.demands.append(request)
        return cp.UpdateDemandResponse()

    def ResolvePool(  # noqa: N802
        self, request: cp.ResolvePoolRequest, context: Any
    ) -> cp.ResolvePoolResponse:
        return cp.ResolvePoolResponse(pool="default", reason="default pool (test)")

    def WatchAllocations(  # noqa: N802
        self, request: cp.WatchAllocationsRequest, context: Any
    ) -> Iterator[cp.WatchAllocationsResponse]:
        yield cp.WatchAllocationsResponse(
            allocation=cp.NodeAllocation(
                node_name=request.node_name,
                pools=[cp.PoolCIDRs(pool="default", cidrs=[self.cidr])],
                resource_version="1",
            )
        )
        while context.is_active():
            try:
                item = self.updates.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is None:
                return
            yield cp.WatchAllocationsResponse(allocation=item)


def _wait(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_agent_registers_gets_cidr_becomes_ready_and_sends_demand(env: Env) -> None:
    op = StandInOperator(env.cidr)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    cp_grpc.add_NodeServiceServicer_to_server(op, server)
    cp_grpc.add_IPAMServiceServicer_to_server(op, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        a = env.start_agent(
            static={},
            operator=f"127.0.0.1:{port}",
            operator_reconnect_min_backoff=0.1,
            operator_reconnect_max_backoff=0.5,
        )
        _wait(lambda: a.debug.Status(agent_pb2.StatusRequest()).ready)
        reg = op.registrations[0]
        assert reg.node_name == a.config.node_name and reg.addresses
        assert all(n.interface != env.host_device for n in reg.local_networks)
        assert all(not n.interface.startswith("lxc") for n in reg.local_networks)
        conf = json.loads((env.tmp / "net.d" / "05-cilia.conflist").read_text())
        assert conf["plugins"][0]["agent-socket"] == str(env.tmp / "agent.sock")
        # router IP is in use: needed = ceil(1, 8) = 16
        _wait(lambda: any(d.demands and d.demands[0].needed_ipv4 == 16 for d in op.demands))
        for i in range(8):
            a.attach.Add(
                agent_pb2.AddRequest(container_id=f"op{i}", ifname="eth0", netns=env.add_netns()),
                timeout=10,
            )
        # 9 in use → 24
        _wait(lambda: op.demands[-1].demands[0].needed_ipv4 == 24)
        third = int(env.cidr.split(".")[2])
        extra = f"10.251.{third % 250 + 1}.0/24"
        op.updates.put(
            cp.NodeAllocation(
                node_name=a.config.node_name,
                pools=[cp.PoolCIDRs(pool="default", cidrs=[env.cidr, extra])],
            )
        )
        # 9 in use, 24 needed: the first /24 covers it, so the empty extra one is handed
        # back at once (UpdateDemand.released) and no address comes from it.
        _wait(lambda: any(cp.PoolCIDRs(pool="default", cidrs=[extra]) in d.released
                          for d in op.demands))  # fmt: skip
        assert a.debug.Status(agent_pb2.StatusRequest()).pools[0].cidrs == [env.cidr]
        _wait(
            lambda: (
                json.loads((env.state_dir / "node.json").read_text())["allocation"]
                == {"default": [env.cidr]}
            )
        )
        # An allocation still listing it (the operator had not processed the release yet)
        # does not bring it back; once an allocation no longer lists it, it is forgotten.
        op.updates.put(
            cp.NodeAllocation(
                node_name=a.config.node_name,
                pools=[cp.PoolCIDRs(pool="default", cidrs=[env.cidr, extra])],
                resource_version="3",
            )
        )
        ip = (
            a.attach.Add(
                agent_pb2.AddRequest(container_id="op-after", ifname="eth0", netns=env.add_netns()),
                timeout=10,
            )
            .ips[0]
            .address
        )
        assert ipaddress.ip_interface(ip).ip in ipaddress.ip_network(env.cidr)
        assert a.debug.Status(agent_pb2.StatusRequest()).pools[0].cidrs == [env.cidr]
        op.updates.put(
            cp.NodeAllocation(
                node_name=a.config.node_name,
                pools=[cp.PoolCIDRs(pool="default", cidrs=[env.cidr])],
                resource_version="4",
            )
        )
        a.attach.Add(
            agent_pb2.AddRequest(container_id="op-last", ifname="eth0", netns=env.add_netns()),
            timeout=10,
        )
        _wait(lambda: not op.demands[-1].released and op.demands[-1].demands[0].needed_ipv4 == 24)
        # The stream ends: the agent reconnects and registers again.
        op.updates.put(None)
        _wait(lambda: len(op.registrations) >= 2)
    finally:
        server.stop(0)
