"""The reference CNI of the kind-style cluster: what proves the harness without Cilia, and
the baseline for performance comparisons. On every node the harness writes
``/etc/cni/net.d/10-reference.conflist`` — Debian's ``bridge`` plugin (bridge ``cni0``, the
pods' gateway, hairpin, no masquerade) with ``host-local`` IPAM over the Node's
``spec.podCIDR`` (allocated by kube-controller-manager) and ``portmap`` — and on every node a
route to each other node's pod CIDR via that node's address (the nodes share one L2 bridge).
Routes live in the node's network namespace: a restarted node container gets them again from
the harness (:meth:`cilia_testkit.kind.KindCluster.restart_node`). The outside host gets no
route: pod traffic to it is not masqueraded, so its replies are lost (by design).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from cilia_testkit.kind.api import KindError
from cilia_testkit.kind.node import log_tail

if TYPE_CHECKING:
    from cilia_testkit.kind.cluster import KindCluster
    from cilia_testkit.kind.node import Node

#: The conflist's file name in /etc/cni/net.d (the only one: containerd reads one).
CONFLIST = "10-reference.conflist"
#: Seconds until kube-controller-manager has given each Node a podCIDR.
POD_CIDR_SECONDS = 60.0


def conflist(pod_cidr: str) -> str:
    """The bridge + host-local + portmap conflist for a node whose podCIDR is ``pod_cidr``."""
    return json.dumps(
        {
            "cniVersion": "0.4.0",
            "name": "reference",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        },
        indent=2,
    )


def route_script(routes: dict[str, str]) -> str:
    """A shell script adding ``ip route replace CIDR via IP`` for each pod CIDR → node IP."""
    return "".join(f"ip route replace {cidr} via {ip}\n" for cidr, ip in sorted(routes.items()))


def pod_cidrs(cluster: KindCluster, timeout: float = POD_CIDR_SECONDS) -> dict[str, str]:
    """Node name → ``spec.podCIDR`` once every node of ``cluster`` has one.

    Raises:
        cilia_testkit.kind.KindError: not in ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        objects = cluster.node_objects()
        cidrs = {n: (o.get("spec") or {}).get("podCIDR") or "" for n, o in objects.items()}
        if all(cidrs.get(n.name) for n in cluster.nodes):
            return {k: v for k, v in cidrs.items() if v}
        if time.monotonic() > deadline:
            cm = log_tail(cluster.state_dir, cluster.control_plane.name, "kube-controller-manager")
            raise KindError(f"podCIDRs not allocated in {timeout:g}s: {cidrs}\n{cm}")
        time.sleep(0.5)


def apply_routes(cluster: KindCluster, cidrs: dict[str, str]) -> None:
    """On every node, ``ip route replace`` each other node's podCIDR via that node."""
    for node in cluster.nodes:
        routes = {cidrs[o.name]: o.ip for o in cluster.nodes if o is not node and o.name in cidrs}
        if routes:
            cluster.exec(node, "sh", "-ec", route_script(routes))


def install(cluster: KindCluster, nodes: list[Node]) -> None:
    """Write the conflist (the node's own podCIDR) on ``nodes``, then every node's routes."""
    cidrs = pod_cidrs(cluster)
    for node in nodes:
        cluster.exec(
            node, "sh", "-c", f"cat > /etc/cni/net.d/{CONFLIST}", input=conflist(cidrs[node.name])
        )
    apply_routes(cluster, cidrs)
