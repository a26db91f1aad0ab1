"""Helpers for the cilia-cni tests: exec the real installed binary, and a contract-level
``cilia.agent.v1`` peer (a grpc.aio server on a tmp unix socket) for it to talk to."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

import grpc

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia_common import grpcerrors

#: Upper bound for one plugin exec in tests (the plugin's own timeouts are smaller).
EXEC_TIMEOUT_SECONDS = 60
#: Spec error codes plus this plugin's documented ones.
DOCUMENTED_CODES = {1, 3, 4, 5, 6, 7, 8, 11, 50, 100, 101, 102, 999}


def cni_binary() -> str:
    """The installed ``cilia-cni`` console script next to this interpreter."""
    found = shutil.which("cilia-cni", path=os.path.dirname(sys.executable))
    if found is None:
        found = shutil.which("cilia-cni")
    assert found, "cilia-cni is not installed; run scripts/setup.sh"
    return found


@dataclass
class CniRun:
    """Outcome of one exec: exit status, stdout, stderr and stdout parsed as JSON."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


def exec_cni(
    env: dict[str, str],
    stdin: bytes | str | dict[str, Any] = b"",
    timeout: float = EXEC_TIMEOUT_SECONDS,
) -> CniRun:
    """Exec the real binary with exactly ``env`` (plus PATH) and ``stdin``."""
    if isinstance(stdin, dict):
        stdin = json.dumps(stdin)
    if isinstance(stdin, str):
        stdin = stdin.encode()
    full_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    proc = subprocess.run(
        [cni_binary()], input=stdin, env=full_env, capture_output=True, timeout=timeout, check=False
    )
    run = CniRun(proc.returncode, proc.stdout.decode(), proc.stderr.decode("utf-8", "replace"))
    assert "Traceback" not in run.stdout + run.stderr, run
    return run


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


def assert_cni_error(run: CniRun, code: int, *needles: str) -> dict[str, Any]:
    """Assert ``run`` is a spec error with ``code`` whose msg contains every needle."""
    assert run.returncode != 0, run
    err = run.json
    assert set(err) == {"cniVersion", "code", "msg", "details"}, err
    assert err["code"] == code, err
    assert isinstance(err["msg"], str) and err["msg"], err
    assert isinstance(err["details"], str), err
    for needle in needles:
        assert needle in err["msg"], (needle, err)
    return err  # type: ignore[no-any-return]


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
