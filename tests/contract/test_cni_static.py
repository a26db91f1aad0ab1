"""The static ``cilia-cni`` (services/cni/shim, ``make cni-shim``) against a real cilia-agent
and the CNI server (``cilia-cni serve``), run from a root filesystem holding nothing but it.

What it must show (issue 32): the file needs no libc of the host (static: no program
interpreter, no dynamic section, so no ``GLIBC_`` symbol version at all; the result is
printed), ADD and DEL work from a ``chroot`` whose only file is the executable, and the
DEL-when-the-agent-is-down rule still holds with the server down too: the executable queues
the DEL itself, in the file the Python plugin writes, and the agent replays it at start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from realagent import Netns, RealAgent, agent_python, sh

from cilia.agent.v1 import agent_pb2
from cilia_testkit import ROOT

SHIM = ROOT / "build" / "cni" / "cilia-cni"
#: Seconds one exec may take (the plugin's own agent deadlines are 30 s and 10 s).
EXEC_TIMEOUT_SECONDS = 60.0
#: Seconds the server may take to listen.
SERVER_START_SECONDS = 30.0
PT_INTERP, PT_DYNAMIC = 3, 2


@pytest.fixture(scope="module")
def shim() -> pathlib.Path:
    """The executable, built by ``make cni-shim`` (a no-op when up to date)."""
    res = subprocess.run(["make", "-C", str(ROOT), "cni-shim"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return SHIM


def elf_program_header_types(path: pathlib.Path) -> list[int]:
    """``p_type`` of every program header of a 64-bit little-endian ELF file.

    Raises:
        AssertionError: not such a file.
    """
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not ELF64 LSB"
    phoff = int.from_bytes(data[0x20:0x28], "little")
    phentsize = int.from_bytes(data[0x36:0x38], "little")
    phnum = int.from_bytes(data[0x38:0x3A], "little")
    return [
        int.from_bytes(data[phoff + i * phentsize : phoff + i * phentsize + 4], "little")
        for i in range(phnum)
    ]


def test_the_executable_is_static_and_needs_no_glibc_version(shim: pathlib.Path) -> None:
    types = elf_program_header_types(shim)
    assert PT_INTERP not in types, "the executable names a program interpreter (dynamic)"
    assert PT_DYNAMIC not in types, "the executable has a dynamic section"
    versions = subprocess.run(
        ["readelf", "--version-info", "--wide", str(shim)], capture_output=True, text=True
    ).stdout
    assert "GLIBC_" not in versions, versions
    print(
        f"\n{shim}: {shim.stat().st_size} bytes, statically linked (no PT_INTERP, no "
        "PT_DYNAMIC): needs no glibc at all, any GLIBC_ version or none"
    )


class Server:
    """``cilia-cni serve`` beside the agent's socket, in its own process group."""

    def __init__(self, agent: RealAgent) -> None:
        self.socket = os.path.join(os.path.dirname(agent.socket), "cilia-cni.sock")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if os.path.exists(self.socket):
            os.unlink(self.socket)  # a killed server's: wait for the new one's below
        self.proc = subprocess.Popen(
            [agent_python(), "-m", "cilia_cni", "serve", "--socket", self.socket],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            process_group=0,
        )
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not os.path.exists(self.socket):
            assert self.proc.poll() is None, self.proc.stderr.read()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "cilia-cni serve did not listen in time"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None


@pytest.fixture
def server(real_agent: RealAgent) -> Iterator[Server]:
    srv = Server(real_agent)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _env(command: str, **cni: str) -> dict[str, str]:
    return {"PATH": "/nonexistent", "CNI_COMMAND": command, **cni}


def _netconf(agent: RealAgent, **extra: Any) -> dict[str, Any]:
    conflist = agent.conflist()
    conf = dict(conflist["plugins"][0], name=conflist["name"], cniVersion=conflist["cniVersion"])
    conf.pop("log-file", None)  # written by the server outside the root; not needed here
    conf.update(extra)
    return conf


def _run(argv: list[str], env: dict[str, str], conf: Any) -> tuple[int, dict[str, Any]]:
    stdin = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    proc = subprocess.run(
        argv, env=env, input=stdin, capture_output=True, timeout=EXEC_TIMEOUT_SECONDS
    )
    return proc.returncode, (json.loads(proc.stdout) if proc.stdout.strip() else {})


@pytest.fixture
def root(shim: pathlib.Path, real_agent: RealAgent, short_tmp: str) -> pathlib.Path:
    """A root filesystem holding the executable only (no libc, no sh, no python, no /proc)."""
    root = pathlib.Path(short_tmp) / "root"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(shim, root / "bin" / "cilia-cni")
    (root / pathlib.Path(real_agent.dir).relative_to("/")).mkdir(parents=True)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files == [root / "bin" / "cilia-cni"], files
    return root


def _link_into(root: pathlib.Path, socket: str) -> None:
    """The server's socket hard-linked into the root (same inode: connect() reaches it)."""
    os.link(socket, root / socket.lstrip("/"))


def test_add_del_from_a_root_without_python_or_libc(
    root: pathlib.Path, real_agent: RealAgent, server: Server, netns: Netns
) -> None:
    _link_into(root, server.socket)
    chroot = [shutil.which("chroot") or "/usr/sbin/chroot", str(root), "/bin/cilia-cni"]
    rc, out = _run(chroot, _env("VERSION"), {"cniVersion": "0.4.0"})
    assert (rc, out["cniVersion"]) == (0, "0.4.0"), out
    # a spec error decided by the plugin logic in the server
    rc, out = _run(chroot, _env("ADD", CNI_NETNS="/n", CNI_IFNAME="eth0"), _netconf(real_agent))
    assert (rc, out["code"]) == (1, 4) and "CNI_CONTAINERID" in out["msg"], out

    ns = netns.add()
    cni = {
        "CNI_CONTAINERID": "static-1",
        "CNI_NETNS": ns,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/bin",
        "CNI_ARGS": "K8S_POD_NAMESPACE=team;K8S_POD_NAME=static-0",
    }
    rc, result = _run(chroot, _env("ADD", **cni), _netconf(real_agent))
    assert rc == 0, result
    ip = result["ips"][0]["address"]
    assert result["interfaces"][result["ips"][0]["interface"]]["sandbox"] == ns, result
    addrs = json.loads(sh("ip", "-4", "-n", os.path.basename(ns), "-j", "addr", "show", "eth0"))
    assert ip in {f"{a['local']}/{a['prefixlen']}" for a in addrs[0]["addr_info"]}, addrs
    assert [(c, i) for c, i, _ in real_agent.endpoints()] == [("static-1", "eth0")]

    rc, out = _run(chroot, _env("DEL", **cni), _netconf(real_agent, prevResult=result))
    assert (rc, out) == (0, {})
    assert real_agent.endpoints() == []


def test_server_and_agent_down_del_is_queued_by_the_executable_and_replayed(
    shim: pathlib.Path, real_agent: RealAgent, server: Server, netns: Netns
) -> None:
    ns = netns.add()
    cni = {"CNI_CONTAINERID": "static-q", "CNI_NETNS": ns, "CNI_IFNAME": "eth0"}
    rc, result = _run([str(shim)], _env("ADD", **cni), _netconf(real_agent))
    assert rc == 0, result
    server.stop()
    real_agent.stop()
    try:
        rc, out = _run([str(shim)], _env("ADD", **cni), _netconf(real_agent))
        assert (rc, out["code"]) == (1, 11) and "unreachable" in out["msg"], out
        rc, out = _run([str(shim)], _env("STATUS"), _netconf(real_agent, cniVersion="1.1.0"))
        assert (rc, out["code"]) == (1, 50), out
        rc, out = _run([str(shim)], _env("VERSION"), {"cniVersion": "1.0.0"})
        assert (rc, out["cniVersion"]) == (0, "1.0.0"), out
        rc, out = _run([str(shim)], _env("DEL", **cni), _netconf(real_agent, prevResult=result))
        assert (rc, out) == (0, {})
        rc, out = _run([str(shim)], _env("DEL", **cni), _netconf(real_agent))
        assert (rc, out) == (0, {}), "a repeated DEL succeeds too"
        names = os.listdir(real_agent.del_queue)
        key = hashlib.sha256(b"static-q/eth0").hexdigest()[:16]
        assert len(names) == 1 and names[0].endswith(f"-{key}.del"), names
        queued = agent_pb2.QueuedDel()
        queued.ParseFromString(pathlib.Path(real_agent.del_queue, names[0]).read_bytes())
        assert (queued.request.container_id, queued.request.ifname, queued.request.netns) == (
            "static-q",
            "eth0",
            ns,
        )
        assert abs(queued.queued_at_unix_ms - time.time() * 1000) < 60_000
        assert names[0].startswith(f"{queued.queued_at_unix_ms:013d}-")
    finally:
        real_agent.start()
    # replayed by the agent before it served: the attachment is gone
    assert real_agent.endpoints() == []
    assert os.listdir(real_agent.del_queue) == []
    assert "eth0" not in sh("ip", "-n", os.path.basename(ns), "-o", "link", "show")


#: Seconds for the running agent to replay a queued DEL (its --cni-del-queue-replay-interval
#: is 5 s by default).
REPLAY_WAIT_SECONDS = 20.0


def test_server_down_agent_up_del_is_queued_and_the_running_agent_replays_it(
    shim: pathlib.Path, real_agent: RealAgent, server: Server, netns: Netns
) -> None:
    ns = netns.add()
    cni = {"CNI_CONTAINERID": "static-r", "CNI_NETNS": ns, "CNI_IFNAME": "eth0"}
    rc, result = _run([str(shim)], _env("ADD", **cni), _netconf(real_agent))
    assert rc == 0, result
    server.stop()
    rc, out = _run([str(shim)], _env("DEL", **cni), _netconf(real_agent, prevResult=result))
    assert (rc, out) == (0, {})
    assert len(os.listdir(real_agent.del_queue)) == 1
    deadline = time.monotonic() + REPLAY_WAIT_SECONDS
    while real_agent.endpoints() or os.listdir(real_agent.del_queue):
        assert time.monotonic() < deadline, "the running agent did not replay the queued DEL"
        time.sleep(0.2)
    assert "eth0" not in sh("ip", "-n", os.path.basename(ns), "-o", "link", "show")
