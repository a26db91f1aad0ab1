"""The contract suite's helpers: a real ``cilia-agent`` in its own process
(:class:`RealAgent`), the runtime side as libcni drives a plugin (:class:`Libcni`), named
network namespaces (:class:`Netns`), and the installed ``cilia-cni`` exec'd with exactly a
given environment.

Cross-service tests live here (``tox -e contract``: agent + cni + test kit installed), so the
CNI package's own tests never import ``cilia_agent``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any

import grpc

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia_testkit.cni import DOCUMENTED_CODES as DOCUMENTED_CODES
from cilia_testkit.cni import EXEC_TIMEOUT_SECONDS as EXEC_TIMEOUT_SECONDS
from cilia_testkit.cni import CniRun as CniRun
from cilia_testkit.cni import assert_cni_error as assert_cni_error
from cilia_testkit.cni import cni_binary as cni_binary
from cilia_testkit.cni import exec_cni as exec_cni

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
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
                "enable_ipv4_masquerade": False,
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
