"""One node of the kind-style cluster: a container of the node image, its configuration
(written on the host, bind-mounted read-only at ``/etc/cilia-node``) and what the harness
does in it (exec, wait for containerd, import images).

The container is as privileged as this host lets a container be. ``docker run --privileged``
fails here ("unable to apply caps": the machine's capability bounding set lacks
CAP_SYS_RESOURCE), so a node gets every capability the engine's process holds
(``--cap-add ALL`` minus those missing from the bounding set), no seccomp/AppArmor profile,
unmasked ``/proc`` (``systempaths=unconfined``), every device in its device cgroup,
``/lib/modules`` read-only, tmpfs ``/run`` and ``/tmp`` (no stale sockets or netns after a
restart), an anonymous volume at ``/var/lib/containerd`` (ext4 on the host: overlayfs
snapshots work there, not on the container's own overlay root) and its **own cgroup
namespace** (``--cgroupns=private``). The entrypoint (tools/kind/entrypoint.sh) remounts
/sys and the cgroup v1 hierarchies read-write, mounts cgroup2 at
``/sys/fs/cgroup/unified`` (rooted at the node's own cgroup: see the package README) and a
fresh bpffs at ``/sys/fs/bpf``, makes ``/`` rshared and supervises the services listed in
``/etc/cilia-node/services``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Any

from cilia_testkit.kind.docker import DockerError, docker
from cilia_testkit.kind.pki import ClusterPKI

#: Where a node sees its configuration, its log directory and the harness's image tarballs.
CONF_MOUNT = "/etc/cilia-node"
LOG_MOUNT = "/var/log/cilia-node"
IMAGES_MOUNT = "/var/lib/cilia-kind/images"
#: Where the control-plane node sees the cached control-plane binaries (read-only).
KUBE_BIN_MOUNT = "/opt/kube/bin"
#: containerd's socket in a node.
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
#: Seconds containerd may take to answer in a started node container.
CONTAINERD_START_SECONDS = 60.0
#: Seconds ``ctr images import`` of one tarball may take.
IMPORT_SECONDS = 300.0
#: Seconds ``docker stop`` waits after SIGTERM before SIGKILL.
STOP_SECONDS = 10
#: The label every object of a cluster carries (value: the cluster name).
CLUSTER_LABEL = "io.cilia.kind.cluster"
#: Capabilities by bit number (Linux uapi/linux/capability.h) that ``--cap-add ALL`` may name.
_CAP_NAMES = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
]


@dataclasses.dataclass
class Node:
    """A node of the cluster: its Kubernetes name (= the container's hostname), its address on
    the cluster network (the Node's InternalIP), its container id and role
    (``control-plane`` or ``worker``)."""

    name: str
    ip: str
    container_id: str = ""
    role: str = "worker"

    @property
    def container_name(self) -> str:
        """The container's name (the node name: unique per cluster, prefixed by it)."""
        return self.name


class NodeError(RuntimeError):
    """A node's container or one of its services did not come up (log tails in the message)."""


def missing_caps() -> list[str]:
    """Capabilities ``--cap-add ALL`` names that this process's bounding set lacks (the
    engine runs with the same set on this machine); dropped from every node."""
    bound = 0
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            bound = int(line.split()[1], 16)
    return [name for bit, name in enumerate(_CAP_NAMES) if not bound >> bit & 1]


def node_dirs(state_dir: pathlib.Path, name: str) -> tuple[pathlib.Path, pathlib.Path]:
    """(conf, log) directories of node ``name`` under the cluster's state directory."""
    base = state_dir / "nodes" / name
    return base / "conf", base / "log"


def write_node_config(
    state_dir: pathlib.Path,
    node: Node,
    pki: ClusterPKI,
    *,
    api_server: str,
    cluster_dns: str,
    extra_services: dict[str, str] | None = None,
) -> pathlib.Path:
    """Write node ``node``'s ``/etc/cilia-node``: ``pki/ca.crt``, the kubelet's kubeconfig
    (``system:node:<name>`` client certificate, server ``https://<api_server>``), its
    KubeletConfiguration and the service scripts ``services/10-containerd`` and
    ``services/50-kubelet`` plus ``extra_services`` (file name → script; the control plane's).
    Returns the conf directory.

    The KubeletConfiguration: webhook authentication/authorization (the API server's
    kubelet client is the admin certificate), cgroupfs driver on this host's cgroup v1
    (``failCgroupV1: false``), no QoS cgroups (as the host kubelet of cilia_testkit.kubelet),
    ``clusterDNS`` = ``cluster_dns``, ``resolvConf: ""`` (pods with dnsPolicy Default get no
    nameserver: the docker network's 127.0.0.11 resolver is unreachable from a pod), eviction
    thresholds at 1 MiB and image GC off (a busy shared disk must not evict test pods).
    """
    conf, log = node_dirs(state_dir, node.name)
    (conf / "pki").mkdir(parents=True, exist_ok=True)
    (conf / "services").mkdir(exist_ok=True)
    log.mkdir(parents=True, exist_ok=True)
    (conf / "pki" / "ca.crt").write_bytes(pki.ca_file.read_bytes())
    cert, key = pki.node_cert(node.name)
    # as kubeadm leaves it: the kubelet's client pair in one file, which Cilia's agent presents
    # to the operator (mutual TLS with the node's own identity, deploy/README.md)
    pair = conf / "pki" / "kubelet-client-current.pem"
    pair.write_bytes(cert.read_bytes() + key.read_bytes())
    pair.chmod(0o600)
    (conf / "kubelet.kubeconfig").write_text(
        pki.kubeconfig(f"https://{api_server}", cert, key, f"system:node:{node.name}")
    )
    config: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": f"{CONF_MOUNT}/pki/ca.crt"},
        },
        "authorization": {"mode": "Webhook"},
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "failSwapOn": False,
        "failCgroupV1": False,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "clusterDNS": [cluster_dns],
        "clusterDomain": "cluster.local",
        "resolvConf": "",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1Mi",
            "imagefs.available": "1Mi",
            "nodefs.inodesFree": "1",
        },
        "serializeImagePulls": False,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
        "localStorageCapacityIsolation": False,
        "protectKernelDefaults": False,
    }
    (conf / "kubelet-config.json").write_text(json.dumps(config, indent=2))
    services = {
        "10-containerd": "exec containerd --log-level=warn\n",
        "50-kubelet": (
            f"while [ ! -S {CONTAINERD_SOCKET} ]; do sleep 0.2; done\n"
            f"install -D -m 0600 {CONF_MOUNT}/pki/kubelet-client-current.pem"
            " /var/lib/kubelet/pki/kubelet-client-current.pem\n"
            f"exec kubelet --config={CONF_MOUNT}/kubelet-config.json"
            f" --kubeconfig={CONF_MOUNT}/kubelet.kubeconfig --node-ip={node.ip}"
            f" --hostname-override={node.name} --v=1\n"
        ),
        **(extra_services or {}),
    }
    for name, script in services.items():
        (conf / "services" / name).write_text(script)
    return conf


def run_args(
    node: Node,
    *,
    cluster: str,
    network: str,
    image: str,
    state_dir: pathlib.Path,
    images_dir: pathlib.Path,
    kube_bin: pathlib.Path | None = None,
) -> list[str]:
    """The ``docker run`` arguments of ``node`` (see the module docstring); ``kube_bin``
    (the control-plane node's): the cached control-plane binaries, mounted read-only."""
    conf, log = node_dirs(state_dir, node.name)
    args = [
        "run", "--detach", f"--name={node.container_name}", f"--hostname={node.name}",
        f"--label={CLUSTER_LABEL}={cluster}", f"--label=io.cilia.kind.role={node.role}",
        f"--network={network}", f"--ip={node.ip}",
        "--cap-add=ALL", *(f"--cap-drop={c}" for c in missing_caps()),
        "--security-opt=seccomp=unconfined", "--security-opt=apparmor=unconfined",
        "--security-opt=systempaths=unconfined", "--cgroupns=private",
        "--device-cgroup-rule=a *:* rwm",
        "--tmpfs=/run:rw,exec,nosuid,nodev,mode=755", "--tmpfs=/tmp:rw,exec,nosuid,nodev",
        "--volume=/var/lib/containerd",
        "--volume=/lib/modules:/lib/modules:ro",
        f"--volume={conf}:{CONF_MOUNT}:ro",
        f"--volume={log}:{LOG_MOUNT}",
        f"--volume={images_dir}:{IMAGES_MOUNT}:ro",
        "--sysctl=net.ipv4.ip_forward=1",
        f"--stop-timeout={STOP_SECONDS}",
    ]  # fmt: skip
    if pathlib.Path("/dev/kmsg").exists():
        args.append("--device=/dev/kmsg")  # the kubelet's OOM watcher reads it
    if kube_bin is not None:
        args.append(f"--volume={kube_bin}:{KUBE_BIN_MOUNT}:ro")
    return [*args, image]


def node_exec(
    node: Node, *argv: str, check: bool = True, input: str | None = None, timeout: float = 60.0
) -> str:
    """Run ``argv`` in the node container (``docker exec``); its stdout.

    Raises:
        DockerError: non-zero exit with ``check``.
    """
    flags = ["-i"] if input is not None else []
    return docker("exec", *flags, node.container_id or node.name, *argv, check=check,
                  input=input, timeout=timeout).stdout  # fmt: skip


def log_tail(state_dir: pathlib.Path, node: str, service: str, lines: int = 25) -> str:
    """The last lines of a node service's log (``containerd``, ``kubelet``, ``etcd``,
    ``kube-apiserver``, ``entrypoint``, ...) from the host's copy."""
    path = node_dirs(state_dir, node)[1] / f"{service}.log"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path})"


def wait_containerd(
    node: Node, state_dir: pathlib.Path, timeout: float = CONTAINERD_START_SECONDS
) -> None:
    """Return once the node's containerd answers ``ctr version``.

    Raises:
        NodeError: not in ``timeout`` seconds (the container's state and log tails).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = docker("exec", node.container_id, "ctr", "version", check=False)
        if got.returncode == 0:
            return
        time.sleep(0.3)
    state = docker("inspect", "--format", "{{.State.Status}} {{.State.Error}}", node.container_id,
                   check=False).stdout.strip()  # fmt: skip
    raise NodeError(
        f"containerd of {node.name} did not answer in {timeout:g}s (container: {state});\n"
        f"entrypoint:\n{log_tail(state_dir, node.name, 'entrypoint')}\n"
        f"containerd:\n{log_tail(state_dir, node.name, 'containerd')}"
    )


def import_image(node: Node, tarball: str) -> None:
    """``ctr -n k8s.io images import`` of ``tarball`` (a file name in the images directory
    mounted at :data:`IMAGES_MOUNT`) in the node.

    Raises:
        DockerError: the import failed.
    """
    try:
        docker("exec", node.container_id, "ctr", "-n", "k8s.io", "images", "import",
               f"{IMAGES_MOUNT}/{tarball}", timeout=IMPORT_SECONDS)  # fmt: skip
    except DockerError as exc:
        raise DockerError(f"importing {tarball} into {node.name}: {exc}") from exc
