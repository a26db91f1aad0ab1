"""Helpers for the cilia-cni tests: exec the real installed binary, and a contract-level
``cilia.agent.v1`` peer (a grpc.aio server on a tmp unix socket) for it to talk to."""

from __future__ import annotations

import asyncio
import contextlib
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


# ---------------------------------------------------------------------------------------
# A real cilia-agent in its own process, and the runtime side as libcni does it.

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
#: Seconds the agent process may take to serve its socket.
AGENT_START_TIMEOUT_SECONDS = 90
#: Seconds the agent gets to stop on SIGTERM before it is killed.
AGENT_STOP_TIMEOUT_SECONDS = 30
#: This suite's own address range (other suites use 10.251/16, the stack 10.200/16).
CIDR_PREFIX = "10.238"


def agent_python() -> str:
    """An interpreter that can import ``cilia_agent``: this one, else the project's .venv."""
    import importlib.util

    if importlib.util.find_spec("cilia_agent") is not None:
        return sys.executable
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    assert os.path.exists(venv), "cilia_agent is not installed; run scripts/setup.sh"
    return venv


def sh(*argv: str, check: bool = True) -> str:
    """Run a host command; return stdout, raise with stderr on failure when ``check``."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc.stdout


class RealAgent:
    """``cilia_agent.app.Agent`` run by ``agent_runner.py`` in a child process.

    Private names: tmp dir ``/tmp/cilia-cni-r*`` (socket, state, conflist, DEL queue),
    host device ``cilia_c<hex>``, pool ``10.238.<n>.0/<prefix>``, no BPF, no iptables
    rules, no operator, no metrics/Hubble TCP ports.
    """

    def __init__(self, prefix_len: int = 26) -> None:
        import secrets

        self.dir = tempfile.mkdtemp(prefix="cilia-cni-r", dir="/tmp")
        self.tag = secrets.token_hex(3)
        self.host_device = f"cilia_c{self.tag}"
        self.cidr = f"{CIDR_PREFIX}.{secrets.randbelow(250) + 1}.0/{prefix_len}"
        self.socket = os.path.join(self.dir, "agent.sock")
        self.conf_dir = os.path.join(self.dir, "net.d")
        self.del_queue = os.path.join(self.dir, "del-queue")
        self.log_file = os.path.join(self.dir, "cni.log")
        self.spec = {
            "config": {
                "node_name": f"cni-test-{self.tag}",
                "operator": "",
                "state_dir": os.path.join(self.dir, "state"),
                "socket": self.socket,
                "cni_conf_dir": self.conf_dir,
                "cni_del_queue_dir": self.del_queue,
                "cni_log_file": self.log_file,
                "host_device_name": self.host_device,
                "prometheus_serve_addr": "",
                "hubble_listen_address": "",
                "enable_bpf": False,
                "install_iptables_rules": False,
                "bpf_pin_dir": f"/sys/fs/bpf/cilia-cnitest-{self.tag}",
                "ipam_multi_pool_pre_allocation": {"default": 8},
            },
            "static": {"default": [self.cidr]},
        }
        self.proc: subprocess.Popen[str] | None = None
        self._channel: grpc.Channel | None = None

    def start(self) -> RealAgent:
        """Start the process and wait until it serves. Raises AssertionError on failure."""
        runner = os.path.join(os.path.dirname(__file__), "agent_runner.py")
        self.stderr = open(os.path.join(self.dir, "agent.stderr"), "a")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [agent_python(), runner, json.dumps(self.spec)],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )
        assert self.proc.stdout is not None
        timer = threading.Timer(AGENT_START_TIMEOUT_SECONDS, self.proc.kill)
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        if line.strip() != "ready":
            self.proc.kill()
            with open(os.path.join(self.dir, "agent.stderr")) as f:
                raise AssertionError(f"cilia-agent did not start: {f.read()[-3000:]}")
        self._channel = grpc.insecure_channel("unix:" + self.socket)
        self.attach = agent_pb2_grpc.AttachmentServiceStub(self._channel)
        self.debug = agent_pb2_grpc.DebugServiceStub(self._channel)
        return self

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (or SIGKILL) the agent and wait for it."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(AGENT_STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def cleanup(self) -> None:
        self.stop()
        sh("ip", "link", "del", self.host_device, check=False)
        pins = self.spec["config"]["bpf_pin_dir"]  # type: ignore[index]
        shutil.rmtree(str(pins), ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def conflist(self) -> dict[str, Any]:
        """The conflist the agent wrote once ready (what libcni reads)."""
        names = sorted(n for n in os.listdir(self.conf_dir) if n.endswith(".conflist"))
        assert names, f"no conflist in {self.conf_dir}"
        with open(os.path.join(self.conf_dir, names[0])) as f:
            return json.load(f)  # type: ignore[no-any-return]

    def endpoints(self) -> list[tuple[str, str, str]]:
        """(container_id, ifname, ipv4) of every endpoint the agent holds, sorted."""
        eps = self.debug.ListEndpoints(agent_pb2.ListEndpointsRequest(), timeout=10).endpoints
        return sorted((e.container_id, e.ifname, e.ipv4) for e in eps)

    def usage(self) -> list[tuple[str, int, int]]:
        """(pool, used, capacity) per pool."""
        status = self.debug.Status(agent_pb2.StatusRequest(), timeout=10)
        return sorted((p.pool, p.used, p.capacity) for p in status.pools)


def host_links(prefix: str = "lxc") -> set[str]:
    """Host interface names starting with ``prefix``."""
    return {
        link["ifname"]
        for link in json.loads(sh("ip", "-j", "link", "show"))
        if link["ifname"].startswith(prefix)
    }


class Netns:
    """Named network namespaces ``cilia-cnit-<hex>``, deleted by :meth:`cleanup`."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def add(self) -> str:
        import secrets

        name = f"cilia-cnit-{secrets.token_hex(4)}"
        sh("ip", "netns", "add", name)
        self.names.append(name)
        return f"/var/run/netns/{name}"

    def delete(self, path: str) -> None:
        name = os.path.basename(path)
        sh("ip", "netns", "del", name, check=False)
        if name in self.names:
            self.names.remove(name)

    def cleanup(self) -> None:
        for name in list(self.names):
            sh("ip", "netns", "del", name, check=False)
        self.names.clear()


class Libcni:
    """The runtime side of the CNI spec, as libcni (pkg/libcni) does it, exec'ing binaries.

    - plugins are found by ``type`` in the ``CNI_PATH`` directories;
    - each plugin's stdin is its object from ``plugins[]`` plus the list's ``name`` and
      ``cniVersion``, ``runtimeConfig``/``args`` when given and ``prevResult``;
    - ADD runs the plugins in order, each getting the previous one's result; the final
      result is cached in ``<cache>/results/<net>-<container id>-<ifname>``;
    - CHECK runs them in order with the cached result as ``prevResult``;
    - DEL runs them in reverse with the cached result (when any) and drops the cache;
    - GC (1.1.0) passes ``cni.dev/valid-attachments`` and ``cni.dev/attachments``; STATUS passes the config only.
    """

    def __init__(self, conflist: dict[str, Any], cni_path: list[str], cache_dir: str) -> None:
        self.conflist = conflist
        self.cni_path = cni_path
        self.cache_dir = cache_dir

    def with_version(self, version: str) -> Libcni:
        conf = dict(self.conflist, cniVersion=version)
        return Libcni(conf, self.cni_path, self.cache_dir)

    def find(self, plugin_type: str) -> str:
        for directory in self.cni_path:
            path = os.path.join(directory, plugin_type)
            if os.access(path, os.X_OK):
                return path
        raise AssertionError(f"plugin {plugin_type!r} not found in CNI_PATH {self.cni_path}")

    def _cache(self, container_id: str, ifname: str) -> str:
        name = f"{self.conflist['name']}-{container_id}-{ifname}"
        return os.path.join(self.cache_dir, "results", name)

    def cached(self, container_id: str, ifname: str = "eth0") -> dict[str, Any] | None:
        try:
            with open(self._cache(container_id, ifname)) as f:
                return json.load(f)["result"]  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def stdin(self, index: int, **extra: Any) -> dict[str, Any]:
        conf = dict(self.conflist["plugins"][index])
        conf["name"] = self.conflist["name"]
        conf["cniVersion"] = self.conflist["cniVersion"]
        conf.update({k: v for k, v in extra.items() if v is not None})
        return conf

    def _exec(self, index: int, env: dict[str, str], **extra: Any) -> CniRun:
        plugin = self.conflist["plugins"][index]["type"]
        full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
        full["CNI_PATH"] = ":".join(self.cni_path)
        data = json.dumps(self.stdin(index, **extra)).encode()
        proc = subprocess.run(
            [self.find(plugin)],
            input=data,
            env=full,
            capture_output=True,
            timeout=EXEC_TIMEOUT_SECONDS,
            check=False,
        )
        run = CniRun(proc.returncode, proc.stdout.decode(), proc.stderr.decode("utf-8", "replace"))
        assert "Traceback" not in run.stdout + run.stderr, run
        return run

    @staticmethod
    def _env(command: str, container_id: str, netns: str, ifname: str, args: str) -> dict[str, str]:
        return {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": container_id,
            "CNI_NETNS": netns,
            "CNI_IFNAME": ifname,
            "CNI_ARGS": args,
        }

    def add(
        self,
        container_id: str,
        netns: str,
        ifname: str = "eth0",
        cni_args: str = "",
        **extra: Any,
    ) -> CniRun:
        """ADD through every plugin; cache and return the last run (or the failing one).

        ``cni_args`` is CNI_ARGS; ``extra`` are keys added to every plugin's stdin
        (``args``, ``runtimeConfig``)."""
        env = self._env("ADD", container_id, netns, ifname, cni_args)
        prev: dict[str, Any] | None = None
        run = CniRun(1, "", "")
        for index in range(len(self.conflist["plugins"])):
            run = self._exec(index, env, prevResult=prev, **extra)
            if run.returncode != 0:
                return run
            prev = run.json
        path = self._cache(container_id, ifname)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(
                {
                    "kind": "cniCacheV1",
                    "containerId": container_id,
                    "ifName": ifname,
                    "networkName": self.conflist["name"],
                    "result": prev,
                },
                f,
            )
        return run

    def check(self, container_id: str, netns: str, ifname: str = "eth0", **extra: Any) -> CniRun:
        env = self._env("CHECK", container_id, netns, ifname, "")
        prev = extra.pop("prevResult", None) or self.cached(container_id, ifname)
        run = CniRun(0, "", "")
        for index in range(len(self.conflist["plugins"])):
            run = self._exec(index, env, prevResult=prev, **extra)
            if run.returncode != 0:
                return run
        return run

    def delete(self, container_id: str, netns: str, ifname: str = "eth0", args: str = "") -> CniRun:
        env = self._env("DEL", container_id, netns, ifname, args)
        prev = self.cached(container_id, ifname)
        run = CniRun(0, "", "")
        for index in reversed(range(len(self.conflist["plugins"]))):
            run = self._exec(index, env, prevResult=prev)
            if run.returncode != 0:
                return run
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._cache(container_id, ifname))
        return run

    def gc(
        self,
        valid: list[tuple[str, str]],
        keys: tuple[str, ...] = ("cni.dev/valid-attachments", "cni.dev/attachments"),
    ) -> CniRun:
        """GC keeping ``valid``, sent under each of ``keys`` (libcni sends both)."""
        attachments = [{"containerID": c, "ifname": i} for c, i in valid]
        extra = dict.fromkeys(keys, attachments)
        run = CniRun(0, "", "")
        for index in range(len(self.conflist["plugins"])):
            run = self._exec(index, {"CNI_COMMAND": "GC"}, **extra)
            if run.returncode != 0:
                return run
        return run

    def status(self) -> CniRun:
        run = CniRun(0, "", "")
        for index in range(len(self.conflist["plugins"])):
            run = self._exec(index, {"CNI_COMMAND": "STATUS"})
            if run.returncode != 0:
                return run
        return run


def run_in_process(env: dict[str, str], stdin: bytes) -> tuple[int, str]:
    """Drive the plugin's entry function in this process (what ``main`` does minus exec).

    Returns ``(exit status, stdout)``; raises whatever ``run`` would let escape (it must
    not let anything escape: that is what the fuzz test checks)."""
    from cilia_cni.plugin import run

    return run(env, lambda: stdin, "cilia-cni")
