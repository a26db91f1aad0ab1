"""What a test kubelet needs of the host and what it leaves there: whether a node can run
here (:func:`missing`: binaries, the loopback CNI plugin, root), the ``/proc/sys`` files the
kubelet writes (:data:`KERNEL_TUNABLES`), and the cleanup of what its containerd leaves behind
(:func:`kill_shims`, :func:`unmount_under`, :func:`remove_cgroups`). Used by
:class:`cilia_testkit.kubelet.KubeletNode`."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import subprocess

from cilia_testkit.kubeapi import binary_missing

#: The cgroup v1 mount root and containerd's default cgroup parent for CRI containers.
CGROUP_ROOT = "/sys/fs/cgroup"
CGROUP_PARENT = "k8s.io"

#: The ``/proc/sys`` files the kubelet writes at start (upstream
#: ``pkg/kubelet/cm/container_manager_linux.go`` ``setupKernelTunables``), given it copies.
KERNEL_TUNABLES = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)


def missing() -> str | None:
    """Why a node cannot run here (a skip reason), or None: a missing binary (kubelet,
    testpod, containerd, containerd-shim-runc-v2, runc, ctr, unshare, the loopback CNI
    plugin) or not root."""
    for name in ("kubelet", "testpod"):
        reason = binary_missing(name)
        if reason:
            return reason
    for tool in ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup.sh installs containerd and runc)"
    if not any(p.exists() for p in LOOPBACK_PLUGINS):
        return "no loopback CNI plugin (Debian containernetworking-plugins; scripts/setup.sh)"
    if os.geteuid() != 0:
        return "a kubelet and containerd need root"
    return None


#: Where the ``loopback`` CNI plugin is looked for (containerd's CRI always runs it on the
#: pod's ``lo``): Debian's containernetworking-plugins, then the usual /opt/cni/bin.
LOOPBACK_PLUGINS = (pathlib.Path("/usr/lib/cni/loopback"), pathlib.Path("/opt/cni/bin/loopback"))


def loopback_plugin() -> pathlib.Path:
    """The ``loopback`` CNI plugin's path.

    Raises:
        FileNotFoundError: none of :data:`LOOPBACK_PLUGINS` exists.
    """
    for path in LOOPBACK_PLUGINS:
        if path.exists():
            return path
    raise FileNotFoundError(f"no loopback CNI plugin in {[str(p) for p in LOOPBACK_PLUGINS]}")


def kill_shims(socket: pathlib.Path) -> None:
    """SIGKILL every containerd-shim of the containerd on ``socket`` (``-address <socket>``)
    and the processes of its containers (the shim's session)."""
    needle = str(socket).encode()
    for pid_dir in pathlib.Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            argv = (pid_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and needle in argv:
            pid = int(pid_dir.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def remove_cgroups() -> None:
    """Remove containerd's default cgroup parent (``/k8s.io``, cgroupfs: the pods'
    containers go under it when the kubelet makes no QoS cgroups) in every v1 hierarchy
    where it is left empty; a non-empty one (another runtime's pods) refuses rmdir."""
    for path in pathlib.Path(CGROUP_ROOT).glob(f"*/{CGROUP_PARENT}"):
        with contextlib.suppress(OSError):
            path.rmdir()


def unmount_under(workdir: pathlib.Path) -> None:
    """Unmount ``workdir`` and everything mounted under it (deepest first, lazily if busy)."""
    prefix = str(workdir) + "/"
    for _ in range(3):
        points = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                point = line.split()[4].replace("\\040", " ")
                if point.startswith(prefix) or point == str(workdir):
                    points.append(point)
        if not points:
            return
        for point in sorted(points, key=len, reverse=True):
            got = subprocess.run(["umount", point], capture_output=True, check=False)
            if got.returncode != 0:
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)
