"""Fixtures of the load-balancer tests: pinned maps, the socket-LB attached to a cgroup2
mount of its own, and network namespaces with real TCP and UDP backends.

Topology (module-scoped, names ``tlb<hex>``; removed even when a test fails)::

    host 10.252.78.1/30 ──veth── 10.252.78.2/30 [ backends netns ] 10.252.78.5/30 ──veth── 10.252.78.6/30 [ client netns ]
                                  lo: 10.252.77.11, .12, .13 (/32)
                                  each: TCP :8080 (greets "be <ip>", then echoes)
                                        UDP :5353 (answers "be <ip> <payload>")

The host routes 10.252.77.0/24 via the backends netns, the client netns routes everything
there: connections from the host and from another netns reach the backends without
forwarding. VIPs are taken from 198.18.77.0/24 (a benchmarking range nobody serves).

A helper of its own (the test kit is not this package's to change): :func:`in_netns`
runs a function in a thread that entered a network namespace with ``setns`` — sockets it
creates live there, whatever thread uses them later.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import secrets
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest

from cilia_agent.datapath.objects import default_bpf_dir
from cilia_agent.loadbalancer import socklb
from cilia_agent.loadbalancer.maps import LBMaps, ServiceMapWriter
from cilia_testkit import skips
from cilia_testkit.netns import create_netns, delete_netns, netns_path

T = TypeVar("T")

BACKENDS = ("10.252.77.11", "10.252.77.12", "10.252.77.13")
TCP_PORT = 8080
UDP_PORT = 5353
HOST_ADDR, BE_HOST_ADDR = "10.252.78.1", "10.252.78.2"
BE_CLIENT_ADDR, CLIENT_ADDR = "10.252.78.5", "10.252.78.6"
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def sh(*argv: str) -> None:
    """Run a command, raising with its stderr on failure."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")


def in_netns(netns: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread inside network namespace ``netns``; its result or error."""
    out: dict[str, Any] = {}

    def run() -> None:
        fd = os.open(netns_path(netns), os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns {netns}")
        finally:
            os.close(fd)
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]  # type: ignore[no-any-return]


@dataclass
class Backends:
    """The TCP and UDP servers of the backends netns."""

    tcp: list[socket.socket] = field(default_factory=list)
    udp: list[socket.socket] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def serve(self) -> None:
        for srv in self.tcp:
            threading.Thread(target=self._accept, args=(srv,), daemon=True).start()
        for srv in self.udp:
            threading.Thread(target=self._answer, args=(srv,), daemon=True).start()

    def _accept(self, srv: socket.socket) -> None:
        name = f"be {srv.getsockname()[0]}\n".encode()
        while not self.stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn, name), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket, name: bytes) -> None:
        with conn, contextlib.suppress(OSError):
            conn.sendall(name)
            while data := conn.recv(4096):
                conn.sendall(data)

    def _answer(self, srv: socket.socket) -> None:
        name = f"be {srv.getsockname()[0]} ".encode()
        while not self.stop.is_set():
            try:
                data, peer = srv.recvfrom(4096)
                if peer is None:  # woken by shutdown()
                    return
                srv.sendto(name + data, peer)
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        for srv in [*self.tcp, *self.udp]:
            with contextlib.suppress(OSError):
                srv.shutdown(socket.SHUT_RDWR)
            srv.close()


@dataclass(frozen=True)
class Topology:
    """Names of the module's namespaces."""

    client: str
    backends: str


def _servers() -> Backends:
    out = Backends()
    for ip in BACKENDS:
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((ip, TCP_PORT))
        tcp.listen(1024)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((ip, UDP_PORT))
        out.tcp.append(tcp)
        out.udp.append(udp)
    return out


@pytest.fixture(scope="module")
def topology() -> Iterator[Topology]:
    """The client and backends namespaces with their servers (see the module docstring)."""
    skips.require(skips.bpf_missing("cgroup sock_addr programs, BPF links, pinned maps"))
    tag = secrets.token_hex(3)
    client, backends = f"tlb{tag}c", f"tlb{tag}b"
    host_if, be_host_if, be_cl_if, cl_if = (f"tlb{tag}{s}" for s in "hxyz")
    servers: Backends | None = None
    try:
        create_netns(client)
        create_netns(backends)
        sh(
            "ip",
            "link",
            "add",
            host_if,
            "type",
            "veth",
            "peer",
            "name",
            be_host_if,
            "netns",
            backends,
        )
        sh("ip", "-n", client, "link", "add", cl_if, "type", "veth", "peer", "name", be_cl_if,
           "netns", backends)  # fmt: skip
        sh("ip", "addr", "add", f"{HOST_ADDR}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "route", "add", "10.252.77.0/24", "via", BE_HOST_ADDR)
        sh("ip", "-n", backends, "addr", "add", f"{BE_HOST_ADDR}/30", "dev", be_host_if)
        sh("ip", "-n", backends, "addr", "add", f"{BE_CLIENT_ADDR}/30", "dev", be_cl_if)
        for ip in BACKENDS:
            sh("ip", "-n", backends, "addr", "add", f"{ip}/32", "dev", "lo")
        for dev in ("lo", be_host_if, be_cl_if):
            sh("ip", "-n", backends, "link", "set", dev, "up")
        sh("ip", "-n", client, "addr", "add", f"{CLIENT_ADDR}/30", "dev", cl_if)
        for dev in ("lo", cl_if):
            sh("ip", "-n", client, "link", "set", dev, "up")
        sh("ip", "-n", client, "route", "add", "default", "via", BE_CLIENT_ADDR)
        servers = in_netns(backends, _servers)
        servers.serve()
        yield Topology(client=client, backends=backends)
    finally:
        if servers is not None:
            servers.close()
        with contextlib.suppress(RuntimeError):
            sh("ip", "route", "del", "10.252.77.0/24", "via", BE_HOST_ADDR)
        with contextlib.suppress(RuntimeError):
            sh("ip", "link", "del", host_if)
        for ns in (client, backends):
            delete_netns(ns)


@pytest.fixture(params=["set-retval", "compat"])
def sock_config(request: pytest.FixtureRequest) -> Iterator[socklb.SockConfig]:
    """A pin dir and a cgroup2 mount of the test's own; whatever the test attached is
    detached, the pins removed and the mount unmounted at the end. Every test runs with
    both socket-LB objects: ``bpf_sock.o`` and ``bpf_sock_compat.o`` (what ``auto`` loads on
    a kernel without bpf_set_retval, < 5.18), forced here."""
    skips.require(skips.bpf_missing("cgroup sock_addr programs, BPF links, pinned maps"))
    tag = secrets.token_hex(4)
    run_dir = pathlib.Path(f"/run/cilia-tlb-{tag}")
    config = socklb.SockConfig(
        bpf_dir=default_bpf_dir(),
        pin_dir=pathlib.Path(f"/sys/fs/bpf/cilia-tlb-{tag}"),
        cgroup_root=run_dir / "cgroupv2",
        lb_map_max=1024,
        sock_rev_map_max=4096,
        variant=request.param,
    )
    try:
        yield config
    finally:
        socklb.detach(config.pin_dir)
        shutil.rmtree(config.pin_dir, ignore_errors=True)
        if config.cgroup_root.is_dir():
            subprocess.run(["umount", str(config.cgroup_root)], capture_output=True, check=False)
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def writer(sock_config: socklb.SockConfig) -> Iterator[ServiceMapWriter]:
    """A writer on freshly created pinned maps (nothing attached)."""
    socklb.create_maps(sock_config)
    maps = LBMaps(sock_config.pin_dir)
    try:
        yield ServiceMapWriter(maps, sock_config.lb_map_max)
    finally:
        maps.close()


def link_ids(pin_dir: pathlib.Path) -> list[int]:
    """Kernel ids of the socket-LB links pinned under ``pin_dir`` (``bpftool link show``)."""
    import json

    ids = []
    for name in socklb.attached(pin_dir):
        out = subprocess.run(
            ["bpftool", "-j", "link", "show", "pinned", str(socklb.link_pin(pin_dir, name))],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        ids.append(int(json.loads(out.stdout)["id"]))
    return ids


def link_exists(link_id: int) -> bool:
    """True while the kernel still has link ``link_id``."""
    proc = subprocess.run(
        ["bpftool", "link", "show", "id", str(link_id)], capture_output=True, check=False
    )
    return proc.returncode == 0


@pytest.fixture
def attached(sock_config: socklb.SockConfig) -> Iterator[ServiceMapWriter]:
    """The eight programs attached to the test's cgroup2 root (the machine's one hierarchy,
    so every process) and a writer on their maps; after the test the links are gone from
    the kernel."""
    skips.require(skips.binary_missing("bpftool", "bpftool"))
    socklb.attach(sock_config)
    ids = link_ids(sock_config.pin_dir)
    assert len(ids) == len(socklb.PROGRAMS)
    maps = LBMaps(sock_config.pin_dir)
    try:
        yield ServiceMapWriter(maps, sock_config.lb_map_max)
    finally:
        maps.close()
        socklb.detach(sock_config.pin_dir)
        left = [i for i in ids if link_exists(i)]
        assert not left, f"socket-LB links still attached after detach: {left}"
