"""``mount-bpffs`` and ``mount-cgroup2``: a filesystem of the right type at a path.

Upstream's mount-bpf-fs init container mounts bpffs on ``/sys/fs/bpf`` when it is not
mounted; its mount-cgroup container mounts cgroup2 on ``/run/cilium/cgroupv2`` (Cilia:
``/run/cilia/cgroupv2``, ``--cgroup-root``) through ``cilium-mount``. Here, for a path:

* something of the wanted type is mounted exactly there → nothing to do;
* nothing is mounted there (the path lies on its parent's filesystem) → the path is
  created and the filesystem mounted with ``mount(8)`` (util-linux: it handles the
  propagation and ``/etc/mtab`` details a raw ``mount(2)`` call would leave to us);
* a directory of another filesystem is bind-mounted exactly there (the ``hostPath`` volume
  of the init container itself: ``/run/cilia/cgroupv2`` of the host, whose ``/run`` is a
  tmpfs; ``/proc/self/mountinfo`` gives the bind's root as that directory, not ``/``) → the
  filesystem is mounted over the bind, and the volume's ``Bidirectional`` propagation carries
  the mount to the host, as upstream's mount-cgroup init container does;
* another filesystem is mounted exactly there with its own root (a tmpfs left by someone
  else) → refused: mounting over it would hide whatever uses it, and the agent's pins or
  cgroup links on it would not be what the kernel uses.
"""

from __future__ import annotations

import pathlib
import subprocess

from cilia_agent.datapath.bpffs import mount_point

BPFFS = "bpf"
CGROUP2 = "cgroup2"


class MountError(Exception):
    """The path holds the wrong filesystem, or mounting failed (message says which and what to do)."""


def bind_root(path: pathlib.Path, mountinfo: str | None = None) -> str:
    """The root (field 4 of ``/proc/self/mountinfo``) of the topmost mount exactly on ``path``.

    ``/`` for a filesystem mounted there whole; the source directory (e.g. ``/cilia/cgroupv2``)
    for a bind mount of a directory; ``""`` when nothing is mounted exactly there.
    Source: proc(5), ``/proc/[pid]/mountinfo``.
    """
    text = mountinfo if mountinfo is not None else pathlib.Path("/proc/self/mountinfo").read_text()
    root = ""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[4].replace("\\040", " ") == str(path):
            root = fields[3].replace("\\040", " ")  # later lines are mounted on top
    return root


def ensure_mounted(
    path: pathlib.Path,
    fstype: str,
    *,
    flag: str,
    mounts: str | None = None,
    mountinfo: str | None = None,
) -> bool:
    """Make sure a ``fstype`` ("bpf" or "cgroup2") is mounted exactly on ``path``.

    Args:
        path: the mount point (absolute).
        fstype: the filesystem type as ``/proc/self/mounts`` names it.
        flag: the flag that chose ``path`` (for the message).
        mounts: the text of ``/proc/self/mounts`` (tests); read when None.
        mountinfo: the text of ``/proc/self/mountinfo`` (tests); read when None.

    Returns:
        True when this call mounted it, False when it was there already.

    Raises:
        MountError: another filesystem type is mounted on ``path``, or ``mount`` failed.
    """
    point, have = mount_point(path, mounts)
    if pathlib.Path(point) == path:
        if have == fstype:
            return False
        if bind_root(path, mountinfo) in ("", "/"):
            raise MountError(
                f"{path} is a {have or 'unknown'} mount, not {fstype}; unmount it (umount {path}) "
                f"or choose another path with {flag}"
            )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MountError(f"cannot create {path} ({flag}): {exc.strerror}") from exc
    source = "bpffs" if fstype == BPFFS else "none"
    proc = subprocess.run(
        ["mount", "-t", fstype, source, str(path)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise MountError(
            f"cannot mount {fstype} on {path} ({flag}): {proc.stderr.strip() or 'mount failed'}; "
            "run as root with CAP_SYS_ADMIN in the host's mount namespace"
        )
    return True
