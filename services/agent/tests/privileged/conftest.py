"""Fixtures for privileged agent tests: real netns, real veths, the real gRPC server.

Names never collide with the local stack: netns ``cilia-t-*``, host device
``cilia_t<hex>``, CIDRs inside 10.251.0.0/16. Everything created is removed
even when a test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import secrets
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grpc
import pytest

from cilia.agent.v1 import agent_pb2_grpc
from cilia_agent.app import Agent
from cilia_agent.config import Config
from cilia_testkit import skips


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test under this directory is privileged."""
    here = pathlib.Path(__file__).parent
    for item in items:
        if pathlib.Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.privileged)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Root, iproute2 and iptables, or skip with the reason (fail in CI)."""
    skips.require(skips.netns_missing() or skips.binary_missing("iptables"))


class AgentThread:
    """A real Agent running its asyncio loop in a background thread.

    Tests talk to it through a real gRPC channel on its unix socket.
    """

    def __init__(self, config: Config, static_allocation: Mapping[str, Sequence[str]] | None):
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.agent = Agent(config, static_allocation=static_allocation)
        self.call(self.agent.start())
        self.channel = grpc.insecure_channel(f"unix:{config.socket}")
        self.attach = agent_pb2_grpc.AttachmentServiceStub(channel=self.channel)
        self.debug = agent_pb2_grpc.DebugServiceStub(channel=self.channel)
        self.stopped = False

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.channel.close()
        try:
            self.call(self.agent.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class Env:
    """Per-test names, directories and cleanup bookkeeping."""

    def __init__(self, tmp: pathlib.Path) -> None:
        self.tmp = tmp
        self.tag = secrets.token_hex(3)
        self.host_device = f"cilia_t{self.tag}"
        self.cidr = f"10.251.{secrets.randbelow(250) + 1}.0/24"
        self.state_dir = tmp / "state"
        self.pin_dir = pathlib.Path(f"/sys/fs/bpf/cilia-test-{self.tag}")
        self.netns: list[str] = []
        self.agents: list[AgentThread] = []

    def config(self, **overrides: Any) -> Config:
        values: dict[str, Any] = {
            "node_name": f"test-{self.tag}",
            "operator": "",
            "state_dir": self.state_dir,
            "socket": self.tmp / "agent.sock",
            "cni_conf_dir": self.tmp / "net.d",
            "cni_del_queue_dir": self.tmp / "del-queue",
            "host_device_name": self.host_device,
            "prometheus_serve_addr": "",
            "ipam_multi_pool_pre_allocation": {"default": 8},
            # issue-2 tests run without BPF; BPF tests pass enable_bpf=True
            "enable_bpf": False,
            "bpf_pin_dir": self.pin_dir,
            "hubble_listen_address": "",
            # the host's netns is shared by every test (and helper): its nat table is not
            # ours to write; masquerade tests run in namespaces of their own
            "enable_ipv4_masquerade": False,
        }
        values.update(overrides)
        return Config(**values)

    def start_agent(
        self, static: Mapping[str, Sequence[str]] | None = None, **overrides: Any
    ) -> AgentThread:
        if static is None:
            static = {"default": [self.cidr]}
        agent = AgentThread(self.config(**overrides), static)
        self.agents.append(agent)
        return agent

    def add_netns(self) -> str:
        name = f"cilia-t-{secrets.token_hex(4)}"
        subprocess.run(["ip", "netns", "add", name], check=True)
        self.netns.append(name)
        return f"/var/run/netns/{name}"

    def del_netns(self, path: str) -> None:
        name = os.path.basename(path)
        subprocess.run(["ip", "netns", "del", name], check=False)
        if name in self.netns:
            self.netns.remove(name)

    def cleanup(self) -> None:
        for agent in self.agents:
            with contextlib.suppress(Exception):  # best-effort teardown
                agent.stop()
        for name in list(self.netns):
            subprocess.run(["ip", "netns", "del", name], check=False)
        subprocess.run(["ip", "link", "del", self.host_device], check=False, capture_output=True)
        if self.pin_dir.is_dir():
            for pinned in self.pin_dir.iterdir():
                pinned.unlink()
            self.pin_dir.rmdir()


@pytest.fixture
def env(tmp_path: pathlib.Path) -> Iterator[Env]:
    e = Env(tmp_path)
    try:
        yield e
    finally:
        e.cleanup()


def sh(*cmd: str) -> str:
    """Run a command, return stdout; raise with stderr on failure."""
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc.stdout
