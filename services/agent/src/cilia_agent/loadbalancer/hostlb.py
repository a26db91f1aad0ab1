"""NodePort from the LAN: load ``bpf_host.o`` and attach it to the node's devices.

A client on another host reaches ``<node address>:<nodePort>`` with packets no socket hook
sees; ``cil_from_netdev`` (tc ingress) and ``cil_to_netdev`` (tc egress) of each external
device translate them (upstream's bpf_host programs of the same names; see the C file for
the datapath, ``bpf-lb-mode snat``).

Order (:func:`attach`):

1. the devices: ``--devices`` as given, or (empty) the device of the IPv4 default route
   in the agent's network namespace (upstream auto-detects the same way); none found:
   NodePort is not served from outside and that is logged (a node without a LAN);
2. ``bpf_host.o`` (``bpf/bpf_host.c`` compiled ahead of time by ``make bpf``, found in
   ``--bpf-dir``) is loaded with libbpf (``datapath.objects.BpfObject``): the load-balancer
   maps pinned by the socket-LB are reused, ``cilium_snat_v4_external`` is created or
   reused under ``--bpf-pin-dir``;
3. on each device the two programs through tcx BPF links (Linux 6.6+), pinned as
   ``<pin dir>/link_<program>_<device>``, as the socket-LB's: a link already pinned (an
   agent restart) gets the new program with ``BPF_LINK_UPDATE`` (an atomic swap; flows
   keep their translation state in the pinned map), and tcx runs them beside any other
   program on the device. A kernel without tcx: a ``clsact`` qdisc and two direct-action
   filters (priority :data:`FILTER_PRIO`, ``replace-filter``) instead.

The links outlive the agent (NodePorts keep working while it restarts); :func:`detach`
(``--kube-proxy-replacement=false``) removes links and filters, and so does removing the
pin dir for the links (``make cluster-down``, the test kit), so nothing stays attached to a
device once the agent's state is gone.
"""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cilia_agent.datapath.errors import DatapathError
from cilia_agent.datapath.libbpf import LibbpfError, link_create, link_update, obj_get, obj_pin
from cilia_agent.datapath.objects import BpfObject, BpfUnavailable, object_path
from cilia_agent.loadbalancer import layout
from cilia_agent.loadbalancer.sizing import sizes_for_pins

log = logging.getLogger(__name__)

PROG_FROM_NETDEV = "cil_from_netdev"
PROG_TO_NETDEV = "cil_to_netdev"
OBJECT = "bpf_host"
"""Stem of the compiled object in ``--bpf-dir`` (``bpf_host.o``)."""
PARENT_INGRESS = "ffff:fff2"
PARENT_EGRESS = "ffff:fff3"
#: tc filter priority and handle of the NodePort programs (other clsact filters on the
#: device, at other priorities, are left alone).
FILTER_PRIO = 1
FILTER_HANDLE = 0xC1
#: kernel enum bpf_attach_type (include/uapi/linux/bpf.h)
BPF_TCX_INGRESS = 46
BPF_TCX_EGRESS = 47
LINK_PREFIX = "link_"
_AF_INET = 2
_EOPNOTSUPP = 95
_EEXIST = 17
_ENOENT = 2
_EINVAL = 22
_ENODEV = 19


class HostLBUnavailable(DatapathError):
    """The NodePort programs cannot be set up (the object, loading, a device, tc); the
    message says which step and why."""


@dataclass(frozen=True)
class HostConfig:
    """Load and attach options of the NodePort programs.

    Attributes:
        bpf_dir: directory holding ``bpf_host.o`` (``--bpf-dir``).
        pin_dir: bpffs directory of the maps (``--bpf-pin-dir``).
        devices: ``--devices``; empty = the default route's device.
        lb_map_max: ``--bpf-lb-map-max`` (must equal the socket-LB's: the maps are shared).
        nat_max: ``--bpf-nat-global-max`` (entries of ``cilium_snat_v4_external``).
        tunnel: ``--routing-mode tunnel`` (other nodes' pods are behind the tunnel device:
            ``CONFIG.tunnel`` of ``bpf_host.c``).
        masquerade: ``--enable-bpf-masquerade`` (``CONFIG.masquerade``: the programs also
            masquerade pod traffic, as the maps of ``masquerade/bpf.py`` say).
        nat_port_range: ``--bpf-nat-port-range`` (first, last), inclusive.
    """

    bpf_dir: pathlib.Path
    pin_dir: pathlib.Path
    devices: tuple[str, ...] = ()
    lb_map_max: int = 65536
    nat_max: int = 524288
    tunnel: bool = False
    masquerade: bool = False
    nat_port_range: tuple[int, int] = (32768, 65535)

    def max_entries(self) -> dict[str, int]:
        """``{map name: entries}`` of every map of ``bpf_host.o`` (``bpf/lib/lb.h``)."""
        sizes = {name: self.lb_map_max for name in layout.HOST_SHARED_MAPS}
        sizes[layout.NAT_MAP] = self.nat_max
        return sizes

    def program_config(self) -> layout.HostProgramConfig:
        """``CONFIG`` of ``bpf_host.o`` for these options."""
        return layout.HostProgramConfig(
            tunnel=int(self.tunnel),
            masquerade=int(self.masquerade),
            nat_port_min=self.nat_port_range[0],
            nat_port_max=self.nat_port_range[1],
        )


def default_route_devices(ipr: IPRoute) -> list[str]:
    """Names of the devices of the IPv4 default routes of the main table (one per route,
    first seen first); empty when there is none."""
    names: list[str] = []
    for route in ipr.get_routes(family=_AF_INET, table=254):
        if route.get("dst_len") != 0:
            continue
        oif = route.get_attr("RTA_OIF")
        if oif is None:
            continue
        links = ipr.link("get", index=oif)
        name = links[0].get_attr("IFLA_IFNAME") if links else None
        if name and name not in names:
            names.append(str(name))
    return names


def resolve_devices(devices: Sequence[str]) -> dict[str, int]:
    """``{name: ifindex}`` of ``devices`` (or of the default route's devices when empty).

    Raises:
        HostLBUnavailable: a named device does not exist.
    """
    out: dict[str, int] = {}
    with IPRoute() as ipr:
        for name in devices or default_route_devices(ipr):
            try:
                out[name] = int(ipr.link("get", ifname=name)[0]["index"])
            except NetlinkError as exc:
                raise HostLBUnavailable(f"--devices: no device {name!r} ({exc})") from exc
    return out


def load_programs(config: HostConfig) -> tuple[BpfObject, dict[str, int]]:
    """``bpf_host.o`` loaded (maps created or reused, pinned under the pin dir): (the
    object, ``{program: fd}``); close the object once the programs are attached.

    Raises:
        HostLBUnavailable: no object (or a stale one), or libbpf or the verifier refused it.
    """
    try:
        path = object_path(config.bpf_dir, OBJECT)
        config.pin_dir.mkdir(parents=True, exist_ok=True)
        sizes = sizes_for_pins(config.pin_dir, config.max_entries())
        obj = BpfObject.load(
            path, pin_dir=config.pin_dir, config=config.program_config(), max_entries=sizes
        )
    except (BpfUnavailable, LibbpfError, OSError) as exc:
        raise HostLBUnavailable(f"cannot load the NodePort programs: {exc}") from exc
    try:
        fds = {name: obj.prog_fd(name) for name in (PROG_FROM_NETDEV, PROG_TO_NETDEV)}
    except KeyError as exc:
        obj.close()
        raise HostLBUnavailable(f"{OBJECT}.o has no program {exc}") from exc
    return obj, fds


def attach_fds(ifindex: int, fds: dict[str, int]) -> None:
    """Attach ``cil_from_netdev`` (ingress) and ``cil_to_netdev`` (egress) to ``ifindex``
    (idempotent; replaces the programs of an earlier run).

    Raises:
        NetlinkError: tc refused.
    """
    with IPRoute() as ipr:
        try:
            ipr.tc("add", "clsact", ifindex)
        except NetlinkError as exc:
            if exc.code != _EEXIST:
                raise
        for parent, prog in ((PARENT_INGRESS, PROG_FROM_NETDEV), (PARENT_EGRESS, PROG_TO_NETDEV)):
            ipr.tc(
                "replace-filter",
                "bpf",
                ifindex,
                FILTER_HANDLE,
                fd=fds[prog],
                name=prog,
                parent=parent,
                prio=FILTER_PRIO,
                classid=1,
                direct_action=True,
            )


def link_pin(pin_dir: pathlib.Path, program: str, device: str) -> pathlib.Path:
    """Where the tcx link of ``program`` on ``device`` is pinned."""
    return pin_dir / f"{LINK_PREFIX}{program}_{device}"


def attach_links(pin_dir: pathlib.Path, device: str, ifindex: int, fds: dict[str, int]) -> str:
    """Attach both programs to ``ifindex`` through pinned tcx links; returns "attached" or
    "replaced" (an existing pinned link got the new program).

    Raises:
        LibbpfError: the kernel refused (EINVAL/EOPNOTSUPP: no tcx).
    """
    outcome = "attached"
    for prog, attach_type in (
        (PROG_FROM_NETDEV, BPF_TCX_INGRESS),
        (PROG_TO_NETDEV, BPF_TCX_EGRESS),
    ):
        pin = link_pin(pin_dir, prog, device)
        try:
            link_fd = obj_get(pin)
        except LibbpfError:
            link_fd = -1
        if link_fd >= 0:
            try:
                link_update(link_fd, fds[prog])
                outcome = "replaced"
                continue
            except LibbpfError as exc:  # defunct: the device was re-created
                log.warning("NodePort link unusable, re-linking",
                            extra={"link": str(pin), "reason": str(exc)})  # fmt: skip
                pin.unlink(missing_ok=True)
            finally:
                os.close(link_fd)
        link_fd = link_create(fds[prog], ifindex, attach_type)
        try:
            obj_pin(link_fd, pin)
        finally:
            os.close(link_fd)
    return outcome


def attach(config: HostConfig) -> dict[str, str]:
    """Load and attach to every device (see the module docstring); returns
    ``{device: "attached" | "replaced" | "tc"}`` (empty: no device, nothing attached).

    Raises:
        HostLBUnavailable: a step failed (message names it).
    """
    devices = resolve_devices(config.devices)
    if not devices:
        return {}
    obj, fds = load_programs(config)
    out: dict[str, str] = {}
    try:
        for name, ifindex in devices.items():
            try:
                out[name] = attach_links(config.pin_dir, name, ifindex, fds)
                continue
            except LibbpfError as exc:
                if exc.errno not in (_EINVAL, _EOPNOTSUPP):
                    raise HostLBUnavailable(f"cannot attach to {name}: {exc}") from exc
                log.info("no tcx: NodePort programs attached with tc",
                         extra={"device": name, "reason": str(exc)})  # fmt: skip
            try:
                attach_fds(ifindex, fds)
            except NetlinkError as exc:
                raise HostLBUnavailable(f"cannot attach to {name}: {exc}") from exc
            out[name] = "tc"
    finally:
        obj.close()  # the links/filters hold the programs; the maps stay pinned
    return out


def unpin_links(pin_dir: pathlib.Path) -> list[str]:
    """Unpin the NodePort tcx links pinned under ``pin_dir`` (a tcx program stays attached
    only while its link is pinned or held); returns the pin names removed."""
    gone: list[str] = []
    if pin_dir.is_dir():
        for prog in (PROG_FROM_NETDEV, PROG_TO_NETDEV):
            for pin in pin_dir.glob(f"{LINK_PREFIX}{prog}_*"):
                pin.unlink(missing_ok=True)
                gone.append(pin.name)
    return gone


def detach(pin_dir: pathlib.Path, devices: Sequence[str]) -> list[str]:
    """Unpin every NodePort link under ``pin_dir`` and remove the tc filters from
    ``devices`` (or the default route's devices); returns what was removed (link pins,
    device names). Missing devices, pins or filters are fine."""
    gone = unpin_links(pin_dir)
    with IPRoute() as ipr:
        names = list(devices) or default_route_devices(ipr)
        for name in names:
            try:
                ifindex = int(ipr.link("get", ifname=name)[0]["index"])
            except NetlinkError:
                continue
            removed = False
            for parent in (PARENT_INGRESS, PARENT_EGRESS):
                try:
                    ipr.tc(
                        "del-filter", "bpf", ifindex, FILTER_HANDLE, parent=parent,
                        prio=FILTER_PRIO,
                    )  # fmt: skip
                    removed = True
                except NetlinkError as exc:
                    if exc.code not in (_ENOENT, _EINVAL, _ENODEV):
                        raise
            if removed:
                gone.append(name)
    return gone
