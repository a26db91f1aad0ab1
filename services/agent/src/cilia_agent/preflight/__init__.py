"""Start-up checks and node set-up of the agent: ``cilia-agent init <step>``.

The Deckhouse module runs these as the agent DaemonSet's init containers, in this order
(each step here is idempotent: running it twice changes nothing the second time):

=================  ==========================  ===============================================
init container     ``cilia-agent init``        what it does
=================  ==========================  ===============================================
check-linux-kernel ``check-kernel``            kernel version and the BPF features, probed
clearing-unnec...  ``iptables-backend``        nft or legacy, as the host; stale chain removed
mount-cgroup       ``mount-cgroup2``           cgroup2 on ``--cgroup-root``
apply-sysctl-...   ``sysctl``                  rp_filter off, ip_forward on, overrides
mount-bpf-fs       ``mount-bpffs``             bpffs on ``/sys/fs/bpf``
clean-cilia-state  ``clean-state``             on request: pins, devices, routes, state files
=================  ==========================  ===============================================

The group is called ``init`` because that is what these are upstream (init containers; the
clean step's script is upstream's ``init-container.sh``); each step's name is the object it
checks or sets, as the module's container names are.

``cilia-agent serve`` runs the checks of :func:`startup_checks` itself before anything else
(kernel, bpffs, cgroup2, iptables backend: milliseconds when all is in place), so a
standalone agent fails early with the same one-line messages.

Exit status of every step: 0 done (or nothing to do), 1 something is missing or could not
be set (one line on stderr naming it and what to do), 2 bad flags, 3 ``clean-state``
refused because an agent is running on this node.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from cilia_agent.config import Config
from cilia_agent.datapath.bpffs import BPFFS_ROOT, mount_point
from cilia_agent.datapath.libbpf import LibbpfError
from cilia_agent.preflight import iptables_backend, kernel
from cilia_agent.preflight.mounts import BPFFS, CGROUP2, MountError, ensure_mounted

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_AGENT_RUNNING = 3

STEPS = (
    "check-kernel",
    "iptables-backend",
    "mount-cgroup2",
    "sysctl",
    "mount-bpffs",
    "clean-state",
)
"""Every step, in the DaemonSet's order (upstream's init containers)."""


class PreflightError(Exception):
    """A step failed: ``step`` and a one-line ``message`` (what is missing, what to do)."""

    def __init__(self, step: str, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message
        self.code = code


#: ``IFF_LOOPBACK`` of a link's flags (Linux ``include/uapi/linux/if.h``).
IFF_LOOPBACK = 0x8


def check_devices(devices: Sequence[str]) -> str:
    """Check the ``--devices`` the NodePort programs go on, in this network namespace
    (netlink): each exists and is not a loopback device (traffic from other hosts never
    arrives on one, so NodePort could not be served there). Returns the summary line.

    Raises:
        PreflightError: step ``devices``: a device is missing (exit 1: the node's
            interfaces, ``ip -br link`` lists them) or is a loopback device (exit 2: the
            flag is wrong).
    """
    from pyroute2 import IPRoute
    from pyroute2.netlink.exceptions import NetlinkError

    with IPRoute() as ipr:
        for name in devices:
            try:
                flags = int(ipr.link("get", ifname=name)[0]["flags"])
            except NetlinkError:
                raise PreflightError(
                    "devices",
                    f"no interface {name!r} on this node: check --devices (ip -br link lists "
                    "the node's interfaces)",
                ) from None
            if flags & IFF_LOOPBACK:
                raise PreflightError(
                    "devices",
                    f"--devices {name}: a loopback device: NodePort traffic from other hosts "
                    "never arrives on it (name the node's external devices, or leave --devices "
                    "empty for the default route's device)",
                    code=EXIT_USAGE,
                )
    return f"NodePort devices {', '.join(devices)} present"


def needs(enable_bpf: bool, socket_lb: bool) -> set[str]:
    """The feature groups (:data:`kernel.Need`) a configuration uses (the socket-LB only
    runs with the eBPF datapath on, as the agent's load balancer)."""
    out = set()
    if enable_bpf:
        out.add("bpf")
        if socket_lb:
            out.add("socklb")
    return out


def check_kernel(release: str, minimum: str, groups: set[str], probe: bool = True) -> list[str]:
    """Version, then the features of ``groups`` probed (``probe=False``: version only).

    Raises:
        PreflightError: too old, a feature missing, or the probes cannot run.
    """
    try:
        lines = [kernel.check_version(release, minimum, groups)]
        if probe and groups:
            lines.append(kernel.check_features(groups))
    except kernel.KernelTooOld as exc:
        raise PreflightError("check-kernel", str(exc)) from exc
    except ValueError as exc:
        raise PreflightError(
            "check-kernel", f"{exc}; give --min-kernel-version as 5.10", EXIT_USAGE
        ) from exc
    except LibbpfError as exc:
        raise PreflightError(
            "check-kernel",
            f"cannot probe BPF features: {exc}; run as root (CAP_BPF, CAP_SYS_ADMIN)",
        ) from exc
    return lines


def mount_bpffs(path: pathlib.Path, mounts: str | None = None) -> str:
    """bpffs exactly on ``path``. Raises PreflightError (wrong filesystem, mount failed)."""
    try:
        done = ensure_mounted(path, BPFFS, flag="--bpffs-root", mounts=mounts)
    except MountError as exc:
        raise PreflightError("mount-bpffs", str(exc)) from exc
    return f"mounted bpffs on {path}" if done else f"bpffs already mounted on {path}"


def mount_cgroup2(path: pathlib.Path, mounts: str | None = None) -> str:
    """cgroup2 exactly on ``path``. Raises PreflightError (wrong filesystem, mount failed)."""
    try:
        done = ensure_mounted(path, CGROUP2, flag="--cgroup-root", mounts=mounts)
    except MountError as exc:
        raise PreflightError("mount-cgroup2", str(exc)) from exc
    return f"mounted cgroup2 on {path}" if done else f"cgroup2 already mounted on {path}"


def pin_dir_on_bpffs(pin_dir: pathlib.Path) -> str:
    """The agent's view: ``pin_dir`` must be on bpffs; when it lies under /sys/fs/bpf and
    nothing is mounted there, bpffs is mounted on /sys/fs/bpf (as the init step would).

    Raises:
        PreflightError: ``pin_dir`` is elsewhere and not on bpffs, or mounting failed.
    """
    _, fstype = mount_point(pin_dir)
    if fstype == BPFFS:
        return f"{pin_dir} is on bpffs"
    if pin_dir == BPFFS_ROOT or pin_dir.is_relative_to(BPFFS_ROOT):
        return mount_bpffs(BPFFS_ROOT)
    raise PreflightError(
        "mount-bpffs",
        f"{pin_dir} is not on a BPF filesystem (it is on {fstype or 'unknown'}); mount one "
        f"there first (cilia-agent init mount-bpffs --bpffs-root DIR) or use --bpf-pin-dir "
        f"under {BPFFS_ROOT}",
    )


def resolve_iptables_backend(choice: str, timeout: float) -> iptables_backend.Detection:
    """``choice`` "nft"/"legacy" as given, "auto" detected (:func:`iptables_backend.detect`).

    Raises:
        PreflightError: no iptables installed, or detection hung.
    """
    if choice in iptables_backend.BACKENDS:
        return iptables_backend.Detection(choice, "--iptables-backend")
    try:
        return iptables_backend.detect(timeout)
    except iptables_backend.BackendError as exc:
        raise PreflightError("iptables-backend", str(exc)) from exc


def iptables_binary(cfg: Config) -> str:
    """The iptables command the agent runs for every rule: ``iptables-nft`` or
    ``iptables-legacy`` (``--iptables-backend``; "auto" is detected here).

    Raises:
        PreflightError: "auto" and no iptables installed.
    """
    det = resolve_iptables_backend(cfg.iptables_backend, cfg.iptables_timeout)
    return iptables_backend.binary(det.backend)


@dataclass(frozen=True)
class StartupResult:
    """What :func:`startup_checks` found: log lines, and the iptables backend to use
    ("" when ``--install-iptables-rules=false``)."""

    lines: list[str]
    iptables_backend: str


def startup_checks(cfg: Config, release: str) -> StartupResult:
    """The agent's own fast path of the init steps, before it changes anything:
    ``--devices`` (NodePort on: each exists, none is a loopback device), kernel (version and probes of the features the configuration uses), bpffs under the
    pin dir (``--enable-bpf``), cgroup2 on ``--cgroup-root`` (socket-LB on), the iptables
    backend (``--install-iptables-rules``). Sysctls and cleaning stay init steps (the
    agent sets ``ip_forward`` itself when it sets up the node).

    Raises:
        PreflightError: the first check that fails (same messages as the init steps).
    """
    socket_lb = cfg.enable_bpf and cfg.bpf_lb_sock and cfg.kube_proxy_replacement_enabled
    # the flag first: a wrong device is refused before the kernel is probed
    lines = (
        [check_devices(cfg.devices)] if socket_lb and cfg.enable_node_port and cfg.devices else []
    )
    groups = needs(cfg.enable_bpf, socket_lb)
    lines += check_kernel(release, "", groups) if groups else []
    if cfg.enable_bpf:
        lines.append(pin_dir_on_bpffs(cfg.bpf_pin_dir))
    if socket_lb:
        lines.append(mount_cgroup2(cfg.cgroup_root))
    backend = ""
    if cfg.install_iptables_rules:
        det = resolve_iptables_backend(cfg.iptables_backend, cfg.iptables_timeout)
        backend = det.backend
        lines.append(f"iptables backend {det.backend} ({det.reason})")
    return StartupResult(lines, backend)
