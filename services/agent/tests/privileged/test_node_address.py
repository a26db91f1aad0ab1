"""The node address and MTU the agent detects (``datapath/nodeaddress.py``), in a network
namespace shaped like a Docker host: a ``docker0`` bridge (172.17.0.1/16) created first, so
the kernel lists its address first, and ``eth0`` (MTU 1400) carrying the default route.

The detection runs in the namespace through ``ip netns exec`` (a child process), exactly as
``read_node_networks`` runs in the agent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cilia_agent.config import Config

from .conftest import Env, sh

DOCKER0, ETH0, GATEWAY = "172.17.0.1", "192.0.2.10", "192.0.2.1"
DEVICE_MTU = 1400

_PROBE = """
import json, sys
from cilia_agent.controlplane.operator import read_node_networks
nets = read_node_networks((), ("lxc", "cilia_"), sys.argv[1])
print(json.dumps({"addresses": nets.addresses, "device": nets.device, "mtu": nets.mtu}))
"""


@pytest.fixture
def docker_host(env: Env) -> Iterator[str]:
    """A netns with docker0 (first) and eth0 (MTU 1400, default route); its name."""
    name = env.add_netns().rsplit("/", 1)[1]

    def ns(*argv: str) -> None:
        sh("ip", "-n", name, *argv)

    ns("link", "add", "docker0", "type", "bridge")
    ns("addr", "add", f"{DOCKER0}/16", "dev", "docker0")
    ns("link", "add", "eth0", "mtu", str(DEVICE_MTU), "type", "veth", "peer", "name", "eth0p")
    ns("addr", "add", f"{ETH0}/24", "dev", "eth0")
    for dev in ("lo", "docker0", "eth0", "eth0p"):
        ns("link", "set", dev, "up")
    ns("route", "add", "default", "via", GATEWAY, "dev", "eth0")
    yield name


def _detect(netns: str, ipv4_node: str = "auto") -> dict[str, object]:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", _PROBE, ipv4_node],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_netlink_lists_docker0_first_but_the_node_address_is_the_default_routes(
    docker_host: str,
) -> None:
    listed = sh("ip", "-n", docker_host, "-4", "-j", "addr", "show", "scope", "global")
    in_kernel_order = [a["local"] for link in json.loads(listed) for a in link["addr_info"]]
    assert in_kernel_order[0] == DOCKER0  # the trap the old "first address" rule fell into
    got = _detect(docker_host)
    assert got["addresses"] == [ETH0, DOCKER0]
    assert (got["device"], got["mtu"]) == ("eth0", DEVICE_MTU)


def test_ipv4_node_overrides_the_detection_and_its_device_gives_the_mtu(docker_host: str) -> None:
    got = _detect(docker_host, DOCKER0)
    assert got["addresses"] == [DOCKER0, ETH0]
    assert got["device"] == "docker0" and got["mtu"] == 1500


def test_without_a_default_route_the_lowest_numbered_interface_address_is_taken(
    docker_host: str,
) -> None:
    sh("ip", "-n", docker_host, "route", "del", "default")
    assert _detect(docker_host)["addresses"] == [DOCKER0, ETH0]


@pytest.mark.parametrize(("mode", "pods"), [("native", 1400), ("tunnel", 1350)])
def test_mtu_0_gives_pods_the_detected_device_mtu_minus_the_tunnel_overhead(
    docker_host: str, mode: str, pods: int
) -> None:
    detected = _detect(docker_host)["mtu"]
    assert isinstance(detected, int)
    assert Config(mtu=0, routing_mode=mode).pod_mtu(detected) == pods  # type: ignore[arg-type]
    # an explicit --mtu wins over the device
    assert Config(mtu=9000, routing_mode=mode).pod_mtu(detected) == 9000 - (1400 - pods)  # type: ignore[arg-type]
