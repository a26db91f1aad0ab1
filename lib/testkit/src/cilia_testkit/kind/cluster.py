"""The kind-style cluster: its lifecycle and what tests do with it (see the package docstring).

State of a cluster lives in ``.run/k8s/<name>/`` (``state.json``: network id, container ids,
nodes, loaded images; ``kubeconfig`` for the host; ``pki/``; ``nodes/<node>/conf`` and
``nodes/<node>/log`` (each node's ``/etc/cilia-node`` and ``/var/log/cilia-node``);
``images/`` (tarballs imported into the nodes)). :meth:`KindCluster.down` removes exactly the
containers, anonymous volumes and network recorded there, then the directory.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import ipaddress
import json
import os
import pathlib
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from cilia_testkit import ROOT
from cilia_testkit.kind import coredns, image, refcni
from cilia_testkit.kind.api import ClusterAPI, KindError, parse_time
from cilia_testkit.kind.controlplane import API_PORT, kubernetes_service_ip, write_control_plane
from cilia_testkit.kind.docker import docker, docker_missing
from cilia_testkit.kind.network import (
    OUTSIDE_HOST,
    NetworkError,
    create_network,
    outside_node,
    start_outside,
)
from cilia_testkit.kind.node import (
    CLUSTER_LABEL,
    Node,
    import_image,
    node_exec,
    run_args,
    wait_containerd,
    write_node_config,
)
from cilia_testkit.kind.pki import ClusterPKI
from cilia_testkit.kubeapi import binary_missing, default_bin_dir

#: Where cluster state directories live (``.run/k8s/<name>``).
STATE_ROOT = ROOT / ".run" / "k8s"
#: The pod CIDR kube-controller-manager hands node podCIDRs from (kind's default).
DEFAULT_POD_CIDR = "10.244.0.0/16"
#: The Service ClusterIP range (kind's default); the API server's Service is its first address.
DEFAULT_SERVICE_CIDR = "10.96.0.0/16"
#: Prefix length of each node's podCIDR.
DEFAULT_NODE_CIDR_MASK = 24

_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")


def _say(msg: str) -> None:
    print(f"[kind] {msg}", file=sys.stderr, flush=True)


def missing() -> str | None:
    """Why a cluster cannot be made here (a skip reason), or None: no Docker engine, not root,
    a control-plane/node binary not built (scripts/kube-tools.sh, scripts/kubelet-tools.sh) or
    CoreDNS not built (scripts/coredns.sh)."""
    reason = docker_missing()
    if reason:
        return reason
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler",
                 "kubectl", "kubelet", "testpod"):  # fmt: skip
        reason = binary_missing(name)
        if reason:
            return reason
    coredns_bin = image.coredns_bin_dir() / "coredns"
    if not os.access(coredns_bin, os.X_OK):
        marker = coredns_bin.with_name("coredns.unavailable")
        if marker.exists():
            return marker.read_text().strip()
        return "coredns is not built: run scripts/coredns.sh (make test-setup does)"
    return None


class KindCluster(ClusterAPI):
    """A multi-node Kubernetes cluster of node containers; a context manager (``up`` on
    enter, ``down`` on exit, also on SIGTERM while entered in the main thread).

    Args:
        name: the cluster's name (DNS label, ≤ 32 chars): prefix of its containers and its
            Docker network, its state directory ``.run/k8s/<name>``.
        nodes: nodes at start (≥ 1); the first runs the control plane (untainted).
        pod_cidr: the cluster CIDR kube-controller-manager allocates podCIDRs from.
        service_cidr: the Service ClusterIP range.
        node_cidr_mask: prefix length of each node's podCIDR.
        cni: None (no CNI: Nodes stay NotReady, pods Pending — what a Cilia install starts
            from) or ``"reference"`` (:mod:`cilia_testkit.kind.refcni`).
        dns: deploy CoreDNS (:mod:`cilia_testkit.kind.coredns`).
        state_root: parent of the state directory.
        progress: receives one line per step.

    Raises:
        ValueError: a bad name, node count or CIDR (nothing created).
    """

    def __init__(
        self,
        name: str = "cilia",
        nodes: int = 3,
        *,
        pod_cidr: str = DEFAULT_POD_CIDR,
        service_cidr: str = DEFAULT_SERVICE_CIDR,
        node_cidr_mask: int = DEFAULT_NODE_CIDR_MASK,
        cni: str | None = None,
        dns: bool = True,
        state_root: pathlib.Path = STATE_ROOT,
        progress: Callable[[str], None] = _say,
    ) -> None:
        if not _NAME.match(name):
            raise ValueError(f"cluster name {name!r}: a DNS label of at most 32 characters")
        if nodes < 1:
            raise ValueError(f"nodes={nodes}: at least 1")
        pods, services = ipaddress.ip_network(pod_cidr), ipaddress.ip_network(service_cidr)
        if pods.version != 4 or services.version != 4:
            raise ValueError(f"IPv4 CIDRs only (pods {pod_cidr}, services {service_cidr})")
        if pods.overlaps(services):
            raise ValueError(f"pod CIDR {pod_cidr} overlaps service CIDR {service_cidr}")
        if not pods.prefixlen < node_cidr_mask <= 30:
            raise ValueError(f"node CIDR mask /{node_cidr_mask} must lie in ({pod_cidr}, /30]")
        if cni not in (None, "reference"):
            raise ValueError(f"cni={cni!r}: None or 'reference'")
        self.name = name
        self.initial_nodes = nodes
        self.pod_cidr, self.service_cidr, self.node_cidr_mask = (
            pod_cidr,
            service_cidr,
            node_cidr_mask,
        )
        self.cni, self.dns = cni, dns
        self.state_dir = state_root / name
        self.progress = progress
        self.nodes: list[Node] = []
        self.outside: Node | None = None
        self.network_id = ""
        #: a network was asked for (its id may not have reached us: see down())
        self.network_requested = False
        self.subnet = ""
        self.loaded_images: list[str] = []
        #: Seconds each phase of :meth:`up` took (``images``, ``nodes``, ``api``, ``registered``,
        #: ``dns``, ``cni``, ``total``).
        self.timings: dict[str, float] = {}
        self._lock = threading.Lock()
        self._old_sigterm: Any = None

    # ------------------------------------------------------------------ attributes
    @property
    def kubeconfig(self) -> pathlib.Path:
        """The admin kubeconfig for the host (``https://<control-plane IP>:6443``)."""
        return self.state_dir / "kubeconfig"

    @property
    def control_plane(self) -> Node:
        """The control-plane node (the first)."""
        return self.nodes[0]

    @property
    def api_server(self) -> str:
        """``host:port`` of the API server as nodes (and the host) reach it: the control-plane
        node's address and :data:`API_PORT` (what ``k8sServiceHost/Port`` point at)."""
        return f"{self.control_plane.ip}:{API_PORT}"

    @property
    def dns_ip(self) -> str:
        """The ClusterIP of Service ``kube-system/kube-dns`` (the kubelets' ``clusterDNS``):
        the tenth address of the service range, as kubeadm picks it."""
        return str(ipaddress.ip_network(self.service_cidr)[10])

    @property
    def images_dir(self) -> pathlib.Path:
        """The host directory of image tarballs, mounted read-only in every node."""
        return self.state_dir / "images"

    def node(self, name: str) -> Node:
        """The node called ``name``.

        Raises:
            KeyError: no such node in this cluster.
        """
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in cluster {self.name} ({[n.name for n in self.nodes]})")

    # ------------------------------------------------------------------ state
    def _save(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "name": self.name, "pod_cidr": self.pod_cidr, "service_cidr": self.service_cidr,
            "node_cidr_mask": self.node_cidr_mask, "cni": self.cni, "dns": self.dns,
            "network_id": self.network_id, "network_requested": self.network_requested,
            "subnet": self.subnet,
            "nodes": [vars(n) for n in self.nodes],
            "outside": vars(self.outside) if self.outside else None,
            "loaded_images": self.loaded_images, "timings": self.timings,
        }  # fmt: skip
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / "state.json")

    @classmethod
    def load(
        cls,
        name: str = "cilia",
        state_root: pathlib.Path = STATE_ROOT,
        progress: Callable[[str], None] = _say,
    ) -> KindCluster:
        """The cluster recorded in ``<state_root>/<name>/state.json`` (made by another process,
        e.g. ``make k8s-up``).

        Raises:
            FileNotFoundError: no such state.
        """
        state = json.loads((state_root / name / "state.json").read_text())
        cluster = cls(
            state["name"], max(1, len(state["nodes"])), pod_cidr=state["pod_cidr"],
            service_cidr=state["service_cidr"], node_cidr_mask=state["node_cidr_mask"],
            cni=state["cni"], dns=state["dns"], state_root=state_root, progress=progress,
        )  # fmt: skip
        cluster.network_id, cluster.subnet = state["network_id"], state["subnet"]
        cluster.network_requested = state.get("network_requested", bool(state["network_id"]))
        cluster.nodes = [Node(**n) for n in state["nodes"]]
        cluster.outside = Node(**state["outside"]) if state["outside"] else None
        cluster.loaded_images = state["loaded_images"]
        cluster.timings = state.get("timings", {})
        return cluster

    # ------------------------------------------------------------------ up
    def up(self) -> KindCluster:
        """Create the cluster (see the package docstring) and return once every Node is
        registered (and Ready with a CNI); a failed start is torn down (:meth:`down`).

        Raises:
            FileNotFoundError: a tool is not built (:func:`missing`'s reason).
            KindError: a step failed (log tails in the message); ``DockerError`` likewise.
        """
        reason = missing()
        if reason:
            raise FileNotFoundError(reason)
        if (self.state_dir / "state.json").exists():
            raise KindError(
                f"cluster {self.name} exists ({self.state_dir}); remove it first "
                f"(make k8s-down K8S_NAME={self.name})"
            )
        stale = _labelled("ps", "--all", "", self.name) + _labelled("network", "ls", "", self.name)
        if stale:
            raise KindError(
                f"containers/networks of an earlier cluster {self.name} are left (no state to "
                f"remove them by): {stale}; remove them with docker rm -f / docker network rm"
            )
        started = time.monotonic()
        try:
            self._up(started)
        except BaseException:
            self.progress(f"start failed; removing cluster {self.name}")
            self.down()
            raise
        return self

    def _phase(self, name: str, since: float) -> float:
        now = time.monotonic()
        self.timings[name] = round(now - since, 2)
        return now

    def _up(self, started: float) -> None:
        self.state_dir.mkdir(parents=True)
        self._save()
        node_img = image.ensure_node_image(self.progress)
        dns_img = image.ensure_coredns_image(self.progress) if self.dns else ""
        self.images_dir.mkdir(exist_ok=True)
        image.write_sandbox_image(self.images_dir / "sandbox.tar")
        t = self._phase("images", started)
        self._create_network()
        hosts = list(ipaddress.ip_network(self.subnet).hosts())
        cp = Node(f"{self.name}-control-plane", str(hosts[1]), role="control-plane")
        self.pki = ClusterPKI(
            self.state_dir / "pki",
            api_ips=(cp.ip, kubernetes_service_ip(self.service_cidr), "127.0.0.1"),
            api_names=(cp.name,),
        )
        self.kubeconfig.write_text(self.pki.admin_kubeconfig(f"https://{cp.ip}:{API_PORT}"))
        self.kubeconfig.chmod(0o600)
        self._start_node(cp, node_img)
        for _ in range(1, self.initial_nodes):
            self._start_node(self._next_node(), node_img)
        self._start_outside()
        self._parallel(self._prepare_node, self.nodes)
        t = self._phase("nodes", t)
        self._wait_api()
        t = self._phase("api", t)
        self.wait_registered()
        t = self._phase("registered", t)
        if self.dns:
            self.load_images([dns_img])
            host, port = self.api_server.split(":")
            self.kubectl("apply", "-f", "-",
                         input=coredns.manifests(dns_img, self.dns_ip, host, int(port)))  # fmt: skip
            t = self._phase("dns", t)
        if self.cni == "reference":
            self.install_reference_cni()
            self.wait_ready()
            t = self._phase("cni", t)
        self.timings["total"] = round(time.monotonic() - started, 2)
        self._save()
        self.progress(
            f"cluster {self.name} up in {self.timings['total']:.1f} s: {len(self.nodes)} nodes, "
            f"API {self.api_server}, kubeconfig {self.kubeconfig}"
        )

    def _create_network(self) -> None:
        self.network_requested = True
        self._save()
        try:
            self.network_id, self.subnet = create_network(
                self.name, [self.pod_cidr, self.service_cidr]
            )
        except NetworkError as exc:
            raise KindError(str(exc)) from exc
        self._save()
        self.progress(f"network {self.name} {self.subnet}")

    def _next_node(self) -> Node:
        used = {n.ip for n in self.nodes}
        hosts = list(ipaddress.ip_network(self.subnet).hosts())
        ip = next(str(h) for h in hosts[1 : OUTSIDE_HOST - 1] if str(h) not in used)
        names = {n.name for n in self.nodes}
        n = 1
        while (name := f"{self.name}-worker{'' if n == 1 else n}") in names:
            n += 1
        return Node(name, ip)

    def _start_node(self, node: Node, node_img: str) -> None:
        extra = None
        if node.role == "control-plane":
            extra = write_control_plane(
                self.state_dir, node, self.pki, pod_cidr=self.pod_cidr,
                service_cidr=self.service_cidr, node_cidr_mask=self.node_cidr_mask,
            )  # fmt: skip
        write_node_config(
            self.state_dir, node, self.pki, api_server=f"{self.nodes[0].ip if self.nodes else node.ip}:{API_PORT}",
            cluster_dns=self.dns_ip, extra_services=extra,
        )  # fmt: skip
        args = run_args(
            node, cluster=self.name, network=self.name, image=node_img, state_dir=self.state_dir,
            images_dir=self.images_dir,
            kube_bin=default_bin_dir() if node.role == "control-plane" else None,
        )  # fmt: skip
        with self._lock:
            self.nodes.append(node)
        self._save()  # before the run: a start cut short is still found by down()
        node.container_id = docker(*args).stdout.strip()
        self._save()
        self.progress(
            f"node {node.name} {node.ip} ({node.role}) container {node.container_id[:12]}"
        )

    def _start_outside(self) -> None:
        self.outside = outside_node(self.name, self.subnet)
        self._save()
        start_outside(self.outside, self.name)
        self._save()

    def _prepare_node(self, node: Node) -> None:
        """containerd answers, then the sandbox image and every loaded image are imported."""
        wait_containerd(node, self.state_dir)
        import_image(node, "sandbox.tar")
        for tarball in self.loaded_images:
            import_image(node, tarball)

    def _parallel(self, fn: Callable[[Node], None], nodes: Iterable[Node]) -> None:
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            for future in [pool.submit(fn, n) for n in nodes]:
                future.result()

    # ------------------------------------------------------------------ queries (more: ClusterAPI)
    def exec(
        self,
        node: str | Node,
        *argv: str,
        check: bool = True,
        input: str | None = None,
        timeout: float = 60.0,
    ) -> str:
        """Run ``argv`` in a node container (or the outside host, by its name); its stdout.

        Raises:
            KeyError: unknown node. DockerError: non-zero exit with ``check``.
        """
        target = (
            node
            if isinstance(node, Node)
            else (self.outside if self.outside and node == self.outside.name else self.node(node))
        )
        assert target is not None
        return node_exec(target, *argv, check=check, input=input, timeout=timeout)

    def memory(self) -> dict[str, int]:
        """Memory in use by each container of the cluster (``docker stats``), bytes by name."""
        names = [n.name for n in self.nodes] + ([self.outside.name] if self.outside else [])
        out = docker("stats", "--no-stream", "--format", "{{.Name}} {{.MemUsage}}", *names).stdout
        units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
        result = {}
        for line in out.splitlines():
            name, usage = line.split(" ", 1)
            m = re.match(r"([\d.]+)([KMG]?i?B)", usage)
            if m:
                result[name] = int(float(m.group(1)) * units.get(m.group(2), 1))
        return result

    # ------------------------------------------------------------------ images, CNI
    def load_images(self, names: Iterable[str]) -> None:
        """Import local Docker images into every node's containerd (``docker save`` once into
        the images directory, ``ctr -n k8s.io images import`` in each node); nodes added later
        get them too. Pods name them as Docker does (``cilia-agent:0.1.0``).

        Raises:
            DockerError: an image does not exist locally, or an import failed.
        """
        names = list(names)
        if not names:
            return
        tarball = re.sub(r"[^A-Za-z0-9_.-]", "_", "+".join(names))[:180] + ".tar"
        self.images_dir.mkdir(parents=True, exist_ok=True)
        docker("save", "--output", str(self.images_dir / tarball), *names, timeout=600)
        self._parallel(lambda n: import_image(n, tarball), self.nodes)
        if tarball not in self.loaded_images:
            self.loaded_images.append(tarball)
        self._save()

    def install_reference_cni(self, nodes: Iterable[Node] | None = None) -> None:
        """Install the reference CNI on ``nodes`` (default: all) and the pod-CIDR routes on
        every node: :func:`cilia_testkit.kind.refcni.install`.

        Raises:
            KindError: a Node got no podCIDR in time.
        """
        refcni.install(self, list(nodes) if nodes is not None else self.nodes)

    def apply_routes(self) -> None:
        """On every node, a route to each other node's podCIDR via that node (reference CNI):
        :func:`cilia_testkit.kind.refcni.apply_routes`."""
        refcni.apply_routes(self, refcni.pod_cidrs(self))

    # ------------------------------------------------------------------ lifecycle
    def add_node(self) -> Node:
        """Add a worker to the running cluster: its container, the sandbox and loaded images,
        its Node registered (and Ready, with the reference CNI installed, under a CNI).

        Raises:
            KindError / DockerError / NodeError: a step failed (the node is removed again).
        """
        node = self._next_node()
        self.pki = ClusterPKI(self.state_dir / "pki")
        try:
            self._start_node(node, image.node_image())
            self._prepare_node(node)
            self.wait_registered([node.name])
            if self.cni == "reference":
                self.install_reference_cni([node])
                self.wait_ready([node.name])
        except BaseException:
            self.delete_node(node.name)
            raise
        return node

    def stop_node(self, name: str) -> None:
        """``docker stop`` a node (SIGTERM to its services, SIGKILL after 10 s)."""
        docker("stop", self.node(name).container_id, timeout=60)

    def start_node(self, name: str, wait: bool = True) -> None:
        """``docker start`` a stopped node; its entrypoint brings containerd and the kubelet
        (and the control plane) back. With the reference CNI the routes are written again.
        With ``wait``: until containerd answers and (under a CNI) the Node is Ready again."""
        node = self.node(name)
        docker("start", node.container_id)
        if not wait:
            return
        started = docker("inspect", "--format={{.State.StartedAt}}", node.container_id).stdout
        since = parse_time(started) or datetime.datetime.now(datetime.UTC)
        wait_containerd(node, self.state_dir)
        if node.role == "control-plane":
            self._wait_api()
        if self.cni == "reference":
            self.apply_routes()
            self.wait_ready([name])
        self._wait_heartbeat(name, since)

    def restart_node(self, name: str, wait: bool = True) -> None:
        """Stop and start a node container (a node reboot: new network namespace, pods'
        sandboxes recreated by the kubelet); see :meth:`start_node`."""
        self.stop_node(name)
        self.start_node(name, wait=wait)

    def delete_node(self, name: str) -> None:
        """Remove a worker: its Node object, its container (and anonymous volume), its routes
        on the other nodes (reference CNI).

        Raises:
            KindError: it is the control-plane node.
        """
        node = self.node(name)
        if node.role == "control-plane":
            raise KindError("the control-plane node cannot be deleted (down the cluster)")
        cidr = (self.node_objects().get(name, {}).get("spec") or {}).get("podCIDR")
        self.kubectl("delete", "node", name, "--ignore-not-found", "--wait=false", check=False)
        if node.container_id:
            docker("rm", "--force", "--volumes", node.container_id, check=False, timeout=60)
        with self._lock:
            self.nodes.remove(node)
        self._save()
        if cidr and self.cni == "reference":
            for other in self.nodes:
                self.exec(other, "ip", "route", "del", cidr, check=False)

    def down(self) -> None:
        """Remove every container (with its anonymous volumes) and the network recorded for
        this cluster, then its state directory. Idempotent; never raises for what is gone."""
        ids = []
        for node in [*self.nodes, *([self.outside] if self.outside else [])]:
            # a start cut short (SIGTERM during `docker run`): the engine may have made the
            # container without the id reaching us; it has the recorded name and our label
            ids += [node.container_id] if node.container_id else _labelled(
                "ps", "--all", node.name, self.name)  # fmt: skip
        if ids:
            docker("rm", "--force", "--volumes", *ids, check=False, timeout=120)
        networks = [self.network_id] if self.network_id else []
        if not networks and self.network_requested:
            networks = _labelled("network", "ls", self.name, self.name)
        for network in networks:
            docker("network", "rm", network, check=False)
        # node services wrote root-owned files into bind-mounted directories: plain removal
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self.nodes, self.outside, self.network_id, self.network_requested = [], None, "", False

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> KindCluster:
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm)
        try:
            return self.up()
        except BaseException:
            self._restore_sigterm()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        finally:
            self._restore_sigterm()

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


def _sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM while a cluster is entered: unwind (``__exit__`` removes the cluster)."""
    raise SystemExit(128 + signum)


def _labelled(kind: str, verb: str, name: str, cluster: str) -> list[str]:
    """Ids of containers (``ps --all``) or networks (``network ls``) carrying this cluster's
    label, named exactly ``name`` when given."""
    filters = [f"--filter=label={CLUSTER_LABEL}={cluster}"]
    if name:
        filters.append(f"--filter=name=^/?{re.escape(name)}$")
    got = docker(kind, verb, "--quiet", *filters, check=False)
    return got.stdout.split() if got.returncode == 0 else []
