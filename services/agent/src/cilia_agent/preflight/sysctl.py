"""``sysctl``: the kernel settings the agent needs, applied in the current network namespace.

Upstream's apply-sysctl-overwrites init container (``cilium-sysctlfix``) writes
``/etc/sysctl.d/99-zzz-override_cilium.conf`` turning ``rp_filter`` off for ``lxc*``,
``cilium_*`` and ``all``, and has systemd-sysctl apply it (so systemd's own defaults, which
re-enable strict reverse-path filtering on every new interface, do not win). Here:

* each setting of :data:`DEFAULTS` (and each ``--sysctl-override``) is written to
  ``/proc/sys`` now, for the devices that exist (a ``*`` in the device part is matched
  against ``/proc/sys/net/ipv4/conf/``);
* the same lines go to ``--sysctl-conf-file`` (default
  ``/etc/sysctl.d/99-zzz-override_cilia.conf``; empty = none) so systemd-sysctl, which
  udev runs for every new interface, applies them to the ``lxc*`` veths created later.
  Unlike upstream, systemd-sysctl is not restarted: the values are already written.

Every setting here is per network namespace (``net.ipv4.*``), so the step changes only the
namespace it runs in.
"""

from __future__ import annotations

import fnmatch
import os
import pathlib
from dataclasses import dataclass

PROC_SYS = pathlib.Path("/proc/sys")
DEFAULT_CONF_FILE = "/etc/sysctl.d/99-zzz-override_cilia.conf"


@dataclass(frozen=True)
class Setting:
    """One sysctl: dotted ``key`` (a ``*`` allowed in one component), ``value``, and why."""

    key: str
    value: str
    why: str
    only_if_present: bool = False
    """For a device's key: skipped while the device does not exist (the agent creates it)."""


def defaults(host_device: str = "cilia_host") -> tuple[Setting, ...]:
    """The settings the agent needs (``host_device``: ``--host-device-name``)."""
    rp = "strict reverse-path filtering drops pod traffic the host routes over this device"
    return (
        Setting("net.ipv4.ip_forward", "1", "the host routes between pods and the node network"),
        Setting("net.ipv4.conf.all.rp_filter", "0", "the effective rp_filter is max(all, device)"),
        Setting("net.ipv4.conf.lxc*.rp_filter", "0", rp),
        Setting(f"net.ipv4.conf.{host_device}.rp_filter", "0", rp, only_if_present=True),
        Setting("net.ipv4.conf.cilium_*.rp_filter", "0", rp + " (the tunnel device)"),
    )


def parse_override(text: str) -> Setting:
    """``"net.ipv4.conf.all.accept_local=1"`` → a Setting.

    Raises:
        ValueError: not ``key=value`` with a dotted key of ``[A-Za-z0-9_*.-]``.
    """
    key, sep, value = text.partition("=")
    key, value = key.strip(), value.strip()
    ok = key and all(c.isalnum() or c in "_*.-" for c in key) and "." in key
    if not sep or not ok or not value or ".." in key:
        raise ValueError(f"{text!r} is not key=value (e.g. net.ipv4.conf.all.rp_filter=0)")
    return Setting(key, value, "--sysctl-override")


def paths(key: str, root: pathlib.Path = PROC_SYS) -> list[pathlib.Path]:
    """The ``/proc/sys`` files of ``key`` (a ``*`` expanded against existing entries)."""
    parts = key.split(".")
    found = [root]
    for part in parts:
        nxt = []
        for base in found:
            if "*" in part:
                try:
                    names = sorted(os.listdir(base))
                except OSError:
                    continue
                nxt += [base / n for n in names if fnmatch.fnmatchcase(n, part)]
            else:
                nxt.append(base / part)
        found = nxt
    return found


class SysctlError(Exception):
    """A setting cannot be written (message names the file and what to do)."""


def apply(
    settings: tuple[Setting, ...] | list[Setting], root: pathlib.Path = PROC_SYS
) -> list[str]:
    """Write every setting now; returns one line per value changed (``key: old -> new``).

    A key without ``*`` must exist (unless ``only_if_present``); a glob matching nothing is
    fine (no such device yet).

    Raises:
        SysctlError: a file is missing or not writable (not root, read-only /proc/sys).
    """
    changed = []
    for s in settings:
        for path in paths(s.key, root):
            if s.only_if_present and not path.exists():
                continue
            name = ".".join(path.relative_to(root).parts)
            try:
                old = path.read_text().strip()
                if old != s.value:
                    path.write_text(s.value)
                    changed.append(f"{name}: {old} -> {s.value}")
            except FileNotFoundError as exc:
                raise SysctlError(
                    f"sysctl {name} does not exist on this kernel ({s.why}); drop it or load "
                    "the module that provides it"
                ) from exc
            except OSError as exc:
                raise SysctlError(
                    f"cannot write sysctl {name}={s.value}: {exc.strerror}; run as root with "
                    "a writable /proc/sys (privileged container, host network)"
                ) from exc
    return changed


def check_conf_dir(path: pathlib.Path) -> None:
    """Refuse a conf file whose directory does not exist (see :func:`write_conf`).

    Raises:
        SysctlError: naming the file and the missing directory.
    """
    if not path.parent.is_dir():
        raise SysctlError(
            f"cannot write {path}: no directory {path.parent} (mount the host's "
            "/etc/sysctl.d there, fix --sysctl-conf-file, or pass --sysctl-conf-file='')"
        )


def write_conf(settings: tuple[Setting, ...] | list[Setting], path: pathlib.Path) -> bool:
    """Write ``settings`` as a sysctl.d file (atomically; returns True when it changed).

    The file's directory must exist: it is the host's ``/etc/sysctl.d`` (mounted into the
    init container), and a missing one means a wrong path or a missing mount -- created
    here, the file would land where systemd-sysctl never reads it.

    Raises:
        SysctlError: the directory does not exist or is not writable.
    """
    lines = ["# written by cilia-agent init sysctl; applied by systemd-sysctl to new devices"]
    lines += [f"# {s.why}\n{s.key} = {s.value}" for s in settings]
    text = "\n".join(lines) + "\n"
    check_conf_dir(path)
    try:
        if path.exists() and path.read_text() == text:
            return False
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        raise SysctlError(
            f"cannot write {path}: {exc.strerror}; mount the host's /etc/sysctl.d or pass "
            "--sysctl-conf-file=''"
        ) from exc
    return True
