"""BPF masquerade (``--enable-bpf-masquerade``): the maps ``bpf/bpf_host.c`` masquerades by,
kept in step with the same inputs as the iptables chain, and the GC of idle flows.

The translation itself is in ``bpf/bpf_host.c`` (``cil_to_netdev`` SNATs, ``cil_from_netdev``
reverses; see the C file). The agent writes, under ``--bpf-pin-dir``:

- ``cilia_masq_src_v4`` (LPM trie): the sources masqueraded — this node's pod CIDRs (only
  the default pool's with ``--only-masquerade-default-pool``), the plan's ``sources``;
- ``cilium_ipmasq_v4`` (LPM trie, upstream's name): destinations never masqueraded — the
  plan's ``exclusions`` (every pod CIDR of the cluster, ``--ipv4-native-routing-cidr``,
  the ip-masq-agent's nonMasqueradeCIDRs) plus every node's address as a /32 (this node's
  and the others' from the node stream: traffic to nodes keeps the pod's address, as the
  node's own pods' traffic does);
- ``cilia_masq_dev_v4`` (hash): ``ifindex → address`` of each masquerading device — the
  NodePort devices (``--devices``, or the IPv4 default route's), each with its first IPv4
  address (none: the device is left out and that is logged).

Each map is synced by difference: what is wanted and missing is added first, then what is
no longer wanted is removed, so a change never leaves a moment with fewer exclusions than
either the old or the new list has. The inputs and the timing of syncs are those of
:class:`~cilia_agent.masquerade.manager.Masquerade` (start, node stream, IPAM, periodic).
At start, the previous agent's ``CILIA_POST_nat`` chain (an earlier run in iptables mode) is
removed once the maps are written.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import logging
import os
import pathlib
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pyroute2 import IPRoute

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.layout import ip_from_map, ip_to_map
from cilia_agent.datapath.libbpf import LibbpfError, PerCpuMap, PinnedMap, obj_get
from cilia_agent.loadbalancer import hostlb, layout
from cilia_agent.masquerade.manager import Masquerade
from cilia_agent.masquerade.rules import NatChain, Plan, make_plan

log = logging.getLogger(__name__)

_AF_INET = socket.AF_INET


def device_addresses(devices: Sequence[str]) -> dict[int, str]:
    """``{ifindex: first IPv4 address}`` of ``devices`` (or of the IPv4 default route's
    devices when empty), as ``bpf_host.o`` is attached to them (``hostlb``); a device with
    no IPv4 address is left out (logged). Blocking (netlink).

    Raises:
        HostLBUnavailable: a named device does not exist.
    """
    out: dict[int, str] = {}
    with IPRoute() as ipr:
        for name, ifindex in hostlb.resolve_devices(devices).items():
            addrs = [
                a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(family=_AF_INET, index=ifindex)
            ]
            if not addrs:
                log.warning("BPF masquerade: device has no IPv4 address, not masquerading on it",
                            extra={"device": name})  # fmt: skip
                continue
            out[ifindex] = str(addrs[0])
    return out


def _lpm(cidr: str) -> layout.MasqLpmKey:
    net = ipaddress.IPv4Network(cidr, strict=False)
    return layout.MasqLpmKey(prefixlen=net.prefixlen, addr=ip_to_map(str(net.network_address)))


def _cidr(key: layout.MasqLpmKey) -> str:
    return f"{ip_from_map(key.addr)}/{key.prefixlen}"


class BpfMasqMaps:
    """The masquerade maps pinned by ``bpf_host.o`` under ``pin_dir`` (opened on first use:
    they exist once the NodePort programs are loaded).

    Raises (every method):
        LibbpfError: a map is not pinned (``bpf_host.o`` not loaded with these maps: an
            older object; run ``make bpf``) or the kernel refused an update.
    """

    def __init__(self, pin_dir: pathlib.Path) -> None:
        self.pin_dir = pin_dir
        self._maps: dict[str, PinnedMap] = {}  # type: ignore[type-arg]

    def _map(self, name: str) -> PinnedMap:  # type: ignore[type-arg]
        if name not in self._maps:
            key, value = layout.HOST_MAP_LAYOUTS[name]
            self._maps[name] = PinnedMap(self.pin_dir / name, key, value)
        return self._maps[name]

    def _sync_lpm(self, name: str, cidrs: Iterable[str]) -> tuple[int, int]:
        m = self._map(name)
        want = {_cidr(_lpm(c)): _lpm(c) for c in cidrs}
        have = {_cidr(k): k for k in m}
        for cidr, key in want.items():
            if cidr not in have:
                m.update(key, ctypes.c_uint8(1))
        stale = [key for cidr, key in have.items() if cidr not in want]
        for key in stale:
            m.delete(key)
        return len(set(want) - set(have)), len(stale)

    def exclusions(self) -> list[str]:
        """The CIDRs in ``cilium_ipmasq_v4`` now (``a.b.c.d/n``)."""
        return sorted(_cidr(k) for k in self._map(layout.IPMASQ_MAP))

    def ensure(self, plan: Plan, devices: Mapping[int, str]) -> list[str]:
        """Make the maps say ``plan`` (its ``devices`` are ignored) and ``devices``
        (``{ifindex: address}``); returns what changed (``"<map> +added -removed"``),
        empty when nothing did. Exclusions are written first, sources last."""
        done: list[str] = []
        for name, cidrs in ((layout.IPMASQ_MAP, plan.exclusions),
                            (layout.MASQ_SRC_MAP, plan.sources)):  # fmt: skip
            added, removed = self._sync_lpm(name, cidrs)
            if added or removed:
                done.append(f"{name} +{added} -{removed}")
        dev = self._map(layout.MASQ_DEV_MAP)
        have = {int(k.value): int(v.value) for k, v in dev.items()}
        want = {i: ip_to_map(a) for i, a in devices.items()}
        changed = 0
        for ifindex, addr in want.items():
            if have.get(ifindex) != addr:
                dev.update(ctypes.c_uint32(ifindex), ctypes.c_uint32(addr))
                changed += 1
        for ifindex in set(have) - set(want):
            dev.delete(ctypes.c_uint32(ifindex))
            changed += 1
        if changed:
            done.append(f"{layout.MASQ_DEV_MAP} {changed}")
        return done

    def clear(self) -> None:
        """Empty the three maps: nothing is masqueraded any more."""
        for name in (layout.MASQ_DEV_MAP, layout.MASQ_SRC_MAP, layout.IPMASQ_MAP):
            self._map(name).clear()

    def close(self) -> None:
        """Close the map fds (the maps stay pinned)."""
        for m in self._maps.values():
            m.close()
        self._maps.clear()


class BpfMasquerade(Masquerade):
    """The BPF masquerade of this node's pods: :class:`Masquerade`'s inputs and timing,
    written into :class:`BpfMasqMaps` instead of ``CILIA_POST_nat``.

    Args:
        maps: the pinned masquerade maps.
        chain: the iptables chain of the other mode, removed at start (an earlier run).
        device_addresses: ``() -> {ifindex: address}`` of the masquerading devices
            (default :func:`device_addresses` of ``--devices``).
        node_addresses: ``() -> [address, ...]`` of this node (never masqueraded to).
        Others: as :class:`Masquerade`.
    """

    def __init__(
        self,
        maps: BpfMasqMaps,
        chain: NatChain,
        pod_cidrs: Callable[[], Mapping[str, Sequence[str]]],
        default_pool: Callable[[], str],
        device_addrs: Callable[[], Mapping[int, str]],
        node_addresses: Callable[[], Sequence[str]],
        executor: Executor | None,
        registry: CollectorRegistry,
        **kw: object,
    ) -> None:
        super().__init__(chain, pod_cidrs, default_pool, lambda: (), executor, registry, **kw)  # type: ignore[arg-type]
        self.maps = maps
        self.device_addrs = device_addrs
        self.node_addresses = node_addresses
        self.remote_addresses: tuple[str, ...] = ()
        self.devices_applied: dict[int, str] = {}

    def plan(self) -> Plan:
        """The maps' contents as the inputs ask now (blocking: netlink, the file)."""
        plan = super().plan()
        nodes = [f"{a}/32" for a in (*self.node_addresses(), *self.remote_addresses) if a]
        excl = make_plan((), [*plan.exclusions, *nodes], ())
        return Plan(plan.sources, excl.exclusions, ())

    def _apply(self, check: bool) -> Plan:
        plan = self.plan()
        devices = dict(self.device_addrs())
        if plan == self.applied and devices == self.devices_applied and not check:
            return plan
        done = self.maps.ensure(plan, devices)
        for what in done:
            self.syncs.labels(what=what.split(" ")[0]).inc()
        if done:
            log.info("BPF masquerade maps written", extra={
                "done": done, "sources": list(plan.sources), "exclusions": list(plan.exclusions),
                "devices": {socket.if_indextoname(i) if _exists(i) else str(i): a
                            for i, a in devices.items()}})  # fmt: skip
        self.devices_applied = devices
        self.rules.labels(kind="exclude").set(len(plan.exclusions))
        self.rules.labels(kind="masquerade").set(len(plan.sources) * max(1, len(devices)))
        return plan

    async def start(self) -> None:
        """The first sync, before pods are served; until the node stream delivers the other
        nodes, the exclusions a previous agent left in ``cilium_ipmasq_v4`` stay (as the
        iptables mode keeps its chain's). Then the iptables chain of an earlier run in
        iptables mode is removed.

        Raises:
            LibbpfError: the maps are missing or cannot be written.
            IptablesError: the old chain cannot be removed.
        """
        loop = asyncio.get_running_loop()
        if not self._nodes_known:
            self.remote_cidrs = tuple(
                await loop.run_in_executor(self.executor, self.maps.exclusions)
            )
        await self.sync(check=True)
        removed = await loop.run_in_executor(self.executor, self.chain.remove)
        if removed:
            log.info(
                "iptables masquerade chain removed (BPF masquerade on)", extra={"removed": removed}
            )

    async def nodes_changed(self, nodes: Mapping[str, cp.Node]) -> None:
        """:class:`~cilia_agent.node.manager.NodeListener`: other nodes' pod CIDRs and
        addresses."""
        self.remote_addresses = tuple(sorted({a for n in nodes.values() for a in n.addresses}))
        await super().nodes_changed(nodes)


def _exists(ifindex: int) -> bool:
    try:
        socket.if_indextoname(ifindex)
    except OSError:
        return False
    return True


class NatStats(Collector):
    """Prometheus collector of ``cilia_nat_stats`` (per-CPU counters summed at scrape):
    ``cilia_nat_masquerade_flows_total`` (masqueraded flows started) and
    ``cilia_nat_port_exhausted_total{kind="masquerade"|"nodeport"}`` (packets dropped: no
    free NAT port among the tries in ``--bpf-nat-port-range``). A map not pinned reads as
    nothing."""

    def __init__(self, pin_dir: pathlib.Path) -> None:
        self.pin_dir = pin_dir

    def _read(self) -> dict[int, int]:
        try:
            fd = obj_get(self.pin_dir / layout.NAT_STATS_MAP, "map")
        except LibbpfError:
            return {}
        try:
            m = PerCpuMap(fd, layout.NAT_STATS_MAP, ctypes.c_uint32, ctypes.c_uint64)
        finally:
            os.close(fd)
        try:
            return {int(k.value): sum(int(v.value) for v in vals) for k, vals in m.items()}
        finally:
            m.close()

    def collect(self):  # type: ignore[no-untyped-def]
        """The two families (see the class docstring)."""
        counts = self._read()
        flows = CounterMetricFamily("cilia_nat_masquerade_flows",
                                    "flows masqueraded by the BPF datapath since the map was created")  # fmt: skip
        flows.add_metric([], counts.get(layout.NAT_STAT_MASQ_NEW, 0))
        yield flows
        drops = CounterMetricFamily("cilia_nat_port_exhausted",
                                    "packets dropped by the BPF NAT: no free port in --bpf-nat-port-range",
                                    labels=["kind"])  # fmt: skip
        drops.add_metric(["masquerade"], counts.get(layout.NAT_STAT_MASQ_EXHAUSTED, 0))
        drops.add_metric(["nodeport"], counts.get(layout.NAT_STAT_NODEPORT_EXHAUSTED, 0))
        yield drops


class MasqGC:
    """Removes masqueraded flows idle longer than ``timeout`` from ``cilium_snat_v4_external``
    (both entries of a flow; NodePort entries are left to the LRU).

    The forward entry's ``created`` is the flow's last forward packet
    (``bpf_ktime_get_ns``, CLOCK_MONOTONIC, compared with ``time.monotonic_ns``); a reply
    entry without its forward entry (evicted by the LRU) goes once it is as old.

    Args:
        pin_dir: ``--bpf-pin-dir``.
        timeout: ``--bpf-nat-masquerade-timeout`` seconds.
        interval: ``--bpf-masquerade-gc-interval`` seconds (0: :meth:`run` returns at once).
        executor: where the map walk runs.
        registry: for ``cilia_nat_masquerade_gc_deleted_total``.
    """

    def __init__(self, pin_dir: pathlib.Path, timeout: float, interval: float,
                 executor: Executor | None, registry: CollectorRegistry) -> None:  # fmt: skip
        self.pin_dir = pin_dir
        self.timeout_ns = int(timeout * 1e9)
        self.interval = interval
        self.executor = executor
        self.deleted = Counter("cilia_nat_masquerade_gc_deleted",
                               "masquerade entries removed from cilium_snat_v4_external by the GC, idle",
                               registry=registry)  # fmt: skip

    def sweep(self, now_ns: int | None = None) -> int:
        """One pass; returns the entries deleted. Blocking (map walk).

        Raises:
            LibbpfError: the map is not pinned.
        """
        now = time.monotonic_ns() if now_ns is None else now_ns
        gone = 0
        with PinnedMap(self.pin_dir / layout.NAT_MAP, layout.NatTuple, layout.NatEntry) as nat:
            entries = [(k, v) for k, v in nat.items() if v.flags & layout.NAT_F_MASQ]
            fwd = {bytes(k) for k, _ in entries if k.flags == layout.NAT_DIR_FWD}
            for key, value in entries:
                if now - value.created < self.timeout_ns:
                    continue
                if key.flags == layout.NAT_DIR_FWD:
                    rev = layout.NatTuple(saddr=key.daddr, sport=key.dport, daddr=value.to_saddr,
                                          dport=value.to_sport, nexthdr=key.nexthdr,
                                          flags=layout.NAT_DIR_REPLY)  # fmt: skip
                    r = nat.lookup(rev)
                    if r is not None and r.to_daddr == key.saddr and r.to_dport == key.sport:
                        gone += nat.delete(rev)
                    gone += nat.delete(key)
                else:
                    orig = layout.NatTuple(saddr=value.to_daddr, sport=value.to_dport,
                                           daddr=key.saddr, dport=key.sport, nexthdr=key.nexthdr,
                                           flags=layout.NAT_DIR_FWD)  # fmt: skip
                    if bytes(orig) not in fwd:
                        gone += nat.delete(key)
        self.deleted.inc(gone)
        return gone

    async def run(self) -> None:
        """:meth:`sweep` every ``interval`` seconds until cancelled (errors logged)."""
        if self.interval <= 0:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval)
            try:
                await loop.run_in_executor(self.executor, self.sweep)
            except LibbpfError as exc:
                log.warning("masquerade GC failed", extra={"reason": str(exc)})
