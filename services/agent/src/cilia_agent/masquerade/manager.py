"""Keeps ``CILIA_POST_nat`` in step with the cluster (iptables masquerade mode).

Inputs of the chain (:class:`~cilia_agent.masquerade.rules.Plan`):

- **sources**: this node's pod CIDRs (every pool; only ``--ipam-default-ip-pool``'s with
  ``--only-masquerade-default-pool``), read from IPAM at every sync;
- **exclusions**: every pod CIDR of the cluster (this node's and every other node's, from
  the node stream), ``--ipv4-native-routing-cidr``, and with ``--enable-ip-masq-agent`` the
  ip-masq-agent list (masquerade/ipmasq.py);
- **devices**: ``--egress-masquerade-interfaces``, or the devices of the IPv4 default
  routes, else the device carrying the node's first address; none found: every device.

Traffic to this node itself is delivered locally and never reaches nat POSTROUTING; traffic
to another node's pods is excluded by their CIDRs (native routing) or leaves by the tunnel
device (VXLAN; its CIDRs are excluded as well). Unlike upstream, native routing does not
require ``--ipv4-native-routing-cidr``: the agent knows every node's pod CIDRs.

Syncs happen at start, after every node-stream change (:meth:`Masquerade.nodes_changed`,
a :class:`~cilia_agent.node.manager.NodeListener`), when IPAM's CIDRs change
(:meth:`Masquerade.poke`, wired to the demand-changed callback) and every ``interval``
seconds (``--iptables-reconcile-interval``; also re-reads the ip-masq-agent file and repairs
a chain or jump someone removed). A sync whose plan equals the last applied one only checks
the chain on the periodic tick.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor

from prometheus_client import CollectorRegistry, Counter, Gauge
from pyroute2 import IPRoute

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.datapath.errors import IptablesError
from cilia_agent.masquerade import ipmasq
from cilia_agent.masquerade.rules import NatChain, Plan, chain_rules, make_plan

log = logging.getLogger(__name__)

_AF_INET = socket.AF_INET
_RT_TABLE_MAIN = 254


def default_route_devices() -> list[str]:
    """Names of the devices of the IPv4 default routes of the main table (first seen first)."""
    names: list[str] = []
    with IPRoute() as ipr:
        for route in ipr.get_routes(family=_AF_INET, table=_RT_TABLE_MAIN):
            if route.get("dst_len") != 0:
                continue
            oif = route.get_attr("RTA_OIF")
            if oif is None:
                continue
            try:
                name = socket.if_indextoname(oif)
            except OSError:
                continue
            if name not in names:
                names.append(name)
    return names


def egress_devices(
    configured: Sequence[str], networks: Sequence[tuple[str, str]]
) -> tuple[str, ...]:
    """``--egress-masquerade-interfaces`` when given; else the default routes' devices;
    else the device of the node's first address (``networks``: ``(ifname, subnet)`` of
    the node, first first); else ``()`` (every device). Blocking (netlink)."""
    if configured:
        return tuple(configured)
    found = default_route_devices()
    if found:
        return tuple(found)
    return (networks[0][0],) if networks else ()


class Masquerade:
    """The iptables masquerade of this node's pods.

    Args:
        chain: the runner of ``CILIA_POST_nat``.
        pod_cidrs: ``() -> {pool: [cidr, ...]}`` of this node (IPAM).
        default_pool: ``() -> name`` of the default pool (``--only-masquerade-default-pool``).
        networks: ``() -> [(ifname, subnet), ...]`` of the node (egress device fallback).
        executor: where iptables runs (never on the event loop).
        registry: Prometheus registry of ``cilia_masquerade_*``.
        native_routing_cidr: ``--ipv4-native-routing-cidr`` ("" = none).
        devices: ``--egress-masquerade-interfaces``.
        ip_masq_agent: ``--ip-masq-agent-config-path`` when ``--enable-ip-masq-agent``.
        only_default_pool: ``--only-masquerade-default-pool``.
        interval: seconds between periodic syncs; 0 = none (start and events only).
    """

    def __init__(
        self,
        chain: NatChain,
        pod_cidrs: Callable[[], Mapping[str, Sequence[str]]],
        default_pool: Callable[[], str],
        networks: Callable[[], Sequence[tuple[str, str]]],
        executor: Executor | None,
        registry: CollectorRegistry,
        *,
        native_routing_cidr: str = "",
        devices: Sequence[str] = (),
        ip_masq_agent: pathlib.Path | None = None,
        only_default_pool: bool = False,
        interval: float = 10.0,
    ) -> None:
        self.chain = chain
        self.pod_cidrs = pod_cidrs
        self.default_pool = default_pool
        self.networks = networks
        self.executor = executor
        self.native_routing_cidr = native_routing_cidr
        self.devices = tuple(devices)
        self.ip_masq_agent = ip_masq_agent
        self.only_default_pool = only_default_pool
        self.interval = interval
        self.remote_cidrs: tuple[str, ...] = ()
        self._nodes_known = False
        self.applied: Plan | None = None
        self._ipmasq: ipmasq.IPMasqConfig | None = None
        self._ipmasq_error = ""
        self._lock = asyncio.Lock()
        self._poked = asyncio.Event()
        self.syncs = Counter(
            "cilia_masquerade_chain_writes",
            "writes of the masquerade chain CILIA_POST_nat or its POSTROUTING jump, by what",
            ["what"],
            registry=registry,
        )
        self.rules = Gauge(
            "cilia_masquerade_rules",
            "rules in CILIA_POST_nat as last applied, by kind (exclude, masquerade)",
            ["kind"],
            registry=registry,
        )

    # -- inputs ---------------------------------------------------------------------
    def _exclusions_ipmasq(self) -> tuple[str, ...]:
        if self.ip_masq_agent is None:
            return ()
        try:
            conf = ipmasq.load(self.ip_masq_agent)
        except ipmasq.IPMasqConfigError as exc:
            # the last good list stays (nothing newly masqueraded by a typo); at start there
            # is none: the defaults, the widest exclusion, rather than masquerading them
            if str(exc) != self._ipmasq_error:
                log.error("ip-masq-agent config rejected; keeping the last good one",
                          extra={"reason": str(exc)})  # fmt: skip
            self._ipmasq_error = str(exc)
            conf = self._ipmasq or ipmasq.IPMasqConfig(
                ipmasq.DEFAULT_NON_MASQ_CIDRS, False, "defaults: config rejected"
            )
        else:
            self._ipmasq_error = ""
            if conf != self._ipmasq:
                log.info("ip-masq-agent config", extra={
                    "source": conf.source, "non_masquerade_cidrs": list(conf.non_masquerade_cidrs),
                    "masq_link_local": conf.masq_link_local})  # fmt: skip
        self._ipmasq = conf
        return conf.exclusions()

    def plan(self) -> Plan:
        """The chain as the inputs ask now (blocking: netlink, the ip-masq-agent file)."""
        pools = self.pod_cidrs()
        local = [c for cidrs in pools.values() for c in cidrs]
        sources = list(pools.get(self.default_pool(), [])) if self.only_default_pool else local
        exclusions = [*local, *self.remote_cidrs, *self._exclusions_ipmasq()]
        if self.native_routing_cidr:
            exclusions.append(self.native_routing_cidr)
        return make_plan(sources, exclusions, egress_devices(self.devices, self.networks()))

    # -- syncing --------------------------------------------------------------------
    def _apply(self, check: bool) -> Plan:
        plan = self.plan()
        if plan == self.applied and not check:
            return plan
        done = self.chain.ensure(chain_rules(plan))
        for what in done:
            self.syncs.labels(what=what.replace(" ", "_")).inc()
        if done:
            log.info("masquerade chain written", extra={
                "done": done, "sources": list(plan.sources), "devices": list(plan.devices),
                "exclusions": list(plan.exclusions)})  # fmt: skip
        self.rules.labels(kind="exclude").set(len(plan.exclusions))
        self.rules.labels(kind="masquerade").set(len(plan.sources) * max(1, len(plan.devices)))
        return plan

    async def sync(self, *, check: bool = False) -> None:
        """Rebuild the chain when the plan changed (``check``: also when the chain or jump
        in the kernel differ from it).

        Raises:
            IptablesError: a command failed (the next sync tries again).
        """
        async with self._lock:
            loop = asyncio.get_running_loop()
            self.applied = await loop.run_in_executor(self.executor, self._apply, check)

    async def start(self) -> None:
        """The first sync, before pods are served. Until the node stream delivers the other
        nodes (the first :meth:`nodes_changed`), the exclusions a previous agent left in the
        chain stay: a restarting agent must not masquerade new connections to other nodes'
        pods in the moment before it knows them again.

        Raises:
            IptablesError: the chain cannot be written (the agent does not start: pods
                without masquerade would reach nothing outside).
        """
        loop = asyncio.get_running_loop()
        existing = await loop.run_in_executor(self.executor, self.chain.read) or []
        if not self._nodes_known:
            self.remote_cidrs = tuple(
                rule[1] for rule in existing if rule[:1] == ["-d"] and rule[-2:] == ["-j", "RETURN"]
            )
        await self.sync(check=True)

    async def nodes_changed(self, nodes: Mapping[str, cp.Node]) -> None:
        """:class:`~cilia_agent.node.manager.NodeListener`: other nodes' pod CIDRs."""
        self._nodes_known = True
        self.remote_cidrs = tuple(sorted({c for n in nodes.values() for c in n.pod_cidrs}))
        await self.sync()

    def poke(self) -> None:
        """This node's CIDRs may have changed: sync soon (callable from the event loop)."""
        self._poked.set()

    async def run(self) -> None:
        """Sync after every :meth:`poke` and every ``interval`` seconds (with a check of
        the kernel's chain) until cancelled."""
        while True:
            timeout = self.interval if self.interval > 0 else None
            try:
                await asyncio.wait_for(self._poked.wait(), timeout)
                check = False
            except TimeoutError:
                check = True
            self._poked.clear()
            try:
                await self.sync(check=check)
            except IptablesError as exc:
                log.warning("masquerade chain sync failed", extra={"reason": str(exc)})
