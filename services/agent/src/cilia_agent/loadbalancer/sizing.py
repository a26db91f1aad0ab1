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

import errno
import logging
import os
import pathlib
from collections.abc import Mapping

from cilia_agent.datapath.libbpf import LibbpfError, MapInfo, obj_get
from cilia_agent.datapath.libbpf import map_info as fd_map_info

log = logging.getLogger(__name__)


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
        return fd_map_info(fd, f"pinned map {path}")
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
