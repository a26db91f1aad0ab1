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
