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

#: The conflist's file name in /etc/cni/net.d (the only one: containerd reads one).
CONFLIST = "10-reference.conflist"


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
