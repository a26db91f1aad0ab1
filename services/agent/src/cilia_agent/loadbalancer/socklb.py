"""Socket-LB: load ``bpf_sock.o`` and keep its programs attached to the root cgroup.

Order (:func:`attach`):

1. cgroup2 is mounted on ``--cgroup-root`` unless a cgroup2 is mounted there already
   (upstream mounts its own at ``/run/cilium/cgroupv2``; on a cgroup v1 host with a hybrid
   ``/sys/fs/cgroup/unified`` it is the same single hierarchy, so its root cgroup holds every
   process in every network namespace, the host's included);
2. ``bpf_sock.o`` (``bpf/bpf_sock.c`` compiled ahead of time by ``make bpf``, found in
   ``--bpf-dir``) is loaded with libbpf (``datapath.objects.BpfObject``): the load-balancer
   maps pinned under ``--bpf-pin-dir`` are created or reused (each map's size from the
   flags below), and its eight programs are loaded with the attach types their ELF sections
   name;
3. each program is attached to the root cgroup through a BPF link pinned as
   ``<pin dir>/link_<program>``. A link already pinned there (an agent restart) gets the
   new program with ``BPF_LINK_UPDATE``, an atomic swap: no connect() ever runs without a
   program, and the maps — hence every choice made — are the same pinned maps.

Links on one cgroup run side by side with every other program attached with
``BPF_F_ALLOW_MULTI``, e.g. the socket-LB of other agents on the same machine (a test
cluster: one network namespace per node, one agent each): a program passes a destination
that is not a Service of its own maps, so the next one sees the call unchanged or already
translated to a backend.

The links outlive the agent (pinned), as the tc programs do: Services keep working while
it restarts. :func:`detach` (``--kube-proxy-replacement=false``, or removing the pin dir,
as ``make cluster-down`` and the test kit do) unpins them, which detaches them.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
from dataclasses import dataclass

from cilia_agent.datapath.bpffs import mount_point
from cilia_agent.datapath.errors import DatapathError
from cilia_agent.datapath.libbpf import (
    LibbpfError,
    helper_available,
    link_create,
    link_update,
    obj_get,
    obj_pin,
)
from cilia_agent.datapath.objects import BpfObject, BpfUnavailable, object_path
from cilia_agent.loadbalancer import layout
from cilia_agent.loadbalancer.sizing import sizes_for_pins

log = logging.getLogger(__name__)

# (program, kernel enum bpf_attach_type) — include/uapi/linux/bpf.h
BPF_CGROUP_INET4_CONNECT = 10
BPF_CGROUP_UDP4_SENDMSG = 14
BPF_CGROUP_UDP4_RECVMSG = 19
BPF_CGROUP_INET4_GETPEERNAME = 29
BPF_CGROUP_INET6_CONNECT = 11
BPF_CGROUP_UDP6_SENDMSG = 15
BPF_CGROUP_UDP6_RECVMSG = 20
BPF_CGROUP_INET6_GETPEERNAME = 30
PROGRAMS = (
    ("cil_sock4_connect", BPF_CGROUP_INET4_CONNECT),
    ("cil_sock4_sendmsg", BPF_CGROUP_UDP4_SENDMSG),
    ("cil_sock4_recvmsg", BPF_CGROUP_UDP4_RECVMSG),
    ("cil_sock4_getpeername", BPF_CGROUP_INET4_GETPEERNAME),
    # AF_INET6 sockets to IPv4-mapped VIPs (::ffff:a.b.c.d): dual-stack clients
    ("cil_sock6_connect", BPF_CGROUP_INET6_CONNECT),
    ("cil_sock6_sendmsg", BPF_CGROUP_UDP6_SENDMSG),
    ("cil_sock6_recvmsg", BPF_CGROUP_UDP6_RECVMSG),
    ("cil_sock6_getpeername", BPF_CGROUP_INET6_GETPEERNAME),
)
LINK_PREFIX = "link_"
OBJECT = "bpf_sock"
"""Stem of the compiled object in ``--bpf-dir`` (``bpf_sock.o``)."""
COMPAT_OBJECT = "bpf_sock_compat"
"""Stem of the variant for kernels without ``bpf_set_retval`` (< 5.18): the same source built
with ``CILIA_NO_SET_RETVAL`` (Makefile); a call it refuses (a Service without backends)
fails with the hook's default EPERM instead of ECONNREFUSED, as upstream's socket-LB does on
such kernels."""
VARIANTS = ("auto", "set-retval", "compat")
"""``--bpf-sock-variant`` values: ``auto`` probes the kernel for ``bpf_set_retval`` in
cgroup sock_addr programs and loads :data:`OBJECT` when it has it, else
:data:`COMPAT_OBJECT`; the other two force one (tests force ``compat``)."""
# include/uapi/linux/bpf.h: BPF_PROG_TYPE_CGROUP_SOCK_ADDR, BPF_FUNC_set_retval
_PROG_CGROUP_SOCK_ADDR = 18
_FUNC_SET_RETVAL = 187


class SocketLBUnavailable(DatapathError):
    """The socket-LB cannot be set up (its object, cgroup2 mount, loading or attachment);
    the message says which step and why."""


@dataclass(frozen=True)
class SockConfig:
    """Load and attach options of the socket-LB.

    Attributes:
        bpf_dir: directory holding ``bpf_sock.o`` (``--bpf-dir``).
        pin_dir: bpffs directory of the maps and links (``--bpf-pin-dir``).
        cgroup_root: cgroup2 mount point (``--cgroup-root``).
        lb_map_max: ``--bpf-lb-map-max``.
        sock_rev_map_max: ``--bpf-sock-rev-map-max``.
        variant: ``--bpf-sock-variant`` (:data:`VARIANTS`).
    """

    bpf_dir: pathlib.Path
    pin_dir: pathlib.Path
    cgroup_root: pathlib.Path
    lb_map_max: int = 65536
    sock_rev_map_max: int = 262144
    variant: str = "auto"

    def max_entries(self) -> dict[str, int]:
        """``{map name: entries}`` of every map of ``bpf_sock.o`` (``bpf/lib/lb.h``)."""
        sizes = {name: self.lb_map_max for name in layout.MAPS}
        sizes[layout.REVERSE_SK_MAP] = self.sock_rev_map_max
        return sizes


def ensure_cgroup2(root: pathlib.Path) -> bool:
    """Make sure a cgroup2 is mounted on ``root``; returns True when this call mounted it.

    Raises:
        SocketLBUnavailable: ``mount -t cgroup2`` failed.
    """
    point, fstype = mount_point(root)
    if fstype == "cgroup2" and pathlib.Path(point) == root:
        return False
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "cgroup2", "none", str(root)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SocketLBUnavailable(
            f"mount -t cgroup2 none {root} failed (--cgroup-root): {proc.stderr.strip()}"
        )
    return True


def link_pin(pin_dir: pathlib.Path, program: str) -> pathlib.Path:
    """Where the link of ``program`` is pinned."""
    return pin_dir / f"{LINK_PREFIX}{program}"


def object_stem(variant: str) -> str:
    """The object ``variant`` (:data:`VARIANTS`) loads on this kernel: :data:`OBJECT` or
    :data:`COMPAT_OBJECT` (``auto``: probed once per call, see :data:`VARIANTS`).

    Raises:
        SocketLBUnavailable: an unknown variant, or the probe itself failed (not root).
    """
    if variant == "set-retval":
        return OBJECT
    if variant == "compat":
        return COMPAT_OBJECT
    if variant != "auto":
        raise SocketLBUnavailable(
            f"--bpf-sock-variant {variant!r} is not one of {', '.join(VARIANTS)}"
        )
    try:
        has = helper_available(_PROG_CGROUP_SOCK_ADDR, _FUNC_SET_RETVAL, BPF_CGROUP_INET4_CONNECT)
    except LibbpfError as exc:
        raise SocketLBUnavailable(f"cannot probe bpf_set_retval: {exc}") from exc
    return OBJECT if has else COMPAT_OBJECT


def _load(config: SockConfig) -> BpfObject:
    """``bpf_sock.o`` (or its variant, :func:`object_stem`) loaded (its maps created or reused,
    pinned under the pin dir; a map already pinned keeps its size, see ``sizing``)."""
    stem = object_stem(config.variant)
    if stem != OBJECT:
        log.info(
            "socket-LB without bpf_set_retval (kernel < 5.18 or forced): a Service without "
            "backends is refused with EPERM instead of ECONNREFUSED",
            extra={"object": f"{stem}.o", "variant": config.variant},
        )
    try:
        path = object_path(config.bpf_dir, stem, OBJECT)
        config.pin_dir.mkdir(parents=True, exist_ok=True)
        sizes = sizes_for_pins(config.pin_dir, config.max_entries())
        return BpfObject.load(path, pin_dir=config.pin_dir, max_entries=sizes)
    except (BpfUnavailable, LibbpfError, OSError) as exc:
        raise SocketLBUnavailable(f"cannot load the socket-LB: {exc}") from exc


def create_maps(config: SockConfig) -> None:
    """Create (or keep) the pinned load-balancer maps without attaching anything.

    Raises:
        SocketLBUnavailable: the object is missing or could not be loaded.
    """
    _load(config).close()


def attach(config: SockConfig) -> dict[str, str]:
    """Load and attach (or swap in) the eight programs; returns
    ``{program: "attached" | "replaced"}``.

    Raises:
        SocketLBUnavailable: a step failed (message names it).
    """
    if ensure_cgroup2(config.cgroup_root):
        log.info("mounted cgroup2", extra={"path": str(config.cgroup_root)})
    obj = _load(config)
    result: dict[str, str] = {}
    try:
        cgroup_fd = os.open(config.cgroup_root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name, attach_type in PROGRAMS:
                try:
                    prog_fd = obj.prog_fd(name)
                except KeyError as exc:
                    raise SocketLBUnavailable(f"{OBJECT}.o has no program {name}") from exc
                result[name] = _attach_one(config.pin_dir, name, prog_fd, cgroup_fd, attach_type)
        finally:
            os.close(cgroup_fd)
    finally:
        obj.close()  # the links hold the programs; the maps stay pinned
    return result


def _attach_one(
    pin_dir: pathlib.Path, name: str, prog_fd: int, cgroup_fd: int, attach_type: int
) -> str:
    pin = link_pin(pin_dir, name)
    try:
        link_fd = obj_get(pin)
    except LibbpfError:
        link_fd = -1
    if link_fd >= 0:
        try:
            link_update(link_fd, prog_fd)
            return "replaced"
        except LibbpfError as exc:  # a defunct link (its cgroup is gone): link again
            log.warning(
                "socket-LB link unusable, re-linking", extra={"link": str(pin), "reason": str(exc)}
            )
            pin.unlink(missing_ok=True)
        finally:
            os.close(link_fd)
    try:
        link_fd = link_create(prog_fd, cgroup_fd, attach_type)
    except LibbpfError as exc:
        raise SocketLBUnavailable(f"cannot attach {name} to the cgroup: {exc}") from exc
    try:
        obj_pin(link_fd, pin)
    except LibbpfError as exc:
        raise SocketLBUnavailable(f"cannot pin the link of {name}: {exc}") from exc
    finally:
        os.close(link_fd)
    return "attached"


def attached(pin_dir: pathlib.Path) -> list[str]:
    """The programs whose links are pinned under ``pin_dir``."""
    return [name for name, _ in PROGRAMS if link_pin(pin_dir, name).exists()]


def detach(pin_dir: pathlib.Path) -> list[str]:
    """Unpin (hence detach) every socket-LB link under ``pin_dir``; returns the programs
    detached. The maps stay pinned. A pin that cannot be removed (no permission: not
    root) is logged and left."""
    gone = []
    for name, _ in PROGRAMS:
        pin = link_pin(pin_dir, name)
        try:
            pin.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning(
                "cannot detach a socket-LB link", extra={"link": str(pin), "reason": str(exc)}
            )
            continue
        gone.append(name)
    return gone
