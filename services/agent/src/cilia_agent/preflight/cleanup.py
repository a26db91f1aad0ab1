"""``clean-state``: remove the agent's state from this node, on request, while no agent runs.

Upstream's clean-cilium-state init container runs ``cilium-dbg post-uninstall-cleanup -f``
with ``--bpf-state`` when ``CILIUM_BPF_STATE`` is "true" (ConfigMap key
``clean-cilium-bpf-state``) and with ``--all-state`` when ``CILIUM_ALL_STATE`` is "true"
(key ``clean-cilium-state``). Cilia's two levels:

* **bpf state**: every pin under ``--bpf-pin-dir`` — the datapath's maps (ipcache, policy,
  conntrack, endpoints, metrics), the load balancer's maps and the socket-LB's cgroup links
  (unpinning a link detaches its program) — then the directory. Programs still attached to
  pod veths keep their own references until the restarted agent replaces them.
* **all state**: the above, plus the host device (``--host-device-name`` and its ``_net``
  peer), the tunnel device (``--tunnel-device``), the routes the agent installed (routing
  protocol 0xC1 in the main table), its ``CILIA_FORWARD`` chain and its nat chain
  ``CILIA_POST_nat`` (masquerade) with their jumps in both iptables backends,
  and the state directory (``--state-dir``: endpoint and node records). Pods keep running
  but lose their endpoints until they are created again.

It refuses while an agent runs on the node: the agent's API socket (``--socket``) accepting a
connection is the sign (a socket file left by a dead agent refuses connections, ECONNREFUSED,
and does not count). In the DaemonSet the step runs in the new agent pod before its agent
starts; the old pod is gone by then (updateStrategy OnDelete).

Pins are only removed from a bpffs mount: a ``--bpf-pin-dir`` on any other filesystem is
refused rather than emptied.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import shutil
import socket
from dataclasses import dataclass, field

from cilia_agent.datapath.bpffs import mount_point
from cilia_agent.datapath.routing import RTPROT_CILIA

RT_TABLE_MAIN = 254


class CleanError(Exception):
    """Cleaning refused or failed (message says why and what to do)."""


class AgentRunning(CleanError):
    """An agent answers on the socket: cleaning under it would break its datapath."""


def agent_running(sock: pathlib.Path, timeout: float = 1.0) -> bool:
    """True when something accepts connections on the unix socket ``sock``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(sock))
    except (TimeoutError, FileNotFoundError, ConnectionRefusedError, OSError):
        return False
    finally:
        s.close()
    return True


@dataclass
class Report:
    """What was removed, one short text per object (``pin cilia_policy``, ``route ...``)."""

    removed: list[str] = field(default_factory=list)


def clean_bpf(pin_dir: pathlib.Path, report: Report, mounts: str | None = None) -> None:
    """Unpin everything under ``pin_dir`` and remove the directory (absent: nothing to do).

    Raises:
        CleanError: ``pin_dir`` is not on bpffs, or a pin cannot be removed.
    """
    if not pin_dir.exists():
        return
    point, fstype = mount_point(pin_dir, mounts)
    if fstype != "bpf":
        raise CleanError(
            f"{pin_dir} is on {fstype or 'an unknown filesystem'}, not bpffs: refusing to "
            "empty it; check --bpf-pin-dir"
        )
    if pathlib.Path(point) == pin_dir:
        raise CleanError(
            f"{pin_dir} is the bpffs mount itself (it holds every program's pins): refusing "
            "to empty it; --bpf-pin-dir must be the agent's directory below it"
        )
    try:
        for path in sorted(pin_dir.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_dir() and not path.is_symlink():
                path.rmdir()
            else:
                path.unlink()
                report.removed.append(f"pin {path.relative_to(pin_dir)}")
        pin_dir.rmdir()
    except OSError as exc:
        hint = "; run as root" if os.geteuid() != 0 else ""
        raise CleanError(f"cannot remove {exc.filename}: {exc.strerror}{hint}") from exc


def clean_network(devices: list[str], report: Report) -> None:
    """Delete ``devices`` (absent ones skipped) and every route of protocol 0xC1.

    Raises:
        CleanError: netlink refused (not root).
    """
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    try:
        with IPRoute() as ipr:
            for route in ipr.get_routes(family=socket.AF_INET, table=RT_TABLE_MAIN):
                if route.get("proto") != RTPROT_CILIA:
                    continue
                dst = f"{route.get_attr('RTA_DST') or '0.0.0.0'}/{route['dst_len']}"
                with contextlib.suppress(NetlinkError):  # gone with a device already
                    ipr.route(  # scope as installed: a link-scope route is not found without
                        "del",
                        dst=dst,
                        proto=RTPROT_CILIA,
                        table=RT_TABLE_MAIN,
                        scope=route["scope"],
                    )
                    report.removed.append(f"route {dst}")
            for name in devices:
                try:
                    ipr.link("del", ifname=name)
                    report.removed.append(f"device {name}")
                except NetlinkError as exc:
                    if exc.code != errno.ENODEV:
                        raise
    except NetlinkError as exc:
        raise CleanError(
            f"cannot remove the agent's devices or routes: {exc}; run as root"
        ) from exc


def clean_state_dir(state_dir: pathlib.Path, report: Report) -> None:
    """Remove ``state_dir`` and everything in it (absent: nothing to do).

    Raises:
        CleanError: ``state_dir`` is ``/`` or cannot be removed.
    """
    if state_dir == pathlib.Path(state_dir.anchor) or not state_dir.exists():
        if state_dir.exists():
            raise CleanError(f"refusing to remove {state_dir}; check --state-dir")
        return
    try:
        count = sum(1 for _ in state_dir.rglob("*"))
        shutil.rmtree(state_dir)
    except OSError as exc:
        raise CleanError(f"cannot remove {state_dir}: {exc.strerror}; run as root") from exc
    report.removed.append(f"state dir {state_dir} ({count} entries)")


def host_devices(host_device: str, tunnel_device: str) -> list[str]:
    """The agent's node devices: the host device, its veth peer, the tunnel device."""
    peer = (
        host_device[: -len("_host")] + "_net"
        if host_device.endswith("_host")
        else host_device[:11] + "_net"
    )
    return [host_device, peer, tunnel_device]


#: Values a boolean ConfigMap key may hold (Go's ``strconv.ParseBool``, lower-cased), and
#: empty (unset).
BOOLEAN_WORDS = frozenset({"", "true", "false", "t", "f", "1", "0"})


class EnvError(ValueError):
    """An environment variable holds no boolean (message names it and its value)."""


def env_true(value: str | None, name: str = "value") -> bool:
    """``"true"`` (any case, surrounding blanks ignored) → True; ``false``, empty, unset and
    the other words of :data:`BOOLEAN_WORDS` → False (upstream's init script acts on exactly
    ``"true"``).

    Raises:
        EnvError: ``value`` is no boolean at all (``"banana"``): a typo must not silently
            mean "do not clean".
    """
    word = (value or "").strip().lower()
    if word not in BOOLEAN_WORDS:
        raise EnvError(f"{name}={value!r}: not a boolean (true or false)")
    return word == "true"


def env_requests(environ: dict[str, str] | os._Environ[str]) -> tuple[bool, bool]:
    """``(bpf_state, all_state)`` requested by ``CILIUM_BPF_STATE`` / ``CILIUM_ALL_STATE``.

    Raises:
        EnvError: one of them holds no boolean.
    """
    return (
        env_true(environ.get("CILIUM_BPF_STATE"), "CILIUM_BPF_STATE"),
        env_true(environ.get("CILIUM_ALL_STATE"), "CILIUM_ALL_STATE"),
    )
