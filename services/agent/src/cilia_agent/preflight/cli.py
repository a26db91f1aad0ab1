"""``cilia-agent init <step>``: flags of each step and the step runner (one line per result).

Success lines go to stdout as ``cilia-agent init STEP: ...``; a failure is one line on
stderr, ``cilia-agent init STEP: <what is missing>; <what to do>``, and the exit status of
:mod:`cilia_agent.preflight` (1 failed, 2 bad flags, 3 an agent is running).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import TextIO

from cilia_agent import preflight
from cilia_agent.preflight import PreflightError, cleanup, iptables_backend, sysctl, vxlan_offload
from cilia_common.flags import parse_bool

DEFAULT_CGROUP_ROOT = "/run/cilia/cgroupv2"
DEFAULT_PIN_DIR = "/sys/fs/bpf/cilia"
DEFAULT_STATE_DIR = "/var/run/cilia/state"
DEFAULT_SOCKET = "/var/run/cilia/cilia.sock"


def _bool(text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _abs_path(text: str) -> pathlib.Path:
    """A path flag of a step that mounts or removes things: absolute, normalised (``..``
    and symlinks resolved, so a mount already there is recognised); empty or relative is
    refused (exit 2) instead of meaning the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    path = pathlib.Path(text)
    if not path.is_absolute():
        raise argparse.ArgumentTypeError(f"{text!r} is relative: give an absolute path")
    return path.resolve()


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be greater than 0")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``init`` and its steps to the ``cilia-agent`` sub-commands."""
    init = sub.add_parser(
        "init",
        help="node set-up and checks run before the agent (the DaemonSet's init containers)",
        description="Exit status: 0 done, 1 something missing (one line on stderr says what "
        "and what to do), 2 bad flags, 3 clean-state refused: an agent is running.",
    )
    steps = init.add_subparsers(dest="init_step", required=True)
    ipt_timeout = argparse.ArgumentParser(add_help=False)
    ipt_timeout.add_argument(
        "--iptables-timeout", type=_positive, default=10.0,
        help="seconds one iptables command may take (default 10)",
    )  # fmt: skip

    k = steps.add_parser("check-kernel", help="kernel version and the BPF features Cilia uses")
    k.add_argument(
        "--min-kernel-version", default="",
        help="lowest kernel release accepted, dotted (default: the newest any feature in use "
        "needs: 5.10 with the eBPF datapath, for bpf_redirect_neigh; 5.8 for the socket-LB; "
        "bpf_set_retval (5.18) is optional)",
    )  # fmt: skip
    k.add_argument(
        "--enable-bpf",
        type=_bool,
        default=True,
        help="check the tc datapath's features (default true)",
    )
    k.add_argument(
        "--bpf-lb-sock",
        type=_bool,
        default=True,
        help="check the socket-LB's features (default true)",
    )
    k.add_argument("--no-probe", action="store_true", help="version only, no BPF probes")

    b = steps.add_parser("mount-bpffs", help="bpffs mounted on --bpffs-root")
    b.add_argument("--bpffs-root", type=_abs_path, default=pathlib.Path("/sys/fs/bpf"),
                   help="where bpffs must be mounted (default /sys/fs/bpf)")  # fmt: skip

    c = steps.add_parser("mount-cgroup2", help="cgroup2 mounted on --cgroup-root")
    c.add_argument("--cgroup-root", type=_abs_path, default=pathlib.Path(DEFAULT_CGROUP_ROOT),
                   help=f"cgroup v2 mount of the socket-LB programs (default {DEFAULT_CGROUP_ROOT})")  # fmt: skip

    i = steps.add_parser(
        "iptables-backend", parents=[ipt_timeout],
        help="detect nft vs legacy as the host uses it; remove the agent's chain from the other",
    )  # fmt: skip
    i.add_argument("--iptables-backend", choices=["auto", "nft", "legacy"], default="auto",
                   help="auto (default): detect; nft/legacy: take it as given")  # fmt: skip

    s = steps.add_parser("sysctl", help="apply the sysctl settings the agent needs")
    s.add_argument(
        "--host-device-name",
        default="cilia_host",
        help="the agent's host device (default cilia_host)",
    )
    s.add_argument(
        "--sysctl-override", action="append", default=[], metavar="KEY=VALUE",
        help="extra setting, e.g. net.ipv4.conf.all.accept_local=1; repeat or comma-separate",
    )  # fmt: skip
    s.add_argument(
        "--sysctl-conf-file", default=sysctl.DEFAULT_CONF_FILE,
        help=f"sysctl.d file the settings are also written to, for devices created later "
        f"(default {sysctl.DEFAULT_CONF_FILE}; empty = none)",
    )  # fmt: skip

    v = steps.add_parser(
        "handle-vxlan-offload",
        help="VXLAN mode: UDP-tunnel segmentation offload off on the node IP's NIC when its "
        "driver needs it (vmxnet3), as the Deckhouse module's init step",
    )  # fmt: skip
    v.add_argument("--node-ip", default=os.environ.get("NODE_IP", ""),
                   help="the node's IP; its interface is the one changed (default $NODE_IP)")  # fmt: skip
    v.add_argument("--drivers", default=",".join(vxlan_offload.DEFAULT_DRIVERS),
                   help="comma-separated NIC drivers that get the offload turned off "
                   "(default vmxnet3)")  # fmt: skip

    x = steps.add_parser(
        "clean-state", parents=[ipt_timeout],
        help="on request remove BPF pins (--bpf-state) or all the agent's node state (--all-state)",
        description="Also requested by CILIUM_BPF_STATE=true / CILIUM_ALL_STATE=true in the "
        "environment. Refused (exit 3) while an agent answers on --socket.",
    )  # fmt: skip
    x.add_argument("--bpf-state", action="store_true", help="remove every pin under --bpf-pin-dir")
    x.add_argument("--all-state", action="store_true",
                   help="--bpf-state, plus host and tunnel devices, routes, iptables chain, --state-dir")  # fmt: skip
    x.add_argument("--bpf-pin-dir", type=_abs_path, default=pathlib.Path(DEFAULT_PIN_DIR),
                   help=f"(default {DEFAULT_PIN_DIR})")  # fmt: skip
    x.add_argument("--state-dir", type=_abs_path, default=pathlib.Path(DEFAULT_STATE_DIR),
                   help=f"(default {DEFAULT_STATE_DIR})")  # fmt: skip
    x.add_argument("--socket", type=pathlib.Path, default=pathlib.Path(DEFAULT_SOCKET),
                   help=f"the agent's API socket: an answer there means it runs (default {DEFAULT_SOCKET})")  # fmt: skip
    x.add_argument("--host-device-name", default="cilia_host", help="(default cilia_host)")
    x.add_argument("--tunnel-device", default="cilium_vxlan", help="(default cilium_vxlan)")


def _run(args: argparse.Namespace) -> list[str]:
    step = args.init_step
    if step == "check-kernel":
        groups = preflight.needs(args.enable_bpf, args.bpf_lb_sock)
        return preflight.check_kernel(
            os.uname().release, args.min_kernel_version, groups, probe=not args.no_probe
        )
    if step == "mount-bpffs":
        return [preflight.mount_bpffs(args.bpffs_root.absolute())]
    if step == "mount-cgroup2":
        return [preflight.mount_cgroup2(args.cgroup_root.absolute())]
    if step == "iptables-backend":
        return _iptables(args)
    if step == "sysctl":
        return _sysctl(args)
    if step == "handle-vxlan-offload":
        return _vxlan_offload(args)
    return _clean(args)


def _vxlan_offload(args: argparse.Namespace) -> list[str]:
    if not args.node_ip:
        raise PreflightError(
            "handle-vxlan-offload", "no node IP: set NODE_IP or --node-ip", preflight.EXIT_USAGE
        )
    drivers = tuple(d.strip() for d in args.drivers.split(",") if d.strip())
    try:
        return vxlan_offload.handle(args.node_ip, drivers)
    except vxlan_offload.OffloadError as exc:
        raise PreflightError("handle-vxlan-offload", str(exc)) from exc


def _iptables(args: argparse.Namespace) -> list[str]:
    det = preflight.resolve_iptables_backend(args.iptables_backend, args.iptables_timeout)
    lines = [f"{det.backend} ({det.reason}): the agent runs {iptables_backend.binary(det.backend)}"]
    other = "legacy" if det.backend == "nft" else "nft"
    try:
        removed = iptables_backend.remove_agent_chains(other, args.iptables_timeout)  # type: ignore[arg-type]
    except iptables_backend.BackendError as exc:
        raise PreflightError("iptables-backend", str(exc)) from exc
    if removed:
        lines.append(f"removed the agent's stale rules from {other}: {', '.join(removed)}")
    return lines


def _sysctl(args: argparse.Namespace) -> list[str]:
    settings = list(sysctl.defaults(args.host_device_name))
    try:
        for raw in args.sysctl_override:
            settings += [sysctl.parse_override(t) for t in raw.split(",") if t.strip()]
    except ValueError as exc:
        raise PreflightError("sysctl", f"--sysctl-override: {exc}", preflight.EXIT_USAGE) from exc
    try:
        if args.sysctl_conf_file:  # before any sysctl is changed
            sysctl.check_conf_dir(pathlib.Path(args.sysctl_conf_file))
        changed = sysctl.apply(settings)
        lines = [f"set {c}" for c in changed] or ["every setting already in place"]
        if args.sysctl_conf_file:
            path = pathlib.Path(args.sysctl_conf_file)
            if sysctl.write_conf(settings, path):
                lines.append(f"wrote {path}")
    except sysctl.SysctlError as exc:
        raise PreflightError("sysctl", str(exc)) from exc
    return lines


def _clean(args: argparse.Namespace) -> list[str]:
    try:
        env_bpf, env_all = cleanup.env_requests(os.environ)
    except cleanup.EnvError as exc:
        raise PreflightError(
            "clean-state",
            f"{exc} (ConfigMap keys clean-cilia-bpf-state / clean-cilia-state)",
            preflight.EXIT_USAGE,
        ) from None
    all_state = args.all_state or env_all
    bpf_state = args.bpf_state or env_bpf or all_state
    if not bpf_state:
        return ["nothing requested (--bpf-state, --all-state, CILIUM_BPF_STATE, CILIUM_ALL_STATE)"]
    if cleanup.agent_running(args.socket):
        raise PreflightError(
            "clean-state",
            f"an agent answers on {args.socket}; stop it first (its datapath uses this state)",
            preflight.EXIT_AGENT_RUNNING,
        )
    report = cleanup.Report()
    try:
        cleanup.clean_bpf(args.bpf_pin_dir.absolute(), report)
        if all_state:
            devices = cleanup.host_devices(args.host_device_name, args.tunnel_device)
            cleanup.clean_network(devices, report)
            for backend in iptables_backend.BACKENDS:
                for rule in iptables_backend.remove_agent_chains(backend, args.iptables_timeout):
                    report.removed.append(f"iptables-{backend} {rule}")
            cleanup.clean_state_dir(args.state_dir.absolute(), report)
    except (cleanup.CleanError, iptables_backend.BackendError) as exc:
        raise PreflightError("clean-state", str(exc)) from exc
    what = "all state" if all_state else "bpf state"
    if not report.removed:
        return [f"{what}: nothing to remove"]
    return [f"{what}: removed {len(report.removed)}: {', '.join(report.removed)}"]


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run the step ``args.init_step``; returns the exit status."""
    try:
        lines = _run(args)
    except PreflightError as exc:
        err.write(f"cilia-agent init {exc.step}: {exc.message}\n")
        return exc.code
    for line in lines:
        out.write(f"cilia-agent init {args.init_step}: {line}\n")
    return preflight.EXIT_OK
