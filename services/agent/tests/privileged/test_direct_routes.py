"""``--auto-direct-node-routes`` in native routing (``datapath/routing.py`` NativeRouting): with
it, a route to each other node's pod CIDRs via that node's address; without it none, and the
routes an earlier run installed are withdrawn (the network's routers carry pod CIDRs, as in
upstream's native routing without direct routes).

The sync runs in a network namespace through ``ip netns exec`` (a child process), with a LAN
veth on 192.0.2.0/24 where the other node is 192.0.2.20.
"""

from __future__ import annotations

import subprocess
import sys

from .conftest import Env, sh

_SYNC = """
import sys
from cilia_agent.datapath.routing import NativeRouting, RemoteNode
routing = NativeRouting(lambda: ["10.1.0.0/24"], direct=sys.argv[1] == "true")
print(routing.sync([RemoteNode("node-b", "192.0.2.20", ("10.1.1.0/24", "10.1.2.0/24"))]))
"""


def _sync(netns: str, direct: bool) -> str:
    return subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", _SYNC, str(direct).lower()],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip


def _cilia_routes(netns: str) -> list[str]:
    out = subprocess.run(["ip", "-n", netns, "-4", "route", "show", "proto", "0xc1"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return sorted(line.split(" proto")[0].strip() for line in out.splitlines() if line.strip())


def test_direct_routes_only_with_auto_direct_node_routes_and_withdrawn_without(env: Env) -> None:
    name = env.add_netns().rsplit("/", 1)[1]
    sh("ip", "-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p")
    sh("ip", "-n", name, "addr", "add", "192.0.2.10/24", "dev", "eth0")
    for dev in ("lo", "eth0", "eth0p"):
        sh("ip", "-n", name, "link", "set", dev, "up")

    assert _sync(name, direct=False) == "[]"
    assert _cilia_routes(name) == []

    assert _sync(name, direct=True) == "[]"
    assert _cilia_routes(name) == [
        "10.1.1.0/24 via 192.0.2.20 dev eth0",
        "10.1.2.0/24 via 192.0.2.20 dev eth0",
    ]

    assert _sync(name, direct=False) == "[]"
    assert _cilia_routes(name) == []


_SYNC_TWO = """
from cilia_agent.datapath.routing import NativeRouting, RemoteNode
routing = NativeRouting(lambda: ["10.1.0.0/24"], direct=True)
print("\\n".join(routing.sync([
    RemoteNode("node-b", "192.0.2.20", ("10.1.1.0/24",)),
    RemoteNode("node-c", "198.51.100.30", ("10.1.3.0/24",)),
])))
"""


def test_two_nics_pod_network_on_the_second_and_a_node_on_another_subnet_via_the_gateway(
    env: Env,
) -> None:
    """A node with two NICs: eth0 (10.99.0.0/24, the default route's) and eth1 (192.0.2.0/24,
    the network the nodes' InternalIPs are on). A peer registered as 192.0.2.20 gets a direct
    route through eth1, so its pods are reached over the second NIC; a peer on another
    subnet (198.51.100.30, no shared L2) gets no direct route (reported, as upstream's
    auto-direct-node-routes skips it) and its pods are reached through the default gateway."""
    name = env.add_netns().rsplit("/", 1)[1]
    for dev, addr in (("eth0", "10.99.0.10/24"), ("eth1", "192.0.2.10/24")):
        sh("ip", "-n", name, "link", "add", dev, "type", "veth", "peer", "name", f"{dev}p")
        sh("ip", "-n", name, "addr", "add", addr, "dev", dev)
        sh("ip", "-n", name, "link", "set", dev, "up")
        sh("ip", "-n", name, "link", "set", f"{dev}p", "up")
    sh("ip", "-n", name, "link", "set", "lo", "up")
    sh("ip", "-n", name, "route", "add", "default", "via", "10.99.0.1", "dev", "eth0")

    out = subprocess.run(
        ["ip", "netns", "exec", name, sys.executable, "-c", _SYNC_TWO],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    assert "node-c" in out and "198.51.100.30" in out and "node-b" not in out, out
    assert _cilia_routes(name) == ["10.1.1.0/24 via 192.0.2.20 dev eth1"]

    def route_get(ip: str) -> str:
        return sh("ip", "-n", name, "-4", "route", "get", ip).split(" uid")[0].strip()

    assert route_get("10.1.1.7").startswith("10.1.1.7 via 192.0.2.20 dev eth1 src 192.0.2.10")
    assert route_get("10.1.3.7").startswith("10.1.3.7 via 10.99.0.1 dev eth0 src 10.99.0.10")
