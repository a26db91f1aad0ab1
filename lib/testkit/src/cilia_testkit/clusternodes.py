"""The addressing plan and the members of a :class:`cilia_testkit.cluster.Cluster`: the LAN of
a slot (198.18.<slot>.0/24, :func:`lan_network`), the netns names (:func:`netns_prefix`), node
names, the fixed host numbers and ports, and the two kinds of member: a :class:`Node` (a netns
with its own agent) and the :class:`OutsideHost` of masquerade tests."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import string
import subprocess
from typing import Literal

from cilia_testkit.host import sh
from cilia_testkit.netns import NETNS_DIR
from cilia_testkit.stack import Agent, StackError

RoutingMode = Literal["native", "tunnel"]
ROUTING_MODES: tuple[RoutingMode, ...] = ("native", "tunnel")

#: The clusters' LAN range (RFC 2544): slot S uses ``198.18.S.0/24``.
LAN_RANGE = ipaddress.IPv4Network("198.18.0.0/15")
#: Host part of the bridge's address, and of node i's address (``NODE_HOST_BASE + i``).
BRIDGE_HOST = 1
NODE_HOST_BASE = 10
#: The agents' Hubble TCP port and metrics port inside each node's netns (the defaults: each
#: node has a network namespace of its own).
HUBBLE_PORT = 4244
METRICS_PORT = 9962
#: Host part of the outside host's address (:meth:`Cluster.add_outside_host`).
OUTSIDE_HOST = 250
#: Routing protocol of the routes an agent installs to other nodes' pod CIDRs (``proto 0xc1``).
RTPROT_CILIA = 0xC1
#: Seconds a single ``cilia-operator``/``ip`` command of the cluster may take.
COMMAND_SECONDS = 30.0
#: Default MTU of the LAN (bridge, veths) and the agents' ``--mtu``.
DEFAULT_MTU = 1500


class ClusterError(StackError):
    """A cluster operation failed (a node could not be created, joined or removed)."""


def lan_network(slot: int) -> ipaddress.IPv4Network:
    """The LAN of the cluster in stack slot ``slot`` (``198.18.<slot>.0/24``).

    Raises:
        ValueError: ``slot`` is outside 0..255.
    """
    if not 0 <= slot <= 255:
        raise ValueError(f"slot {slot} has no LAN in {LAN_RANGE}")
    return ipaddress.IPv4Network(f"198.18.{slot}.0/24")


def netns_prefix(slot: int) -> str:
    """Prefix of every netns (nodes and pods) of the cluster in ``slot``: ``cilia-cl<slot>-``."""
    return f"cilia-cl{slot}-"


def node_letter_name(index: int) -> str:
    """Default node names: ``node-a``, ``node-b`` … ``node-z``, then ``node-<index>``."""
    letters = string.ascii_lowercase
    return f"node-{letters[index]}" if index < len(letters) else f"node-{index}"


@dataclasses.dataclass
class Node:
    """One node of a :class:`Cluster`: a netns, its LAN veth and its agent.

    Attributes:
        name: the node name (``--node-name``; the operator's CiliumNode name).
        index: position in the cluster (the address is ``198.18.<slot>.<10+index>``).
        netns: the node's network namespace name.
        interfaces: addresses on its LAN interface ``eth0`` as ``a.b.c.d/len``, first one first
            (the agent registers the first as the node's address).
        veth: the host end of its LAN veth (a port of the bridge).
        agent: its :class:`~cilia_testkit.stack.Agent` (socket, state, pins, process).
        removed: :meth:`Cluster.remove_node` ran.
    """

    name: str
    index: int
    netns: str
    interfaces: tuple[str, ...]
    veth: str
    agent: Agent
    removed: bool = False

    @property
    def address(self) -> str:
        """The node's first address (no prefix length)."""
        return self.interfaces[0].split("/")[0]

    def ip(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ip -n <netns> ARGV``.

        Raises:
            subprocess.CalledProcessError: it failed and ``check``.
        """
        return sh("ip", "-n", self.netns, *argv, check=check, timeout=COMMAND_SECONDS)

    def exec(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the node's network namespace (``nsenter --net``; the host's mounts).

        Raises:
            subprocess.CalledProcessError: it failed and ``check``.
        """
        return sh(
            "nsenter",
            f"--net={NETNS_DIR / self.netns}",
            "--",
            *argv,
            check=check,
            timeout=COMMAND_SECONDS,
        )

    def pod_routes(self) -> dict[str, dict[str, str]]:
        """Routes this node's agent installed to other nodes' pod CIDRs (``proto 0xc1``):
        ``{"10.212.1.0/24": {"gateway": "198.18.2.11", "dev": "eth0"}}``."""
        out = self.ip("-j", "route", "show", "proto", str(RTPROT_CILIA), check=False)
        if out.returncode != 0 or not out.stdout.strip():
            return {}
        routes: dict[str, dict[str, str]] = {}
        for route in json.loads(out.stdout):
            routes[str(route["dst"])] = {
                "gateway": str(route.get("gateway", "")),
                "dev": str(route.get("dev", "")),
            }
        return routes

    def link_mtu(self, ifname: str) -> int:
        """MTU of ``ifname`` in the node's netns (0 when it does not exist)."""
        out = self.ip("-j", "link", "show", "dev", ifname, check=False)
        if out.returncode != 0:
            return 0
        return int(json.loads(out.stdout)[0]["mtu"])


@dataclasses.dataclass(frozen=True)
class OutsideHost:
    """The cluster's "internet" (:meth:`Cluster.add_outside_host`).

    Attributes:
        name: its short name.
        netns: its network namespace.
        address: its LAN address (no route back to any pod CIDR).
        veth: the host end of its LAN veth (a port of the bridge).
    """

    name: str
    netns: str
    address: str
    veth: str
