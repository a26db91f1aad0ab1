"""The agent's pinned BPF maps, read from outside the agent with Debian's ``bpftool`` (root).

Independent of the agent's own map code, so tests compare what the agent says with what the
kernel holds. Layouts: ``bpf/lib/common.h``.
"""

from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

from cilia_testkit.host import sh

#: The agent's default ``--bpf-pin-dir`` (the ``scripts/stack.sh`` stack uses it). Every
#: function here takes the pin dir explicitly: each test kit Stack's agent has its own.
DEFAULT_PIN_DIR = pathlib.Path("/sys/fs/bpf/cilia")


def bpf_map_dump(name: str, pin_dir: pathlib.Path) -> list[tuple[bytes, bytes]]:
    """Raw ``(key, value)`` bytes of the map pinned at ``pin_dir/name``.

    Raises:
        FileNotFoundError: bpftool is not installed (``apt-get install bpftool``;
            scripts/setup.sh installs it) or the pin does not exist.
        subprocess.CalledProcessError: bpftool failed.
    """
    if shutil.which("bpftool") is None:
        raise FileNotFoundError("bpftool not on PATH: apt-get install bpftool (scripts/setup.sh)")
    pin = pin_dir / name
    if not pin.exists():
        raise FileNotFoundError(f"no pinned map {pin}")
    out = sh("bpftool", "-j", "map", "dump", "pinned", str(pin))
    entries = json.loads(out.stdout or "[]")

    def raw(hexes: Sequence[str]) -> bytes:
        return bytes(int(h, 16) for h in hexes)

    return [(raw(e["key"]), raw(e["value"])) for e in entries if "key" in e and "value" in e]


def bpf_endpoints(pin_dir: pathlib.Path) -> dict[int, dict[str, Any]]:
    """The datapath's endpoint map: host veth ifindex → ``{ep_id, identity, ipv4}``.

    Layout ``struct endpoint_info``: u32 ep_id, u32 sec_identity, be32 ipv4,
    u8 enforce_ingress, u8 enforce_egress; key u32 ifindex (host order).
    """
    out: dict[int, dict[str, Any]] = {}
    for key, value in bpf_map_dump("cilia_endpoints", pin_dir):
        out[int.from_bytes(key[:4], "little")] = {
            "ep_id": int.from_bytes(value[0:4], "little"),
            "identity": int.from_bytes(value[4:8], "little"),
            "ipv4": ".".join(str(b) for b in value[8:12]),
        }
    return out


def bpf_ipcache(pin_dir: pathlib.Path) -> dict[str, int]:
    """The datapath's ipcache: ``"a.b.c.d/len"`` → security identity.

    Layout ``struct ipcache_key`` u32 prefixlen (host order), be32 ip;
    ``struct ipcache_value`` u32 sec_identity, be32 node_ip.
    """
    out: dict[str, int] = {}
    for key, value in bpf_map_dump("cilia_ipcache", pin_dir):
        prefixlen = int.from_bytes(key[:4], "little")
        out[f"{'.'.join(str(b) for b in key[4:8])}/{prefixlen}"] = int.from_bytes(
            value[:4], "little"
        )
    return out


__all__ = ["DEFAULT_PIN_DIR", "bpf_endpoints", "bpf_ipcache", "bpf_map_dump"]
