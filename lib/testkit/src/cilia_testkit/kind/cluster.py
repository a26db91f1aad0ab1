"""The kind-style cluster: its lifecycle and what tests do with it (see the package docstring).

State of a cluster lives in ``.run/k8s/<name>/`` (``state.json``: network id, container ids,
nodes, loaded images; ``kubeconfig`` for the host; ``pki/``; ``nodes/<node>/conf`` and
``nodes/<node>/log`` (each node's ``/etc/cilia-node`` and ``/var/log/cilia-node``);
``images/`` (tarballs imported into the nodes)). :meth:`KindCluster.down` removes exactly the
containers, anonymous volumes and network recorded there, then the directory.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from cilia_testkit import ROOT
from cilia_testkit.kind import coredns, image, refcni
from cilia_testkit.kind.controlplane import API_PORT, kubernetes_service_ip, write_control_plane
from cilia_testkit.kind.docker import docker, docker_missing, inspect
from cilia_testkit.kind.node import (
    CLUSTER_LABEL,
    Node,
    import_image,
    log_tail,
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
#: The cluster network is the first free /24 of this range (no route or Docker network of
#: the machine overlapping it).
NETWORK_POOL = "172.30.0.0/16"
#: Host number of the outside host in the cluster network (nodes count up from 2).
OUTSIDE_HOST = 250
#: Seconds the API server may take to answer /readyz after its node starts.
API_READY_SECONDS = 120.0
#: Seconds until every node's kubelet has registered its Node.
NODE_REGISTER_SECONDS = 120.0
#: Seconds until the Nodes are Ready once a CNI is configured.
NODE_READY_SECONDS = 120.0
#: Seconds until kube-controller-manager has given each Node a podCIDR.
POD_CIDR_SECONDS = 60.0
#: Seconds one ``kubectl`` call may take.
KUBECTL_SECONDS = 60.0
#: The label of the outside host container (value: the cluster name) besides CLUSTER_LABEL.
ROLE_LABEL = "io.cilia.kind.role"

_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")


class KindError(RuntimeError):
    """The cluster could not be created or changed as asked (the message says why, with log
    tails of the node services involved)."""


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
    if not os.access(image.coredns_bin_dir() / "coredns", os.X_OK):
        return "coredns is not built: run scripts/coredns.sh (make test-setup does)"
    return None


class KindCluster:
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
        if pods.overlaps(services):
            raise ValueError(f"pod CIDR {pod_cidr} overlaps service CIDR {service_cidr}")
        if not pods.prefixlen < node_cidr_mask <= 30:
            raise ValueError(f"node CIDR mask /{node_cidr_mask} must lie in ({pod_cidr}, /30]")
        if cni not in (None, "reference"):
            raise ValueError(f"cni={cni!r}: None or 'reference'")
        self.name = name
        self.initial_nodes = nodes
        self.pod_cidr, self.service_cidr, self.node_cidr_mask = pod_cidr, service_cidr, node_cidr_mask
        self.cni, self.dns = cni, dns
        self.state_dir = state_root / name
        self.progress = progress
        self.nodes: list[Node] = []
        self.outside: Node | None = None
        self.network_id = ""
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
            "network_id": self.network_id, "subnet": self.subnet,
            "nodes": [vars(n) for n in self.nodes],
            "outside": vars(self.outside) if self.outside else None,
            "loaded_images": self.loaded_images, "timings": self.timings,
        }  # fmt: skip
        tmp = self.state_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / "state.json")

    @classmethod
    def load(cls, name: str = "cilia", state_root: pathlib.Path = STATE_ROOT,
             progress: Callable[[str], None] = _say) -> KindCluster:
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
                f"(make k8s-down NAME={self.name})"
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
        taken = [ipaddress.ip_network(r["dst"]) for r in _routes() if r.get("dst") not in
                 (None, "default")]  # fmt: skip
        for net in docker("network", "ls", "--quiet").stdout.split():
            for cfg in (((inspect("network", net) or {}).get("IPAM") or {}).get("Config") or []):
                if cfg.get("Subnet") and ":" not in cfg["Subnet"]:
                    taken.append(ipaddress.ip_network(cfg["Subnet"]))
        avoid = [ipaddress.ip_network(self.pod_cidr), ipaddress.ip_network(self.service_cidr)]
        for candidate in ipaddress.ip_network(NETWORK_POOL).subnets(new_prefix=24):
            if any(candidate.overlaps(n) for n in taken + avoid):
                continue
            got = docker(
                "network", "create", "--driver=bridge", f"--subnet={candidate}",
                f"--gateway={candidate[1]}", f"--label={CLUSTER_LABEL}={self.name}",
                "--opt=com.docker.network.driver.mtu=1500", self.name, check=False,
            )  # fmt: skip
            if got.returncode == 0:
                self.network_id, self.subnet = got.stdout.strip(), str(candidate)
                self._save()
                self.progress(f"network {self.name} {self.subnet}")
                return
            if "overlap" not in got.stderr:
                raise KindError(f"docker network create {self.name}: {got.stderr.strip()}")
        raise KindError(f"no free /24 in {NETWORK_POOL} for the cluster network")

    def _next_node(self) -> Node:
        used = {n.ip for n in self.nodes}
        hosts = list(ipaddress.ip_network(self.subnet).hosts())
        ip = next(str(h) for h in hosts[1:OUTSIDE_HOST - 1] if str(h) not in used)
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
        node.container_id = docker(*args).stdout.strip()
        self._save()
        self.progress(f"node {node.name} {node.ip} ({node.role}) container {node.container_id[:12]}")

    def _start_outside(self) -> None:
        hosts = list(ipaddress.ip_network(self.subnet).hosts())
        outside = Node(f"{self.name}-outside", str(hosts[OUTSIDE_HOST - 1]), role="outside")
        script = pathlib.Path(__file__).with_name("outside_echo.py")
        self.outside = outside
        outside.container_id = docker(
            "run", "--detach", f"--name={outside.name}", f"--hostname={outside.name}",
            f"--label={CLUSTER_LABEL}={self.name}", f"--label={ROLE_LABEL}=outside",
            f"--network={self.name}", f"--ip={outside.ip}", "--cap-add=NET_ADMIN",
            f"--volume={script}:/opt/outside_echo.py:ro", "--stop-timeout=2",
            image.BASE_IMAGE, "python3", "-u", "/opt/outside_echo.py",
        ).stdout.strip()  # fmt: skip
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

    def _wait_api(self, timeout: float = API_READY_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            got = self.kubectl("get", "--raw=/readyz", check=False, timeout=10)
            if got.returncode == 0 and got.stdout.strip() == "ok":
                return
            last = (got.stdout + got.stderr).strip()[-300:]
            time.sleep(0.5)
        cp = self.control_plane.name
        raise KindError(
            f"API server {self.api_server} not ready in {timeout:g}s ({last});\n"
            f"kube-apiserver:\n{log_tail(self.state_dir, cp, 'kube-apiserver')}\n"
            f"etcd:\n{log_tail(self.state_dir, cp, 'etcd')}\n"
            f"entrypoint:\n{log_tail(self.state_dir, cp, 'entrypoint')}"
        )

    # ------------------------------------------------------------------ queries
    def kubectl(self, *argv: str, input: str | None = None, check: bool = True,
                timeout: float = KUBECTL_SECONDS) -> subprocess.CompletedProcess[str]:
        """kubectl with the host kubeconfig (the cached build, else the one on PATH).

        Raises:
            KindError: non-zero exit with ``check`` (kubectl's stderr).
        """
        binary = default_bin_dir() / "kubectl"
        path = str(binary) if os.access(binary, os.X_OK) else (shutil.which("kubectl") or "kubectl")
        got = subprocess.run(
            [path, f"--kubeconfig={self.kubeconfig}", *argv], input=input, capture_output=True,
            text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if check and got.returncode != 0:
            raise KindError(f"kubectl {' '.join(argv)}: {got.stderr.strip()}")
        return got

    def get(self, *argv: str) -> dict[str, Any]:
        """``kubectl get ARGV -o json`` parsed.

        Raises:
            KindError: kubectl failed.
        """
        out: dict[str, Any] = json.loads(self.kubectl("get", *argv, "-o", "json").stdout)
        return out

    def exec(self, node: str | Node, *argv: str, check: bool = True, input: str | None = None,
             timeout: float = 60.0) -> str:
        """Run ``argv`` in a node container (or the outside host, by its name); its stdout.

        Raises:
            KeyError: unknown node. DockerError: non-zero exit with ``check``.
        """
        target = node if isinstance(node, Node) else (
            self.outside if self.outside and node == self.outside.name else self.node(node))
        assert target is not None
        return node_exec(target, *argv, check=check, input=input, timeout=timeout)

    def node_objects(self) -> dict[str, dict[str, Any]]:
        """The Node objects by name."""
        return {n["metadata"]["name"]: n for n in self.get("nodes")["items"]}

    def wait_registered(self, names: Iterable[str] | None = None,
                        timeout: float = NODE_REGISTER_SECONDS) -> None:
        """Wait until the Nodes ``names`` (default: all) exist.

        Raises:
            KindError: not in ``timeout`` seconds (kubelet log tails).
        """
        self._wait_nodes(names, timeout, lambda n: True, "registered")

    def wait_ready(self, names: Iterable[str] | None = None,
                   timeout: float = NODE_READY_SECONDS) -> None:
        """Wait until the Nodes ``names`` (default: all) are Ready.

        Raises:
            KindError: not in ``timeout`` seconds (kubelet log tails).
        """
        self._wait_nodes(names, timeout, _ready, "Ready")

    def _wait_nodes(self, names: Iterable[str] | None, timeout: float,
                    ok: Callable[[dict[str, Any]], bool], what: str) -> None:
        want = set(names) if names is not None else {n.name for n in self.nodes}
        deadline = time.monotonic() + timeout
        pending = want
        while time.monotonic() < deadline:
            got = self.kubectl("get", "nodes", "-o", "json", check=False, timeout=15)
            if got.returncode == 0:
                objects = {n["metadata"]["name"]: n for n in json.loads(got.stdout)["items"]}
                pending = {n for n in want if n not in objects or not ok(objects[n])}
                if not pending:
                    return
            time.sleep(0.5)
        tails = "\n".join(f"{n} kubelet:\n{log_tail(self.state_dir, n, 'kubelet', 15)}"
                          for n in sorted(pending))  # fmt: skip
        raise KindError(f"nodes {sorted(pending)} not {what} in {timeout:g}s\n{tails}")

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
        """Write the reference conflist on ``nodes`` (default: all) and the pod-CIDR routes
        on every node (:mod:`cilia_testkit.kind.refcni`); waits for the podCIDRs.

        Raises:
            KindError: a Node got no podCIDR in :data:`POD_CIDR_SECONDS`.
        """
        cidrs = self._pod_cidrs()
        for node in list(nodes) if nodes is not None else self.nodes:
            self.exec(node, "sh", "-c", f"cat > /etc/cni/net.d/{refcni.CONFLIST}",
                      input=refcni.conflist(cidrs[node.name]))  # fmt: skip
        self.apply_routes(cidrs)

    def apply_routes(self, cidrs: dict[str, str] | None = None) -> None:
        """On every node, a route to each other node's podCIDR via that node (reference CNI)."""
        cidrs = cidrs or self._pod_cidrs()
        for node in self.nodes:
            routes = {cidrs[o.name]: o.ip for o in self.nodes if o is not node and o.name in cidrs}
            if routes:
                self.exec(node, "sh", "-ec", refcni.route_script(routes))

    def _pod_cidrs(self) -> dict[str, str]:
        deadline = time.monotonic() + POD_CIDR_SECONDS
        while True:
            objects = self.node_objects()
            cidrs = {n: (o.get("spec") or {}).get("podCIDR") for n, o in objects.items()}
            if all(cidrs.get(n.name) for n in self.nodes):
                return {k: v for k, v in cidrs.items() if v}
            if time.monotonic() > deadline:
                raise KindError(f"podCIDRs not allocated in {POD_CIDR_SECONDS:g}s: {cidrs}\n"
                                f"{log_tail(self.state_dir, self.control_plane.name, 'kube-controller-manager')}")
            time.sleep(0.5)

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
        before = self._lease_renewed(name) if wait else ""
        docker("start", node.container_id)
        if not wait:
            return
        wait_containerd(node, self.state_dir)
        if node.role == "control-plane":
            self._wait_api()
        if self.cni == "reference":
            self.apply_routes()
            self.wait_ready([name])
        self._wait_heartbeat(name, before)

    def restart_node(self, name: str, wait: bool = True) -> None:
        """Stop and start a node container (a node reboot: new network namespace, pods'
        sandboxes recreated by the kubelet); see :meth:`start_node`."""
        self.stop_node(name)
        self.start_node(name, wait=wait)

    def _lease_renewed(self, name: str) -> str:
        """``spec.renewTime`` of the node's Lease in kube-node-lease (the kubelet's
        heartbeat, renewed every 10 s), or ""."""
        got = self.kubectl("get", "lease", "-n", "kube-node-lease", name, "-o",
                           "jsonpath={.spec.renewTime}", check=False, timeout=15)  # fmt: skip
        return got.stdout.strip() if got.returncode == 0 else ""

    def _wait_heartbeat(self, name: str, before: str, timeout: float = NODE_READY_SECONDS) -> None:
        """Until the kubelet has renewed its Lease after ``before`` (its renewTime then): it
        runs again and reaches the API server."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._lease_renewed(name) > before:
                return
            time.sleep(0.5)
        raise KindError(f"kubelet of {name} posted no status in {timeout:g}s:\n"
                        f"{log_tail(self.state_dir, name, 'kubelet')}")

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
        ids = [n.container_id for n in self.nodes if n.container_id]
        if self.outside and self.outside.container_id:
            ids.append(self.outside.container_id)
        if ids:
            docker("rm", "--force", "--volumes", *ids, check=False, timeout=120)
        if self.network_id:
            docker("network", "rm", self.network_id, check=False)
        # node services wrote root-owned files into bind-mounted directories: plain removal
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self.nodes, self.outside, self.network_id = [], None, ""

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


def _ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _routes() -> list[dict[str, Any]]:
    got = subprocess.run(["ip", "-j", "-4", "route", "show", "table", "all"], capture_output=True,
                         text=True, check=False)  # fmt: skip
    try:
        routes: list[dict[str, Any]] = json.loads(got.stdout or "[]")
    except ValueError:
        return []
    return [r for r in routes if r.get("type", "unicast") == "unicast"]

