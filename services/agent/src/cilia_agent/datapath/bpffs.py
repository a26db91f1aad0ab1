"""The BPF filesystem: make sure the pin directory is on bpffs, and read pinned maps.

``ensure_bpffs(pin_dir)`` mounts bpffs on ``/sys/fs/bpf`` when the pin directory lives
there and nothing (or something else) is mounted (upstream ``pkg/bpf`` ``checkOrMountFS``).

``PinnedMap`` (:mod:`cilia_agent.datapath.libbpf`, re-exported here) opens a map pinned by
the agent by path, so ``cilia-agent bpf … list`` reads the datapath's real state without bcc
and without the agent.
"""

from __future__ import annotations

import pathlib
import subprocess

from cilia_agent.datapath.errors import DatapathError
from cilia_agent.datapath.libbpf import LibbpfError, PinnedMap

__all__ = ["BPFFS_ROOT", "BpffsUnavailable", "PinnedMap", "PinnedMapError", "ensure_bpffs"]

BPFFS_ROOT = pathlib.Path("/sys/fs/bpf")


class BpffsUnavailable(DatapathError):
    """The pin directory is not on a BPF filesystem and bpffs could not be mounted there."""


PinnedMapError = LibbpfError
"""A pinned map cannot be opened or read (path and errno text in the message)."""


def mount_point(path: pathlib.Path, mounts: str | None = None) -> tuple[str, str]:
    """``(mount point, fstype)`` of the mount holding ``path`` (longest prefix in /proc/self/mounts)."""
    text = mounts if mounts is not None else pathlib.Path("/proc/self/mounts").read_text()
    best = ("/", "")
    target = str(path)
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2])
    return best


def ensure_bpffs(pin_dir: pathlib.Path) -> bool:
    """Make sure ``pin_dir`` is on bpffs; returns True when this call mounted it.

    Raises:
        BpffsUnavailable: the directory is not on bpffs and is not under /sys/fs/bpf
            (nothing is mounted elsewhere), or ``mount -t bpf`` failed.
    """
    _, fstype = mount_point(pin_dir)
    if fstype == "bpf":
        return False
    if not (pin_dir == BPFFS_ROOT or pin_dir.is_relative_to(BPFFS_ROOT)):
        raise BpffsUnavailable(
            f"{pin_dir} is not on a BPF filesystem (type {fstype or 'unknown'}); use a "
            f"directory under {BPFFS_ROOT} or mount bpffs there first"
        )
    BPFFS_ROOT.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "bpf", "bpf", str(BPFFS_ROOT)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise BpffsUnavailable(f"mount -t bpf bpf {BPFFS_ROOT} failed: {proc.stderr.strip()}")
    return True
