"""The BPF filesystem: make sure the pin directory is on bpffs, and read pinned maps.

``ensure_bpffs(pin_dir)`` mounts bpffs on ``/sys/fs/bpf`` when the pin directory lives
there and nothing (or something else) is mounted (upstream ``pkg/bpf`` ``checkOrMountFS``).

``PinnedMap`` opens a map pinned by the agent by path (``BPF_OBJ_GET``) and walks it
with ``BPF_MAP_GET_NEXT_KEY`` / ``BPF_MAP_LOOKUP_ELEM`` through Debian's ``libbpf.so.1``
(ctypes), so ``cilia-agent bpf … list`` reads the datapath's real state without bcc and
without the agent (upstream ``cilium-dbg bpf`` reads pinned maps the same way).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pathlib
import subprocess
from collections.abc import Iterator
from typing import Generic, TypeVar

from cilia_agent.datapath.errors import DatapathError

BPFFS_ROOT = pathlib.Path("/sys/fs/bpf")

K = TypeVar("K", bound=ctypes.Structure | ctypes.c_uint32)
V = TypeVar("V", bound=ctypes.Structure)


class BpffsUnavailable(DatapathError):
    """The pin directory is not on a BPF filesystem and bpffs could not be mounted there."""


class PinnedMapError(DatapathError):
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


_lib: ctypes.CDLL | None = None


def _libbpf() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("bpf") or "libbpf.so.1"
        try:
            lib = ctypes.CDLL(name, use_errno=True)
        except OSError as exc:
            raise PinnedMapError(
                f"libbpf is not available ({exc}): apt-get install libbpf1"
            ) from exc
        lib.bpf_obj_get.argtypes = [ctypes.c_char_p]
        lib.bpf_obj_get.restype = ctypes.c_int
        for fn in (lib.bpf_map_get_next_key, lib.bpf_map_lookup_elem):
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
        _lib = lib
    return _lib


class PinnedMap(Generic[K, V]):
    """A pinned (non per-CPU) map read through its path.

    Args:
        path: the pin, e.g. ``/sys/fs/bpf/cilia/cilia_policy``.
        key_type, value_type: ctypes layouts (``datapath.layout``).

    Raises:
        PinnedMapError: no such pin, no permission (root needed), or libbpf missing.
    """

    def __init__(self, path: pathlib.Path, key_type: type[K], value_type: type[V]) -> None:
        self.path = path
        self.key_type = key_type
        self.value_type = value_type
        lib = _libbpf()
        fd = lib.bpf_obj_get(str(path).encode())
        if fd < 0:
            err = ctypes.get_errno() or -fd
            raise PinnedMapError(f"cannot open pinned map {path}: {os.strerror(err)}")
        self.fd = fd

    def items(self) -> Iterator[tuple[K, V]]:
        """Every (key, value), in the kernel's iteration order."""
        lib = _libbpf()
        key = self.key_type()
        nxt = self.key_type()
        first = True
        while True:
            rc = lib.bpf_map_get_next_key(
                self.fd, None if first else ctypes.byref(key), ctypes.byref(nxt)
            )
            if rc != 0:
                return
            first = False
            ctypes.memmove(ctypes.byref(key), ctypes.byref(nxt), ctypes.sizeof(key))
            value = self.value_type()
            if lib.bpf_map_lookup_elem(self.fd, ctypes.byref(key), ctypes.byref(value)) != 0:
                continue  # deleted between the two calls
            out = self.key_type()
            ctypes.memmove(ctypes.byref(out), ctypes.byref(key), ctypes.sizeof(key))
            yield out, value

    def close(self) -> None:
        """Close the map's file descriptor (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PinnedMap[K, V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
