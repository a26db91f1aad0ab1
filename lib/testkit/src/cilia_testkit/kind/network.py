"""The cluster's network: a Docker bridge network of its own (the first /24 of
:data:`NETWORK_POOL` that overlaps no route of the machine, no other Docker network and
neither the pod nor the Service CIDR), and the **outside** host on it — a container of the
Debian base running :mod:`cilia_testkit.kind.outside_echo`, with only the bridge's default
route (none to any pod CIDR): it stands for the internet.
"""

from __future__ import annotations

import ipaddress
import json
import pathlib
import subprocess
from typing import Any

from cilia_testkit.kind.docker import docker, inspect
from cilia_testkit.kind.image import BASE_IMAGE
from cilia_testkit.kind.node import CLUSTER_LABEL, Node

#: The cluster network is the first free /24 of this range.
NETWORK_POOL = "172.30.0.0/16"
#: Host number of the outside host in the cluster network (nodes count up from 2).
OUTSIDE_HOST = 250
#: MTU of the cluster network's bridge (and so of the nodes' eth0).
NETWORK_MTU = 1500
#: The label naming a container's role (control-plane, worker, outside).
ROLE_LABEL = "io.cilia.kind.role"


class NetworkError(RuntimeError):
    """No network could be created (the engine's reason in the message)."""


def _host_routes() -> list[ipaddress.IPv4Network]:
    got = subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True,
                         text=True, check=False)  # fmt: skip
    try:
        routes: list[dict[str, Any]] = json.loads(got.stdout or "[]")
    except ValueError:
        return []
    out = []
    for r in routes:
        if r.get("type", "unicast") == "unicast" and r.get("dst") not in (None, "default"):
            out.append(ipaddress.IPv4Network(r["dst"], strict=False))
    return out


def _docker_subnets() -> list[ipaddress.IPv4Network]:
    out = []
    for net in docker("network", "ls", "--quiet").stdout.split():
        for cfg in ((inspect("network", net) or {}).get("IPAM") or {}).get("Config") or []:
            if cfg.get("Subnet") and ":" not in cfg["Subnet"]:
                out.append(ipaddress.IPv4Network(cfg["Subnet"], strict=False))
    return out


def create_network(name: str, avoid: list[str]) -> tuple[str, str]:
    """Create bridge network ``name`` (labelled with the cluster) on the first free /24;
    returns (network id, subnet). ``avoid``: CIDRs it must not overlap (pods, Services).

    Raises:
        NetworkError: no free /24, or the engine refused for another reason than overlap.
    """
    taken = _host_routes() + _docker_subnets() + [ipaddress.IPv4Network(c) for c in avoid]
    for candidate in ipaddress.IPv4Network(NETWORK_POOL).subnets(new_prefix=24):
        if any(candidate.overlaps(n) for n in taken):
            continue
        got = docker(
            "network", "create", "--driver=bridge", f"--subnet={candidate}",
            f"--gateway={candidate[1]}", f"--label={CLUSTER_LABEL}={name}",
            f"--opt=com.docker.network.driver.mtu={NETWORK_MTU}", name, check=False,
        )  # fmt: skip
        if got.returncode == 0:
            return got.stdout.strip(), str(candidate)
        if "overlap" not in got.stderr:  # another cluster took it meanwhile: try the next
            raise NetworkError(f"docker network create {name}: {got.stderr.strip()}")
    raise NetworkError(f"no free /24 in {NETWORK_POOL} for the cluster network")


def outside_node(cluster: str, subnet: str) -> Node:
    """The outside host's record: ``<cluster>-outside`` at host :data:`OUTSIDE_HOST` of
    ``subnet`` (no container yet)."""
    ip = str(list(ipaddress.IPv4Network(subnet).hosts())[OUTSIDE_HOST - 1])
    return Node(f"{cluster}-outside", ip, role="outside")


def start_outside(outside: Node, cluster: str) -> None:
    """Run the outside host's container on ``cluster``'s network; sets its container id."""
    script = pathlib.Path(__file__).with_name("outside_echo.py")
    outside.container_id = docker(
        "run", "--detach", f"--name={outside.name}", f"--hostname={outside.name}",
        f"--label={CLUSTER_LABEL}={cluster}", f"--label={ROLE_LABEL}=outside",
        f"--network={cluster}", f"--ip={outside.ip}",
        f"--volume={script}:/opt/outside_echo.py:ro", "--stop-timeout=2",
        BASE_IMAGE, "python3", "-u", "/opt/outside_echo.py",
    ).stdout.strip()  # fmt: skip
