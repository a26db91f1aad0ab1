"""Map sizes for loading ``bpf_sock.o`` / ``bpf_host.o`` over maps an earlier run pinned.

libbpf reuses a pinned map only when its type, key and value sizes, flags **and**
``max_entries`` equal the object's, and refuses the load otherwise. A map cannot be resized
in place, and replacing it would drop every Service, affinity and translation entry that
established connections rely on. So a map already pinned keeps its size: when the flag
(``--bpf-lb-map-max``, ``--bpf-sock-rev-map-max``, ``--bpf-nat-global-max``) asks for
another one, the pinned size is used and a warning says so — the size the agent had when
it compiled with bcc, which reused a pinned map whatever its size. Removing the pin dir
(``make cluster-down``, a node reboot) applies the new size.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import pathlib
from collections.abc import Mapping

from cilia_agent.datapath.libbpf import LibbpfError, libbpf, obj_get

log = logging.getLogger(__name__)


class MapInfo(ctypes.Structure):
    """The head of the kernel's ``struct bpf_map_info`` (include/uapi/linux/bpf.h); the
    kernel fills as many bytes as it is given."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


def map_info(path: pathlib.Path) -> MapInfo | None:
    """The info of the map pinned at ``path``; None when nothing is pinned there.

    Raises:
        LibbpfError: the pin cannot be opened (other than ENOENT) or queried.
    """
    try:
        fd = obj_get(path, "map")
    except LibbpfError as exc:
        if exc.errno == errno.ENOENT:
            return None
        raise
    try:
        info = MapInfo()
        size = ctypes.c_uint32(ctypes.sizeof(info))
        lib = libbpf()
        lib.bpf_obj_get_info_by_fd.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.bpf_obj_get_info_by_fd.restype = ctypes.c_int
        rc = lib.bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size))
        if rc < 0:
            raise LibbpfError(f"cannot query pinned map {path}", ctypes.get_errno() or -rc)
        return info
    finally:
        os.close(fd)


def sizes_for_pins(pin_dir: pathlib.Path, wanted: Mapping[str, int]) -> dict[str, int]:
    """``wanted`` (map name → entries from the flags) with the size of each map already
    pinned under ``pin_dir`` instead, where it differs (logged as a warning naming the map,
    both sizes and how to apply the new one).

    Raises:
        LibbpfError: a pin exists but cannot be queried (no permission).
    """
    out = dict(wanted)
    for name, entries in wanted.items():
        info = map_info(pin_dir / name)
        if info is None or info.max_entries == entries:
            continue
        log.warning(
            "pinned map keeps its size; remove the pin dir to apply the flag",
            extra={"map": name, "pinned": info.max_entries, "flag": entries,
                   "pin_dir": str(pin_dir)},
        )  # fmt: skip
        out[name] = int(info.max_entries)
    return out
