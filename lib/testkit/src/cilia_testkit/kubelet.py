"""A real Kubernetes node for tests: a private containerd (CRI) + a kubelet registered to the
test API server (:class:`~cilia_testkit.kubeapi.KubeAPI`), pods networked by ``cilia-cni``.

Test tooling only. The kubelet (and kube-scheduler, ``testpod``) are built by
``scripts/kubelet-tools.sh`` into the same cache as the control plane
(``${CILIA_CACHE_DIR:-~/.cache/cilia}/kube/<k8s-version>/bin``); containerd, its runc shim
and ``ctr`` are the Debian packages (``scripts/setup.sh``).

:class:`KubeletNode` is a context manager::

    with KubeletNode(kube, "node-x", cni_conf_dir=agent.conf_dir) as node:
        node.kubectl("apply", "-f", ...)    # Pods with spec.nodeName "node-x" (or scheduled)
        node.wait_running(ns, name)         # -> the Pod object once Running with an IP
        node.pod_netns(ns, name)            # the pod's network namespace path (nsenter)

What it runs, every path its own (under ``workdir``), nothing shared with the host's
container runtimes:

- **containerd** with its own config/root/state and socket (``containerd.sock``), the CRI
  plugin with the ``native`` snapshotter (no overlayfs-on-whatever questions), runc with
  ``SystemdCgroup = false`` (cgroupfs; this host has no systemd) and runc's state under the
  work dir; the CNI conf dir is the agent's (``cni_conf_dir``, the conflist the agent
  writes), the CNI bin dir a directory holding only ``cilia-cni``. No registry: the pod image
  ``cilia.test/testpod:1`` (also the sandbox image) is an OCI image tarball made here from
  the static ``testpod`` program (:func:`cilia_testkit.ociimage.write_oci_image`) and imported with ``ctr``.
- **kubelet** (``--fail-cgroupv1=false`` in its config: this host has cgroup v1; cgroupfs;
  ``failSwapOn: false``; no QoS cgroups; eviction thresholds at 1 MiB so a busy shared disk
  does not taint the node; webhook authn/authz off, its ports 0 or a free loopback port)
  authenticating with a client certificate ``CN=system:node:<name>, O=system:nodes`` signed
  by the test CA and bound to ClusterRole ``system:node``.

  The kubelet sets kernel tunables at start (``vm.overcommit_memory=1``, ``kernel.panic=10``,
  ``kernel.panic_on_oops=1``, …; with ``protectKernelDefaults`` it refuses to start instead).
  A test must not change a shared machine's panic behaviour, so the kubelet runs in a mount
  namespace of its own (``unshare --mount --propagation unchanged``) where each of those
  ``/proc/sys`` files is a bind-mounted copy: it writes the copies. Its root dir is a
  bind mount made *shared* first, so the volumes it mounts for pods (service-account tokens)
  propagate to the host's mount namespace, where containerd and runc see them.

Teardown (:meth:`KubeletNode.stop`): the node's Pods are deleted and waited for (the kubelet
stops their containers and sandboxes: CNI DEL), then the kubelet and containerd are stopped;
any shim left of this containerd is killed (found by its ``-address`` argument), every mount
under the work dir is unmounted, containerd's ``/k8s.io`` cgroups are removed once empty, the network namespaces of this containerd's sandboxes are
unmounted and removed, and the Node object is deleted. The host's containerd/docker are never
touched. One path is shared with them: containerd 1.6's runc shim always puts its socket in
``/run/containerd/s/`` (named by a hash of our containerd's address and the container), and
removes it when it exits; the directory itself is the system containerd's and is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any

from cilia_testkit import VENV_BIN
from cilia_testkit.kubeapi import KubeAPI, binary_missing, spawn_logged
from cilia_testkit.kubelethost import (
    CGROUP_PARENT,
    CGROUP_ROOT,
    KERNEL_TUNABLES,
    LOOPBACK_PLUGINS,
    kill_shims,
    loopback_plugin,
    missing,
    remove_cgroups,
    unmount_under,
)
from cilia_testkit.ociimage import IMAGE, write_oci_image
from cilia_testkit.pki import issue_client_cert, kubeconfig_json
from cilia_testkit.procs import stop as stop_process

#: The taint the node registers with (NoSchedule): see :meth:`KubeletNode._start_kubelet`.
TAINT = "cilia.test/kubelet"
#: Seconds containerd may take to answer on its socket.
CONTAINERD_START_SECONDS = 30.0
#: Seconds until the kubelet's Node is Ready.
NODE_READY_SECONDS = 90.0
#: Seconds a Pod may take to be Running (sandbox, CNI ADD, container start).
POD_RUNNING_SECONDS = 90.0
#: Seconds the teardown waits for the node's Pods to be gone before stopping anyway.
POD_GONE_SECONDS = 60.0
#: Seconds a component gets after SIGTERM before SIGKILL.
STOP_SECONDS = 15.0


class KubeletError(RuntimeError):
    """containerd or the kubelet failed to start, or a pod did not run (with log tails)."""


def _tail(path: pathlib.Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"({path} unreadable)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class KubeletNode:
    """containerd + kubelet as node ``node_name`` of ``kube``; see the module docstring.

    Args:
        kube: the running test API server.
        node_name: the Node's name (``--hostname-override``); the agent of this node must
            use the same ``--node-name``.
        cni_conf_dir: the CNI conf dir (the agent's ``net.d``: it writes the conflist there).
        workdir: a new temporary directory when None (removed by :meth:`stop`).
        cni_plugin: the ``cilia-cni`` executable (the venv's by default).
        images: the names under which the testpod image is imported (:data:`IMAGE` is
            also the sandbox image; more names let a test change a pod's image to one the
            node has, as an image change of a rollout does).

    Raises (from :meth:`start`):
        FileNotFoundError: something :func:`missing` names.
        KubeletError: containerd or the kubelet did not come up (log tails in the message).
    """

    def __init__(
        self,
        kube: KubeAPI,
        node_name: str,
        *,
        cni_conf_dir: pathlib.Path,
        workdir: pathlib.Path | None = None,
        cni_plugin: pathlib.Path | None = None,
        images: tuple[str, ...] = (IMAGE,),
    ) -> None:
        self.kube = kube
        self.node_name = node_name
        self.cni_conf_dir = cni_conf_dir
        self._own_dir = workdir is None
        self.workdir = workdir or pathlib.Path(tempfile.mkdtemp(prefix="cilia-kubelet-"))
        self.cni_plugin = cni_plugin or VENV_BIN / "cilia-cni"
        self.images = images
        self.bin_dir = kube.bin_dir
        self.socket = self.workdir / "containerd.sock"
        self.root_dir = self.workdir / "kubelet"
        self.kubeconfig = self.workdir / "kubelet.kubeconfig"
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []
        self._shared_mount = False
        self._netns: set[str] = set()

    # ------------------------------------------------------------------ helpers
    def log(self, name: str) -> pathlib.Path:
        """A component's log file (``containerd`` or ``kubelet``)."""
        return self.workdir / f"{name}.log"

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        proc, log = spawn_logged(self.log(name), argv, self.workdir)
        self._logs.append(log)
        self._procs[name] = proc
        return proc

    def ctr(self, *argv: str, check: bool = True, timeout: float = 60.0) -> str:
        """``ctr --address <socket> -n k8s.io ARGV``; its stdout.

        Raises:
            KubeletError: non-zero exit with ``check`` (stderr in the message).
        """
        out = subprocess.run(
            ["ctr", "--address", str(self.socket), "-n", "k8s.io", *argv],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if check and out.returncode != 0:
            raise KubeletError(f"ctr {' '.join(argv)}: {out.stderr.strip()}")
        return out.stdout

    def kubectl(self, *argv: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """The API server's kubectl (admin), asserting success.

        Raises:
            KubeletError: kubectl failed (its stderr).
        """
        out: subprocess.CompletedProcess[str] = self.kube.kubectl(*argv, input=input, check=False)
        if out.returncode != 0:
            raise KubeletError(f"kubectl {' '.join(argv)}: {out.stderr.strip()}")
        return out

    # ------------------------------------------------------------------ start
    def start(self) -> KubeletNode:
        """Start containerd (image imported) and the kubelet; return once the Node is Ready.
        Raises as the class docstring says; a failed start is torn down."""
        reason = missing()
        if reason:
            raise FileNotFoundError(reason)
        try:
            self._start_containerd()
            self._start_kubelet()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_containerd(self) -> None:
        cni_bin = self.workdir / "cni-bin"
        cni_bin.mkdir(parents=True, exist_ok=True)
        for name, target in (("cilia-cni", self.cni_plugin), ("loopback", loopback_plugin())):
            link = cni_bin / name
            if not link.is_symlink():
                link.symlink_to(target)
        cri = '"io.containerd.grpc.v1.cri"'
        w = self.workdir
        config = f"""version = 2
root = "{w}/containerd/root"
state = "{w}/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{w}/containerd/opt"
[plugins.{cri}]
  sandbox_image = "{IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  restrict_oom_score_adj = true
  [plugins.{cri}.containerd]
    snapshotter = "native"
    default_runtime_name = "runc"
    [plugins.{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{w}/runc"
  [plugins.{cri}.cni]
    bin_dir = "{cni_bin}"
    conf_dir = "{self.cni_conf_dir}"
    max_conf_num = 1
"""
        path = w / "containerd.toml"
        path.write_text(config)
        self._spawn("containerd", ["containerd", "--config", str(path), "--log-level", "info"])
        deadline = time.monotonic() + CONTAINERD_START_SECONDS
        while True:
            proc = self._procs["containerd"]
            if proc.poll() is not None:
                raise KubeletError(
                    f"containerd exited with {proc.returncode}:\n{_tail(self.log('containerd'))}"
                )
            if self.socket.exists():
                got = subprocess.run(
                    ["ctr", "--address", str(self.socket), "version"],
                    capture_output=True, text=True, timeout=10, check=False,
                )  # fmt: skip
                if got.returncode == 0:
                    break
            if time.monotonic() > deadline:
                raise KubeletError(f"containerd did not answer:\n{_tail(self.log('containerd'))}")
            time.sleep(0.2)
        for n, name in enumerate(self.images):
            image = write_oci_image(self.bin_dir / "testpod", w / f"image-{n}.tar", name)
            self.ctr("images", "import", str(image))

    def _node_credentials(self) -> None:
        """A client certificate for ``system:node:<name>`` (group ``system:nodes``) signed by
        the test CA, its kubeconfig, and a ClusterRoleBinding to ClusterRole ``system:node``."""
        user = f"system:node:{self.node_name}"
        cert_file, key_file = issue_client_cert(
            self.kube.ca_file,
            self.kube.ca_file.parent / "ca.key",  # the KubeAPI writes its CA key beside it
            user,
            "system:nodes",
            self.workdir / "kubelet.crt",
            self.workdir / "kubelet.key",
        )
        self.kubeconfig.write_text(
            kubeconfig_json(
                self.kube.server, self.kube.ca_file, cert_file, key_file, user,
                cluster="test", embed=False,
            )
        )  # fmt: skip
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": f"cilia-test-node-{self.node_name}"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:node",
            },
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        }
        self.kubectl("apply", "-f", "-", input=json.dumps(binding))

    def _start_kubelet(self) -> None:
        self._node_credentials()
        self.root_dir.mkdir(parents=True, exist_ok=True)
        # the root dir shared, so that the kubelet's volume mounts reach containerd's view
        subprocess.run(["mount", "--bind", str(self.root_dir), str(self.root_dir)], check=True)
        self._shared_mount = True
        subprocess.run(["mount", "--make-shared", str(self.root_dir)], check=True)
        sysctl_dir = self.workdir / "sysctl"
        binds = []
        for name in KERNEL_TUNABLES:
            real = pathlib.Path("/proc/sys") / name
            if not real.exists():
                continue
            copy = sysctl_dir / name.replace("/", ".")
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text(real.read_text())
            binds.append(f"mount --bind {copy} {real}")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": _free_port(),
            "readOnlyPort": 0,
            "healthzPort": 0,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.kube.ca_file)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1Mi",
                "imagefs.available": "1Mi",
                "nodefs.inodesFree": "1",
            },
            "serializeImagePulls": False,
            "syncFrequency": "10s",
            "nodeStatusUpdateFrequency": "2s",
            "fileCheckFrequency": "60s",
            "localStorageCapacityIsolation": False,
            "resolvConf": "/etc/resolv.conf",
            "protectKernelDefaults": False,
            # no KUBE-FIREWALL / KUBE-KUBELET-CANARY / KUBE-IPTABLES-HINT chains in the
            # host's iptables: the kubelet runs in the host's network namespace, and those
            # chains would outlive it (a DROP rule on INPUT, a hint that steers iptables
            # backend detection, and "no KUBE-* rule" checks of other tests)
            "makeIPTablesUtilChains": False,
            # the session's API server is shared: controllers of other tests (DaemonSets of
            # a running kube-controller-manager) must not send pods here. Pods the tests
            # bind with spec.nodeName skip the scheduler, so NoSchedule does not stop them.
            "registerWithTaints": [{"key": TAINT, "value": "true", "effect": "NoSchedule"}],
        }
        cfg_path = self.workdir / "kubelet-config.json"
        cfg_path.write_text(json.dumps(config, indent=2))
        kubelet = [
            str(self.bin_dir / "kubelet"),
            f"--config={cfg_path}",
            f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={self.root_dir}",
            f"--hostname-override={self.node_name}",
            f"--cert-dir={self.workdir / 'kubelet-pki'}",
            "--v=2",
        ]
        script = "set -e; " + "; ".join(binds) + '; exec "$@"'
        self._spawn(
            "kubelet",
            ["unshare", "--mount", "--propagation", "unchanged", "--",
             "sh", "-c", script, "kubelet", *kubelet],
        )  # fmt: skip
        deadline = time.monotonic() + NODE_READY_SECONDS
        while True:
            proc = self._procs["kubelet"]
            if proc.poll() is not None:
                raise KubeletError(
                    f"kubelet exited with {proc.returncode}:\n{_tail(self.log('kubelet'))}"
                )
            if self.node_ready():
                return
            if time.monotonic() > deadline:
                raise KubeletError(f"node not Ready:\n{_tail(self.log('kubelet'))}")
            time.sleep(0.5)

    def start_scheduler(self) -> None:
        """Start kube-scheduler (admin kubeconfig, no leader election, no serving port);
        stopped by :meth:`stop`. It schedules every pending Pod of the shared server, but
        only Pods that tolerate :data:`TAINT` can land on this node.

        Raises:
            FileNotFoundError: not built. KubeletError: it exited within its first second.
        """
        reason = binary_missing("kube-scheduler", self.bin_dir)
        if reason:
            raise FileNotFoundError(reason)
        running = self._procs.get("kube-scheduler")
        if running is not None and running.poll() is None:
            return
        proc = self._spawn(
            "kube-scheduler",
            [str(self.bin_dir / "kube-scheduler"), f"--kubeconfig={self.kube.kubeconfig}",
             f"--authentication-kubeconfig={self.kube.kubeconfig}",
             f"--authorization-kubeconfig={self.kube.kubeconfig}",
             "--leader-elect=false", "--secure-port=0", "--v=1"],
        )  # fmt: skip
        time.sleep(1.0)
        if proc.poll() is not None:
            raise KubeletError(
                f"kube-scheduler exited with {proc.returncode}:\n"
                f"{_tail(self.log('kube-scheduler'))}"
            )

    def prepare_namespace(self, namespace: str) -> None:
        """Make ``namespace`` ready for Pods as kube-controller-manager would (none runs
        here): its ``default`` ServiceAccount (serviceaccount controller) and the
        ``kube-root-ca.crt`` ConfigMap holding the CA (root-ca-cert-publisher), which the
        kubelet needs to mount a pod's service-account token volume.

        Raises:
            KubeletError: kubectl failed.
        """
        objects = {
            "apiVersion": "v1",
            "kind": "List",
            "items": [
                {"apiVersion": "v1", "kind": "ServiceAccount",
                 "metadata": {"name": "default", "namespace": namespace}},
                {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": {"name": "kube-root-ca.crt", "namespace": namespace},
                 "data": {"ca.crt": self.kube.ca_file.read_text()}},
            ],
        }  # fmt: skip
        self.kubectl("apply", "-f", "-", input=json.dumps(objects))

    # ------------------------------------------------------------------ queries
    def node(self) -> dict[str, Any] | None:
        """The Node object, or None."""
        out = self.kube.kubectl("get", "node", self.node_name, "-o", "json", check=False)
        if out.returncode != 0:
            return None
        node: dict[str, Any] = json.loads(out.stdout)
        return node

    def node_ready(self) -> bool:
        """The Node's Ready condition is True."""
        node = self.node()
        conditions = ((node or {}).get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A Pod object, or None."""
        out = self.kube.kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
        if out.returncode != 0:
            return None
        pod: dict[str, Any] = json.loads(out.stdout)
        return pod

    def wait_running(
        self, namespace: str, name: str, timeout: float = POD_RUNNING_SECONDS
    ) -> dict[str, Any]:
        """The Pod once its phase is Running and it has a pod IP.

        Raises:
            KubeletError: not Running in ``timeout`` seconds (its status, its events and the
                kubelet's log tail in the message).
        """
        deadline = time.monotonic() + timeout
        pod: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            pod = self.pod(namespace, name)
            status = (pod or {}).get("status") or {}
            if status.get("phase") == "Running" and status.get("podIP"):
                assert pod is not None
                return pod
            time.sleep(0.5)
        events = self.kube.kubectl(
            "get", "events", "-n", namespace, "--field-selector",
            f"involvedObject.name={name}", check=False,
        ).stdout  # fmt: skip
        raise KubeletError(
            f"pod {namespace}/{name} not Running in {timeout:g}s: "
            f"{json.dumps((pod or {}).get('status'))}\n{events}\n{_tail(self.log('kubelet'))}"
        )

    def sandboxes(self) -> dict[str, str]:
        """Sandbox container id → its network namespace path, from this containerd."""
        out: dict[str, str] = {}
        for cid in self.ctr("containers", "list", "-q", check=False).split():
            try:
                info = json.loads(self.ctr("containers", "info", cid, check=False) or "{}")
            except ValueError:
                continue
            labels = info.get("Labels") or {}
            if labels.get("io.cri-containerd.kind") != "sandbox":
                continue
            namespaces = ((info.get("Spec") or {}).get("linux") or {}).get("namespaces") or []
            for ns in namespaces:
                if ns.get("type") == "network" and ns.get("path"):
                    out[cid] = ns["path"]
        self._netns.update(out.values())
        return out

    def pod_netns(self, namespace: str, name: str) -> str:
        """The network namespace path of a running Pod's sandbox.

        Raises:
            KubeletError: no sandbox of that pod in this containerd.
        """
        for cid in self.ctr("containers", "list", "-q", check=False).split():
            try:
                info = json.loads(self.ctr("containers", "info", cid, check=False) or "{}")
            except ValueError:
                continue
            labels = info.get("Labels") or {}
            if (
                labels.get("io.cri-containerd.kind") == "sandbox"
                and labels.get("io.kubernetes.pod.name") == name
                and labels.get("io.kubernetes.pod.namespace") == namespace
            ):
                for ns in ((info.get("Spec") or {}).get("linux") or {}).get("namespaces") or []:
                    if ns.get("type") == "network" and ns.get("path"):
                        self._netns.add(ns["path"])
                        return str(ns["path"])
        raise KubeletError(f"no sandbox of pod {namespace}/{name} in this containerd")

    # ------------------------------------------------------------------ stop
    def delete_pods(self, timeout: float = POD_GONE_SECONDS) -> bool:
        """Delete every Pod bound to this node (gracefully: the kubelet stops them, CNI DEL)
        and wait until they are gone; True if they went in ``timeout`` seconds."""
        selector = f"spec.nodeName={self.node_name}"
        self.kube.kubectl(
            "delete", "pods", "-A", "--field-selector", selector, "--wait=false", check=False
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.kube.kubectl(
                "get", "pods", "-A", "--field-selector", selector, "-o", "name", check=False
            )
            if out.returncode == 0 and not out.stdout.strip():
                return True
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        """Tear down as the module docstring says; idempotent, never raises for leftovers."""
        kubelet = self._procs.get("kubelet")
        if kubelet is not None and kubelet.poll() is None:
            with contextlib.suppress(Exception):
                self.delete_pods()
        if self.socket.exists():
            with contextlib.suppress(Exception):
                self.sandboxes()
        for name in ("kube-scheduler", "kubelet", "containerd"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                stop_process(proc, sig=signal.SIGTERM, timeout=STOP_SECONDS, group=True)
        kill_shims(self.socket)
        unmount_under(self.workdir)
        remove_cgroups()
        for path in sorted(self._netns):
            if os.path.exists(path):
                subprocess.run(["umount", path], capture_output=True, check=False)
                with contextlib.suppress(OSError):
                    os.unlink(path)
        for log in self._logs:
            log.close()
        self._logs.clear()
        with contextlib.suppress(Exception):
            self.kube.kubectl("delete", "node", self.node_name, "--wait=false", check=False)
            self.kube.kubectl(
                "delete", "clusterrolebinding", f"cilia-test-node-{self.node_name}", check=False
            )
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> KubeletNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = [
    "CGROUP_PARENT",
    "CGROUP_ROOT",
    "CONTAINERD_START_SECONDS",
    "KERNEL_TUNABLES",
    "LOOPBACK_PLUGINS",
    "NODE_READY_SECONDS",
    "POD_GONE_SECONDS",
    "POD_RUNNING_SECONDS",
    "STOP_SECONDS",
    "TAINT",
    "KubeletError",
    "KubeletNode",
    "missing",
]
