"""Load the endpoint datapath (``build/bpf/bpf_lxc.o``, compiled from ``bpf/bpf_lxc.c`` by
``make bpf``) with libbpf and attach it with tc.

The object is compiled ahead of time, once, and configured when the agent loads it: map
sizes (``max_entries``) and ``CONFIG`` (monitor aggregation, ring-buffer wakeups) are set
before load, never per endpoint (DESIGN.md §4). Maps are pinned under ``pin_dir`` so they,
and the tc filters holding the programs, outlive the agent: on restart the new programs
replace the old ones in place (a filter of the same priority and handle replaced) on every
endpoint while traffic flows (measured here: 0 of 60 pings lost, environment-notes.md), and
the new object reuses the pins. Filters of agents before 2026-12-02 have the priority the
kernel chose (49152, and a further one below it per restart); attaching to a device that
already has the clsact qdisc (a restore) removes them once the priority-:data:`FILTER_PRIO`
filters are in place.

Attachment per endpoint, on its host-side veth (``lxc…``), as tc ``clsact``
direct-action filters:

* ingress hook (parent ``ffff:fff2``): ``cil_from_container`` — pod egress;
* egress hook (parent ``ffff:fff3``): ``cil_to_container`` — pod ingress.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass

from cilia_agent.datapath import libbpf as lb
from cilia_agent.datapath import rtnl
from cilia_agent.datapath.errors import BpfUnavailable
from cilia_agent.datapath.layout import (
    CtKey,
    CtValue,
    EndpointInfo,
    IpcacheKey,
    IpcacheValue,
    LxcConfig,
    MetricsKey,
    MetricsValue,
    PolicyKey,
    PolicyValue,
    ip_to_map,
)
from cilia_agent.datapath.libbpf import PerCpuMap, PinnedMap
from cilia_agent.datapath.objects import BpfObject, RingBuffer, object_path

__all__ = [
    "BpfUnavailable",
    "Datapath",
    "DatapathConfig",
    "remove_pins",
]

log = logging.getLogger(__name__)

PARENT_INGRESS = "ffff:fff2"
PARENT_EGRESS = "ffff:fff3"
PROG_FROM_CONTAINER = "cil_from_container"
PROG_TO_CONTAINER = "cil_to_container"
#: tc priority of both endpoint filters (handle 1); lower runs first.
FILTER_PRIO = 1
OBJECT = "bpf_lxc"
#: Local endpoints by address (IPv4, network order) → host veth ifindex; sized as
#: ``cilia_endpoints`` (upstream ``cilium_lxc``).
LXC_MAP = "cilia_lxc"
EVENTS_MAP = "cilia_events"
EVENTS_RESCUE_MAP = "cilia_events_rescue"
EVENTS_RESCUE_PAGES = 4  # its size: 4 pages (a ring buffer's size is whole pages)
EVENTS_COUNTERS_MAP = "cilia_events_counters"
EVENTS_LOST = 0  # index of the counter of events no ring took (bpf_lxc.c EVENTS_LOST)
EVENTS_RESCUED = 2  # index of the counter of events the rescue ring took (EVENTS_RESCUED)
_ENOENT = 2
_EEXIST = 17
_EINVAL = 22


# ----- the endpoint datapath ----------------------------------------------------------------


@dataclass(frozen=True)
class DatapathConfig:
    """Load-time options of the datapath: map sizes (``max_entries``) and ``CONFIG``.

    Attributes:
        bpf_dir: directory holding ``bpf_lxc.o`` (``--bpf-dir``;
            :func:`cilia_agent.datapath.objects.default_bpf_dir`).
        pin_dir: bpffs directory for pinned maps (upstream: ``/sys/fs/bpf/tc/globals``).
        ipcache_max: ipcache entries (``--bpf-ipcache-map-max``, default 512000 as upstream).
        policy_max: policy entries for all endpoints (``--bpf-policy-map-max``, default 65536).
        ct_max: conntrack entries, LRU (``--bpf-ct-global-max``, default 262144).
        endpoints_max: local endpoints (default 65535).
        events_pages: ring buffer pages, a power of two (``--bpf-events-ringbuf-pages``, 64).
        events_wakeup_events: the reader is woken for every N-th event of a CPU, or when
            half the ring buffer is unread (1 = every event, as the packet tests read; the
            agent passes
            ``--bpf-events-wakeup-events`` and drains the buffer on a timer as well).
        monitor_aggregation: 0 none, 1 lowest, 2 low, 3 medium, 4 maximum
            (``--monitor-aggregation``, upstream default medium; see bpf/bpf_lxc.c CONFIG).
        monitor_aggregation_interval_ns: periodic update of an active connection
            (``--monitor-aggregation-interval``, 5 s).
        monitor_aggregation_flags: TCP flag bits (byte 13) reported when first seen in a
            direction (``--monitor-aggregation-flags``, default SYN|FIN|RST = 0x07).
        host_legacy_routing: False (default): a forwarded packet from a pod to another pod
            of this node is delivered by ``cil_from_container`` (TTL decremented, MACs from
            the FIB, redirected to the destination's host veth), skipping the host's
            routing and netfilter, as upstream; True: it goes up the host's IP stack
            (``--enable-host-legacy-routing``).
    """

    bpf_dir: pathlib.Path
    pin_dir: pathlib.Path = pathlib.Path("/sys/fs/bpf/cilia")
    ipcache_max: int = 512000
    policy_max: int = 65536
    ct_max: int = 262144
    endpoints_max: int = 65535
    events_pages: int = 64
    events_wakeup_events: int = 1
    monitor_aggregation: int = 3
    monitor_aggregation_interval_ns: int = 5_000_000_000
    monitor_aggregation_flags: int = 0x07
    host_legacy_routing: bool = False

    def lxc_config(self, coarse_clock: bool = False) -> LxcConfig:
        """``CONFIG`` of ``bpf_lxc.o`` for these options; ``coarse_clock``: the kernel has
        ``bpf_ktime_get_coarse_ns`` (:meth:`Datapath.load` probes it), conntrack uses it."""
        return LxcConfig(
            monitor_aggregation_interval_ns=self.monitor_aggregation_interval_ns,
            monitor_aggregation=self.monitor_aggregation,
            events_wakeup_events=self.events_wakeup_events,
            monitor_aggregation_flags=self.monitor_aggregation_flags,
            ct_clock_coarse=int(coarse_clock),
            host_legacy_routing=int(self.host_legacy_routing),
        )

    def max_entries(self) -> dict[str, int]:
        """Map name → ``max_entries`` (a ring buffer's is its size in bytes: pages times the
        page size; the rescue ring's is :data:`EVENTS_RESCUE_PAGES` pages)."""
        return {
            "cilia_ipcache": self.ipcache_max,
            "cilia_endpoints": self.endpoints_max,
            LXC_MAP: self.endpoints_max,
            "cilia_policy": self.policy_max,
            "cilia_ct": self.ct_max,
            EVENTS_MAP: self.events_pages * os.sysconf("SC_PAGE_SIZE"),
            EVENTS_RESCUE_MAP: EVENTS_RESCUE_PAGES * os.sysconf("SC_PAGE_SIZE"),
        }


class Datapath:
    """The loaded programs and typed handles on their maps.

    Create with :meth:`load`. Map handles (``ipcache_map``, ``endpoint_map``,
    ``policy_map``, ``ct_map``: :class:`~cilia_agent.datapath.libbpf.PinnedMap`, usable as
    mappings;
    ``metrics_map``, ``events_counters``: per-CPU) stay valid until :meth:`close`. Methods
    raise :class:`pyroute2.netlink.exceptions.NetlinkError` only for unexpected kernel
    errors; missing devices on detach are ignored.
    """

    def __init__(self, config: DatapathConfig, obj: BpfObject) -> None:
        self.config = config
        self.object = obj
        self._fds = {name: obj.prog_fd(name) for name in (PROG_FROM_CONTAINER, PROG_TO_CONTAINER)}
        self.ipcache_map: PinnedMap[IpcacheKey, IpcacheValue] = obj.map(
            "cilia_ipcache", IpcacheKey, IpcacheValue
        )
        self.endpoint_map: PinnedMap[ctypes.c_uint32, EndpointInfo] = obj.map(
            "cilia_endpoints", ctypes.c_uint32, EndpointInfo
        )
        self.lxc_map: PinnedMap[ctypes.c_uint32, ctypes.c_uint32] = obj.map(
            LXC_MAP, ctypes.c_uint32, ctypes.c_uint32
        )
        self.policy_map: PinnedMap[PolicyKey, PolicyValue] = obj.map(
            "cilia_policy", PolicyKey, PolicyValue
        )
        self.metrics_map: PerCpuMap[MetricsKey, MetricsValue] = obj.percpu_map(
            "cilia_metrics", MetricsKey, MetricsValue
        )
        self.ct_map: PinnedMap[CtKey, CtValue] = obj.map("cilia_ct", CtKey, CtValue)
        self.events_counters: PerCpuMap[ctypes.c_uint32, ctypes.c_uint64] = obj.percpu_map(
            EVENTS_COUNTERS_MAP, ctypes.c_uint32, ctypes.c_uint64
        )

    @classmethod
    def load(cls, config: DatapathConfig) -> Datapath:
        """Load ``bpf_lxc.o`` once (both programs), reusing or creating the pinned maps.

        Raises:
            BpfUnavailable: the object is missing or stale (``make bpf``), bpffs is not
                mounted, a pinned map has other sizes than configured, or the verifier
                refused a program (libbpf's message and the log's tail).
        """
        path = object_path(config.bpf_dir, OBJECT)
        try:  # conntrack's clock: the coarse one where the kernel has it (5.11)
            coarse = lb.helper_available(lb.PROG_TYPE_SCHED_CLS, lb.FUNC_KTIME_GET_COARSE_NS)
        except lb.LibbpfError as exc:
            raise BpfUnavailable(f"cannot probe the kernel's BPF helpers: {exc}") from exc

        def load(coarse_clock: bool) -> BpfObject:
            return BpfObject.load(
                path,
                pin_dir=config.pin_dir,
                config=config.lxc_config(coarse_clock=coarse_clock),
                max_entries=config.max_entries(),
            )

        try:
            obj = load(coarse)
        except BpfUnavailable as exc:
            # The probe (lb.helper_available, the verifier's own answer) should have said
            # so; should the object's verifier still refuse the helper (a kernel wording the
            # probe does not know), it names the helper, and the precise clock serves.
            if not coarse or f"#{lb.FUNC_KTIME_GET_COARSE_NS}" not in str(exc):
                raise
            log.warning("bpf_ktime_get_coarse_ns refused by the verifier: precise clock")
            obj = load(False)
        try:
            dp = cls(config, obj)
            dp._index_endpoints()
        except BaseException:
            obj.close()
            raise
        log.info("datapath loaded", extra={"pin_dir": str(config.pin_dir), "object": str(path)})
        return dp

    def prog_fd(self, name: str) -> int:
        """File descriptor of a loaded program (``cil_from_container`` / ``cil_to_container``),
        e.g. for ``BPF_PROG_TEST_RUN``.

        Raises:
            KeyError: no such program.
        """
        return self._fds[name]

    def ring_buffer(self, callback: Callable[[bytes], None], rescue: bool = False) -> RingBuffer:
        """A consumer of ``cilia_events`` (``rescue``: of ``cilia_events_rescue``, the ring
        that takes what the main one refuses; read it on every pass, it wakes nobody)
        calling ``callback`` with each record (close it)."""
        return self.object.ring_buffer(EVENTS_RESCUE_MAP if rescue else EVENTS_MAP, callback)

    def events_lost(self) -> int:
        """Events the programs could write to neither ring buffer (sum over CPUs of
        ``cilia_events_counters[EVENTS_LOST]``)."""
        return self._events_counter(EVENTS_LOST)

    def events_rescued(self) -> int:
        """Events ``cilia_events`` refused and ``cilia_events_rescue`` took (sum over CPUs
        of ``cilia_events_counters[EVENTS_RESCUED]``)."""
        return self._events_counter(EVENTS_RESCUED)

    def _events_counter(self, index: int) -> int:
        per_cpu = self.events_counters.lookup(ctypes.c_uint32(index))
        return sum(int(v.value) for v in per_cpu) if per_cpu else 0

    # ----- tc attachment -------------------------------------------------------------------

    def attach(self, ifindex: int) -> None:
        """Attach both programs to the host veth ``ifindex`` (idempotent; replaces older
        programs).

        One batch of three rtnetlink requests (:mod:`.rtnl`, one round trip): the clsact
        qdisc (EEXIST: it has one), then ``cil_from_container`` on ingress and
        ``cil_to_container`` on egress as direct-action filters of priority
        :data:`FILTER_PRIO`, handle 1, created or replaced in place (so an agent restart
        swaps the programs without a second filter). When the qdisc was there already,
        ``bpf`` filters of other priorities (older agents') are then removed.

        Raises:
            pyroute2 NetlinkError: the kernel refused (the message names the step).
            OSError: the netlink socket failed.
        """
        with rtnl.Rtnl.open() as ipr:
            qdisc, ingress, egress = ipr.request(
                rtnl.new_clsact(ifindex),
                *(
                    rtnl.replace_bpf_filter(
                        ifindex, parent, self._fds[prog], prog, prio=FILTER_PRIO
                    )
                    for parent, prog in (
                        (rtnl.TC_H_INGRESS_CHILD, PROG_FROM_CONTAINER),
                        (rtnl.TC_H_EGRESS_CHILD, PROG_TO_CONTAINER),
                    )
                ),
            )
            if qdisc.error != _EEXIST:
                qdisc.check(f"clsact qdisc on ifindex {ifindex}")
            ingress.check(f"attaching {PROG_FROM_CONTAINER} to ifindex {ifindex}")
            egress.check(f"attaching {PROG_TO_CONTAINER} to ifindex {ifindex}")
            if qdisc.error == _EEXIST:  # attached before (a restart): older filters go
                self._remove_older_filters(ipr, ifindex)

    @staticmethod
    def _remove_older_filters(ipr: rtnl.Rtnl, ifindex: int) -> None:
        """Delete the ``bpf`` filters of other priorities than :data:`FILTER_PRIO` on both
        hooks of ``ifindex``: those of agents before 2026-12-02 (the kernel chose their
        priority, 49152 and one below per restart). The priority-1 filters run first and
        decide every packet, so removing the others changes no verdict.

        Raises:
            NetlinkError: a dump or a deletion failed (ENOENT: gone meanwhile, ignored).
        """
        for parent in (rtnl.TC_H_INGRESS_CHILD, rtnl.TC_H_EGRESS_CHILD):
            prios = {
                f.prio
                for f in map(
                    rtnl.parse_filter, ipr.dump(rtnl.RTM_GETTFILTER, rtnl.filters(ifindex, parent))
                )
                if f.kind == "bpf" and f.prio not in (0, FILTER_PRIO)
            }
            for prio in sorted(prios):
                reply = ipr.request(rtnl.del_filters(ifindex, parent, prio))[0]
                if reply.error != _ENOENT:
                    reply.check(
                        f"removing the older filters of priority {prio} on ifindex {ifindex}"
                    )
            if prios:
                log.info(
                    "older endpoint filters removed",
                    extra={
                        "ifindex": ifindex,
                        "parent": f"{parent:x}",
                        "priorities": sorted(prios),
                    },
                )

    def detach(self, ifindex: int) -> None:
        """Remove the clsact qdisc (and with it both filters); a missing device is not an error.

        Raises:
            pyroute2 NetlinkError: the kernel refused for another reason.
            OSError: the netlink socket failed.
        """
        with rtnl.Rtnl.open() as ipr:
            reply = ipr.request(rtnl.del_clsact(ifindex))[0]
        if reply.error not in (0, _ENOENT, _EINVAL, 19):
            reply.check(f"removing the clsact qdisc of ifindex {ifindex}")

    # ----- maps ----------------------------------------------------------------------------

    def set_endpoint(self, ifindex: int, info: EndpointInfo) -> None:
        """Register (or update) the endpoint behind host veth ``ifindex``, and its address
        in ``cilia_lxc`` (a changed address replaces the old one there)."""
        key = ctypes.c_uint32(ifindex)
        old = self.endpoint_map.lookup(key)
        self.endpoint_map.update(key, info)
        if old is not None and old.ipv4 != info.ipv4:
            self._unindex(old.ipv4, ifindex)
        if info.ipv4:
            self.lxc_map.update(ctypes.c_uint32(info.ipv4), ctypes.c_uint32(ifindex))

    def delete_endpoint(self, ifindex: int) -> None:
        """Forget the endpoint behind ``ifindex`` and its address (absent is fine)."""
        key = ctypes.c_uint32(ifindex)
        old = self.endpoint_map.lookup(key)
        self.endpoint_map.delete(key)
        if old is not None:
            self._unindex(old.ipv4, ifindex)

    def _unindex(self, ipv4: int, ifindex: int) -> None:
        """Drop ``ipv4`` from ``cilia_lxc`` if it still names ``ifindex`` (an address
        handed to another endpoint since stays with that one)."""
        current = self.lxc_map.lookup(ctypes.c_uint32(ipv4))
        if current is not None and current.value == ifindex:
            self.lxc_map.delete(ctypes.c_uint32(ipv4))

    def _index_endpoints(self) -> None:
        """Make ``cilia_lxc`` the address index of ``cilia_endpoints``: the endpoints'
        addresses added, addresses of no endpoint removed. At load, so that pins written
        by an agent that predates ``cilia_lxc`` (or an index left behind by a crash
        between the two maps' writes) are made whole."""
        wanted = {
            int(info.ipv4): int(k.value) for k, info in self.endpoint_map.items() if info.ipv4
        }
        for key in list(self.lxc_map.keys()):
            if int(key.value) not in wanted:
                self.lxc_map.delete(key)
        for ipv4, ifindex in wanted.items():
            self.lxc_map.update(ctypes.c_uint32(ipv4), ctypes.c_uint32(ifindex))

    def endpoints(self) -> dict[int, EndpointInfo]:
        """Current endpoint map: ifindex → info."""
        return {int(k.value): v for k, v in self.endpoint_map.items()}

    def upsert_ipcache(
        self, cidr_ip: str, prefixlen: int, identity: int, node_ip: str = ""
    ) -> None:
        """Map ``cidr_ip/prefixlen`` to ``identity`` in the ipcache."""
        self.ipcache_map.update(
            IpcacheKey(prefixlen, ip_to_map(cidr_ip)),
            IpcacheValue(identity, ip_to_map(node_ip) if node_ip else 0),
        )

    def delete_ipcache(self, cidr_ip: str, prefixlen: int) -> None:
        """Remove an ipcache entry (absent is fine)."""
        self.ipcache_map.delete(IpcacheKey(prefixlen, ip_to_map(cidr_ip)))

    def close(self) -> None:
        """Release the programs' and maps' file descriptors held by this process (idempotent).

        Attached filters and pinned maps stay in the kernel (pods keep their
        enforcement while the agent is down).
        """
        for handle in (
            self.ipcache_map,
            self.endpoint_map,
            self.lxc_map,
            self.policy_map,
            self.metrics_map,
            self.events_counters,
        ):
            handle.close()
        self.object.close()


def remove_pins(pin_dir: pathlib.Path) -> None:
    """Delete every pinned map under ``pin_dir`` (state clean; only when no endpoint uses them)."""
    if not pin_dir.is_dir():
        return
    for pinned in pin_dir.iterdir():
        pinned.unlink()
    pin_dir.rmdir()
