"""Two real stacks at once on one host: each gets its own pods through the real cilia-cni, and
pods ping within each stack (privileged: root, netns, BPF; the .venv's binaries)."""

from __future__ import annotations

import ipaddress
import os
import shutil
from collections.abc import Iterator

import pytest

from cilia_testkit import VENV_BIN, cni, netns
from cilia_testkit.netns import NetnsRegistry
from cilia_testkit.stack import Stack

pytestmark = [pytest.mark.privileged, pytest.mark.timeout(600)]


@pytest.fixture
def two_stacks() -> Iterator[tuple[Stack, Stack]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespaces, veth, iptables, BPF")
    for tool in ("ip", "ping", "redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool!r} on PATH (scripts/setup.sh installs it)")
    if not (VENV_BIN / "cilia-agent").exists():
        pytest.fail(f"{VENV_BIN / 'cilia-agent'} missing: run scripts/setup.sh")
    with Stack("tk-a") as a, Stack("tk-b") as b:
        yield a, b


def test_two_stacks_run_side_by_side_and_pods_ping_within_each(
    two_stacks: tuple[Stack, Stack],
) -> None:
    a, b = two_stacks
    # Nothing per-stack is shared.
    assert a.run_dir != b.run_dir and a.slot != b.slot
    assert a.operator_address != b.operator_address
    assert a.relay_address != b.relay_address
    assert a.agent.pin_dir != b.agent.pin_dir
    assert a.agent.host_device != b.agent.host_device
    assert not ipaddress.ip_network(a.pool_cidr).overlaps(ipaddress.ip_network(b.pool_cidr))
    for s in (a, b):
        assert a.operator_address.startswith("127.0.0.1:")
        assert not s.operator_address.endswith(":0")

    registry = NetnsRegistry("cilia-tk-")
    registry.remove_stale()
    try:
        for s in (a, b):
            conflist = s.agent.conflist()
            pods = [cni.Pod(name=registry.name(f"{s.slot}-{i}")) for i in range(2)]
            for pod in pods:
                pod.create_netns()
                registry.adopt(pod.name)
                outcome = pod.add(conflist)
                assert outcome.returncode == 0, f"{outcome.stdout}\n{s.logs()}"
                assert ipaddress.ip_address(pod.ip) in ipaddress.ip_network(s.pool_cidr)
            first, second = pods
            assert netns.ping(first.name, second.ip, count=2), s.logs()
            assert netns.ping(second.name, first.ip, count=2), s.logs()
            status = s.agent_cli("status")
            assert status.returncode == 0, status.stderr
            for pod in pods:
                assert pod.delete(conflist).returncode == 0
    finally:
        registry.cleanup()
