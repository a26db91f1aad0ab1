"""Helpers for the cilia-cni tests: exec the real installed binary, and a contract-level
``cilia.agent.v1`` peer (a grpc.aio server on a tmp unix socket) for it to talk to."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia_common import grpcerrors
from cilia_testkit.cni import DOCUMENTED_CODES as DOCUMENTED_CODES
from cilia_testkit.cni import EXEC_TIMEOUT_SECONDS as EXEC_TIMEOUT_SECONDS
from cilia_testkit.cni import CniRun as CniRun
from cilia_testkit.cni import assert_cni_error as assert_cni_error
from cilia_testkit.cni import cni_binary as cni_binary
from cilia_testkit.cni import exec_cni as exec_cni


def cni_env(command: str, container_id: str = "c0ffee01", **extra: str) -> dict[str, str]:
    """A real CNI environment for ``command``."""
    env = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": "/var/run/netns/cilia-t-cni",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin:/usr/lib/cni",
    }
    env.update(extra)
    return env


def netconf(agent_socket: str, version: str = "1.0.0", **extra: Any) -> dict[str, Any]:
    """The plugin config the runtime would pass (what the agent's conflist holds)."""
    conf: dict[str, Any] = {
        "cniVersion": version,
        "name": "cilia",
        "type": "cilia-cni",
        "agent-socket": agent_socket,
        # Never the host's default queue: a real agent there would replay our DELs.
        "del-queue-dir": os.path.join(os.path.dirname(agent_socket) or "/tmp", "del-queue"),
    }
    conf.update(extra)
    return conf


@dataclass
class ContractAgent(agent_pb2_grpc.AttachmentServiceServicer):  # type: ignore[misc]
    """A peer implementing the ``cilia.agent.v1.AttachmentService`` contract.

    Add allocates 10.251.0.N/32 behind router 10.251.0.1 and refuses an existing
    (container_id, ifname) with ALREADY_EXISTS; Del is idempotent. ``fail_add``/
    ``fail_del`` make the next calls abort with a status; ``add_delay`` slows Add;
    ``add_response`` overrides the answer.
    """

    add_requests: list[agent_pb2.AddRequest] = field(default_factory=list)
    del_requests: list[agent_pb2.DelRequest] = field(default_factory=list)
    attachments: dict[tuple[str, str], str] = field(default_factory=dict)
    fail_add: tuple[grpc.StatusCode, str] | None = None
    #: with ``fail_add``: abort with this google.rpc.ErrorInfo reason (domain agent.cilia.io)
    fail_add_reason: str = ""
    fail_del: tuple[grpc.StatusCode, str] | None = None
    add_delay: float = 0.0
    add_response: agent_pb2.AddResponse | None = None
    mtu: int = 1500
    next_host: int = 2

    def reset(self) -> None:
        self.add_requests.clear()
        self.del_requests.clear()
        self.attachments.clear()
        self.fail_add = self.fail_del = self.add_response = None
        self.fail_add_reason = ""
        self.add_delay = 0.0
        self.next_host = 2

    async def Add(  # noqa: N802 - gRPC method name
        self, request: agent_pb2.AddRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.AddResponse:
        self.add_requests.append(request)
        if self.add_delay:
            await asyncio.sleep(self.add_delay)
        if self.fail_add is not None and self.fail_add_reason:
            await grpcerrors.abort(
                context,
                *self.fail_add,
                reason=self.fail_add_reason,
                domain=grpcerrors.AGENT_DOMAIN,
            )
        if self.fail_add is not None:
            await context.abort(*self.fail_add)
        if self.add_response is not None:
            return self.add_response
        key = (request.container_id, request.ifname)
        if key in self.attachments:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"interface {request.ifname} already exists in netns {request.netns}",
            )
        ip = f"10.251.0.{self.next_host}"
        self.next_host += 1
        self.attachments[key] = ip
        digest = hashlib.sha256(f"{request.container_id}/{request.ifname}".encode()).hexdigest()
        mtu = request.mtu or self.mtu
        return agent_pb2.AddResponse(
            interfaces=[
                agent_pb2.Interface(name="lxc" + digest[:11], mac="02:00:00:00:00:01", mtu=mtu),
                agent_pb2.Interface(
                    name=request.ifname, mac="02:00:00:00:00:02", sandbox=request.netns, mtu=mtu
                ),
            ],
            ips=[agent_pb2.IPConfig(address=ip + "/32", gateway="10.251.0.1", interface=1)],
            routes=[agent_pb2.Route(dst="0.0.0.0/0", gw="10.251.0.1")],
            endpoint_id=self.next_host,
        )

    async def Del(  # noqa: N802 - gRPC method name
        self, request: agent_pb2.DelRequest, context: grpc.aio.ServicerContext
    ) -> agent_pb2.DelResponse:
        self.del_requests.append(request)
        if self.fail_del is not None:
            await context.abort(*self.fail_del)
        deleted = self.attachments.pop((request.container_id, request.ifname), None)
        return agent_pb2.DelResponse(deleted=deleted is not None)


class AgentServer:
    """Runs a :class:`ContractAgent` on ``unix:<dir>/agent.sock`` in a background loop."""

    def __init__(self) -> None:
        # Short directory: unix socket paths are limited to 107 bytes.
        self.dir = tempfile.mkdtemp(prefix="cilia-cni-t", dir="/tmp")
        self.socket = os.path.join(self.dir, "agent.sock")
        self.servicer = ContractAgent()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None

    def start(self) -> AgentServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        agent_pb2_grpc.add_AttachmentServiceServicer_to_server(self.servicer, self._server)
        self._server.add_insecure_port("unix:" + self.socket)
        await self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()
        shutil.rmtree(self.dir, ignore_errors=True)
