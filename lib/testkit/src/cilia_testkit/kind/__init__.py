"""A real multi-node Kubernetes cluster on this machine, built the way kind builds one.

Each node is a container of the project's node image ``cilia-node:<k8s version>``
(:mod:`~cilia_testkit.kind.image`): containerd + runc + the kubelet (built from the Go module
proxy) on the Debian base. The first node also runs the control plane as supervised
processes (:mod:`~cilia_testkit.kind.controlplane`: etcd, kube-apiserver,
kube-controller-manager with ``--allocate-node-cidrs``, kube-scheduler); every node,
the first included (untainted), runs containerd + the kubelet registered with its container
address as InternalIP. **kube-proxy is not deployed.** CoreDNS (built from the Go module
proxy) is the cluster DNS (:mod:`~cilia_testkit.kind.coredns`). Nodes share a Docker bridge
network of their own (a free /24 of 172.30.0.0/16); an **outside** host on the same bridge
has no route to any pod CIDR and runs an echo service that reports the peer address it sees
(:mod:`~cilia_testkit.kind.outside_echo`). No CNI is installed unless asked: with
``cni="reference"`` Debian's bridge + host-local plugins and routes between nodes
(:mod:`~cilia_testkit.kind.refcni`) make pods work without Cilia.

::

    with KindCluster("t1", nodes=3, cni="reference") as c:
        c.kubeconfig              # host path of the admin kubeconfig
        c.api_server              # "172.30.0.2:6443": how nodes (and the host) reach the API
        c.nodes                   # [Node(name, ip, container_id, role), ...]
        c.outside                 # Node(name, ip, ...) of the outside host
        c.load_images(["cilia-agent:0.1.0"])
        c.exec("t1-worker", "ip", "route")
        c.kubectl("get", "pods", "-A")
        n = c.add_node(); c.restart_node(n.name); c.delete_node(n.name)

Command line (``make k8s-up NODES=3`` / ``make k8s-status`` / ``make k8s-down``)::

    python -m cilia_testkit.kind up|down|status|add-node|restart-node|delete-node|load ...

pytest: the ``kind_cluster`` fixture factory (:mod:`cilia_testkit.plugin`).
"""

from __future__ import annotations

from cilia_testkit.kind.api import KindError
from cilia_testkit.kind.cluster import (
    DEFAULT_POD_CIDR,
    DEFAULT_SERVICE_CIDR,
    STATE_ROOT,
    KindCluster,
    missing,
)
from cilia_testkit.kind.controlplane import API_PORT
from cilia_testkit.kind.docker import DockerError
from cilia_testkit.kind.image import SANDBOX_IMAGE
from cilia_testkit.kind.node import Node, NodeError

__all__ = [
    "API_PORT", "DEFAULT_POD_CIDR", "DEFAULT_SERVICE_CIDR", "SANDBOX_IMAGE", "STATE_ROOT",
    "DockerError", "KindCluster", "KindError", "Node", "NodeError", "missing",
]  # fmt: skip
