"""The agent as a list of components, built in order, started, stopped in reverse.

Built (``Agent.__init__``, nothing started): metrics → state store → IPAM → Linux
plumbing and its iptables reconciler → the local node (``node/``) → IPAM against the
operator (``ipam/manager``) → the ipcache (``ipcache/``) → the retry queue.

Start (``Agent.start``):

1. the node's persisted state into IPAM, router IP (``node/``); node plumbing
   (ip_forward, iptables, host device); the node's networks, its own address and the MTU
   (``datapath/nodeaddress``: ``--ipv4-node``, ``--mtu 0`` = the device's); the operator
   channel (``--operator k8s:NS/SVC``: its addresses listed once from the Service's
   EndpointSlices, then by the ``operator-discovery`` task, ``controlplane/discovery``);
2. the eBPF owners (``enforcement``: programs compiled once, pinned maps, identity
   allocator, policy engine + streams, endpoint regeneration) unless ``--enable-bpf=false``;
   the socket load balancer (``loadbalancer``) unless ``--kube-proxy-replacement=false``;
3. Hubble over the owners' getters (``hubble/enrich.OwnerResolver``), its ring-buffer reader;
4. the endpoint manager (``endpoint/``) with pool selection (``ipam/selection``) and
   regeneration as hooks; endpoints restored (IPs re-occupied; programs re-attached with
   ``replace-filter`` — filters and maps stay pinned, running pods lose no packets);
5. the CNI-config manager (``cni/manager``): DEL queue replayed; the conflist is written
   when the node is first ready;
6. gRPC sockets (agent, Hubble unix + TCP), metrics (the agent's, and Hubble's own endpoint
   when ``--hubble-metrics`` enables a handler);
7. the operator (``controlplane/``): one channel for the session (Register, demand,
   allocations), ResolvePool, identities and endpoint records, and the watch streams
   (identities, policies, ipcache, nodes, services), each a named task with backoff.

Stop (SIGTERM/SIGINT) runs the started steps in reverse; the conflist (unless
``--cni-uninstall``), the host device, the pods' veths, programs, pinned maps and state files
are kept, so a restarted agent serves the same pods.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent import __version__, loadbalancer
from cilia_agent import enforcement as enforcement_owners
from cilia_agent.api import serve_api
from cilia_agent.cni.manager import CNIConfigManager, cni_config
from cilia_agent.config import Config
from cilia_agent.conntrack.gc import ConntrackGC
from cilia_agent.controlplane import (
    AGENT_DEVICE_PREFIXES,
    ControlPlane,
    OperatorAPI,
    OperatorClient,
    OperatorUnavailable,
    PoolResolver,
    RetryQueue,
    operator_channel,
    read_node_networks,
    reconnect_options,
    run_watch,
)
from cilia_agent.datapath import LinuxDatapath
from cilia_agent.datapath.iptables import Iptables, IptablesReconciler
from cilia_agent.datapath.loader import Datapath
from cilia_agent.datapath.routing import node_routes
from cilia_agent.endpoint import EndpointManager, RestoreReport, StateStore
from cilia_agent.enforcement import Enforcement
from cilia_agent.hubble.enrich import OwnerResolver
from cilia_agent.hubble.service import Hubble, hubble_advertise_address, hubble_config
from cilia_agent.identity.local import LocalControlPlane
from cilia_agent.ipam import IPAM
from cilia_agent.ipam.manager import IPAMManager
from cilia_agent.ipam.node import NodePools
from cilia_agent.ipam.selection import PoolSelector
from cilia_agent.ipcache import IPCache
from cilia_agent.k8s import PodCache
from cilia_agent.masquerade.bpf import (
    BpfMasqMaps,
    BpfMasquerade,
    MasqGC,
    NatStats,
    device_addresses,
)
from cilia_agent.masquerade.ctstats import NfConntrackStats
from cilia_agent.masquerade.manager import Masquerade
from cilia_agent.masquerade.rules import NatChain
from cilia_agent.metrics import Metrics
from cilia_agent.node import LocalNode
from cilia_agent.node.manager import NodeListener, NodeManager, RouteSync
from cilia_agent.preflight import iptables_binary
from cilia_agent.status import Enforced, StatusCollector
from cilia_common.metrics import start_metrics_server
from cilia_common.runtime import announce_listening, run_until_signal
from cilia_common.tasks import Supervisor

log = logging.getLogger(__name__)


class Agent:
    """One node agent.

    Args:
        config: validated configuration.
        static_allocation: ``pool -> [cidr, ...]`` given directly to IPAM as if the
            operator had allocated it, and the node counted as registered. Meant for
            tests and single-host setups without an operator (combine with
            ``Config(operator="")``); the operator's allocations are added on top.
    """

    def __init__(
        self, config: Config, *, static_allocation: Mapping[str, Sequence[str]] | None = None
    ) -> None:
        cfg = self.config = config
        self.static_allocation = {k: list(v) for k, v in (static_allocation or {}).items()}
        self.metrics = Metrics()
        self.store = StateStore(cfg.state_dir, durable=cfg.state_fsync)
        self.ipam = IPAM(
            cfg.ipam_multi_pool_pre_allocation, pending_ttl=cfg.ipam_pending_allocation_ttl
        )
        self.executor = ThreadPoolExecutor(cfg.datapath_workers, thread_name_prefix="datapath")
        self.datapath = LinuxDatapath(
            cfg.host_device_name,
            install_iptables_rules=cfg.install_iptables_rules,
            iptables=Iptables(
                binary=iptables_binary(cfg) if cfg.install_iptables_rules else "iptables",
                timeout=cfg.iptables_timeout,
            ),
        )
        self.iptables_reconciler = IptablesReconciler(
            self.datapath.iptables,
            cfg.iptables_reconcile_interval if cfg.install_iptables_rules else 0.0,
            self.executor,
            self.metrics.registry,
        )
        self.node = LocalNode(
            self.ipam, self.store, self.executor, cfg.ipam_default_ip_pool, cfg.ipam
        )
        self.pools = NodePools(self.ipam, cfg.ipam, static=self.static_allocation)
        self.ipam_manager = IPAMManager(
            self.ipam, self.pools, self.node, self.metrics, cfg.ipam_pending_allocation_ttl
        )
        self.ipcache = IPCache()
        self.retry = RetryQueue(
            min_backoff=cfg.operator_reconnect_min_backoff,
            max_backoff=cfg.operator_reconnect_max_backoff,
        )
        self.tasks = Supervisor(log)
        self.restore_report = RestoreReport()
        self._stops: list[Callable[[], Awaitable[None]]] = []
        self._stopped = asyncio.Event()
        # set by start(), in order
        self.enforcement: Enforcement | None = None
        self.lb: loadbalancer.LoadBalancer | None = None
        self.hubble: Hubble
        self.endpoints: EndpointManager
        self.cni: CNIConfigManager
        self.status: StatusCollector
        self.routes: RouteSync
        self.nodes: NodeManager
        self.pod_mtu = cfg.pod_mtu()
        self.masquerade: Masquerade | None = None

    @property
    def bpf(self) -> Datapath | None:
        """The loaded datapath (None with ``--enable-bpf=false``)."""
        return self.enforcement.bpf if self.enforcement is not None else None

    @property
    def router_ip(self) -> ipaddress.IPv4Address | None:
        """The node's router IP (``node.router_ip``)."""
        return self.node.router_ip

    # --- start/stop -------------------------------------------------------------------
    async def start(self) -> None:
        """Restore state, then serve (see the module docstring). Returns once serving.

        Raises:
            StateError: the state dir or node state is unusable.
            DatapathError: node plumbing failed.
            BindError: the socket or metrics address cannot be bound.
        """
        cfg, loop = self.config, asyncio.get_running_loop()
        self.ipam_manager.start()
        self.node.restore(self.static_allocation)
        await loop.run_in_executor(self.executor, self.datapath.setup_node, self.node.router_ip)
        nets = await loop.run_in_executor(
            self.executor, read_node_networks, (cfg.host_device_name,), AGENT_DEVICE_PREFIXES,
            cfg.ipv4_node,
        )  # fmt: skip
        self.node.addresses = nets.addresses
        self.pod_mtu = cfg.pod_mtu(nets.mtu)
        log.info(
            "node address and MTU",
            extra={"address": nets.addresses[0] if nets.addresses else "", "device": nets.device,
                   "device_mtu": nets.mtu, "mtu_flag": cfg.mtu, "pod_mtu": self.pod_mtu},
        )  # fmt: skip
        channel = await self._operator_channel(cfg)
        control: ControlPlane = (
            OperatorAPI.from_config(cfg, channel) if channel is not None else LocalControlPlane()
        )
        if cfg.enable_bpf:
            self.enforcement = await enforcement_owners.load(
                cfg, self.ipcache, control, self.retry, self.executor, self.metrics
            )
            self.ipcache.set_host_addresses([*nets.addresses, str(self.node.router_ip or "")])
        else:
            log.warning(
                "eBPF datapath disabled (--enable-bpf=false): pods are plumbed but get no "
                "identity, no policy is enforced and Hubble records no flows"
            )
        self.lb = await loadbalancer.start(cfg, self.executor, self.metrics.registry)
        self.routes = RouteSync(
            node_routes(cfg, nets.addresses, self.node.pod_cidrs, self.pod_mtu), self.executor
        )
        await self.routes.setup()
        if cfg.bpf_masquerade_enabled:
            self.masquerade = self._bpf_masquerade(cfg, nets.addresses)
            await self.masquerade.start()
            self.metrics.registry.register(NatStats(cfg.bpf_pin_dir))
        elif cfg.enable_ipv4_masquerade:
            self.masquerade = self._masquerade(cfg, nets.local_networks)
            await self.masquerade.start()
            self.metrics.registry.register(NfConntrackStats())
        enf = self.enforcement
        self.hubble = Hubble(
            hubble_config(cfg, __version__, nets.addresses),
            resolver=OwnerResolver(
                endpoints=enf.regeneration if enf else None,
                ipcache=self.ipcache,
                identities=enf.identities if enf else None,
            ),
            registry=self.metrics.registry,
        )
        self._stops.append(self.hubble.stop)
        if enf is not None:
            await self.hubble.start_reader(enf.bpf)
            self.metrics.scrape_hook.refresh = self.hubble.refresh_datapath_counters
        listeners: list[NodeListener] = [self.routes, self.hubble.peers]
        if self.masquerade is not None:
            listeners.append(self.masquerade)
            self.ipam_manager.on_demand_changed(self.masquerade.poke)
        self.nodes = NodeManager(cfg.node_name, listeners, synced=not cfg.operator)
        if self.masquerade is not None and not cfg.operator:
            await self.masquerade.nodes_changed({})  # no operator: this node is alone
        resolver = (
            PoolResolver.from_config(cfg, channel) if channel and cfg.ipam == "multi-pool" else None
        )
        self.pods = PodCache(cfg.node_name, cfg.cluster_name, cfg.k8s_pod_wait_timeout)
        self.endpoints = EndpointManager(
            ipam=self.ipam,
            datapath=self.datapath,
            store=self.store,
            metrics=self.metrics,
            executor=self.executor,
            mtu=self.pod_mtu,
            node=self.node,
            pools=PoolSelector(
                cfg.ipam,
                self.node,
                self.ipam,
                self.pools,
                resolver,
                allocation_wait=cfg.ipam_allocation_wait if cfg.operator else 0.0,
            ),
            on_change=self.ipam_manager.demand_changed,
            hooks=enf.regeneration if enf else None,
            pods=self.pods,
            services_synced=(
                functools.partial(self.lb.watcher.wait_synced, cfg.endpoint_service_wait_timeout)
                if self.lb is not None and cfg.operator
                else None
            ),
        )
        self.pods.on_change(self._pod_relabelled)
        if enf is not None:  # named ports of a policy resolve on each pod's container ports
            enf.engine.named_ports = self.pods.named_ports
        await self._restore_endpoints()
        self.cni = CNIConfigManager(cni_config(cfg), self.endpoints.delete, self.executor)
        self.node.on_ready(self.cni.write)
        self.node.on_router_ip(self._router_ip_chosen)
        self.node.on_router_moved(
            functools.partial(self.endpoints.move_gateway, wait=cfg.ipam_allocation_wait)
        )
        self.node.on_router_moved(self.ipcache.host_address_moved)
        await self.cni.replay()
        await self.node.persist()
        await self.node.check_ready()
        self.status = StatusCollector(
            cfg,
            self.node,
            self.ipam,
            self.pools,
            self.endpoints,
            Enforced(enf.engine, self.ipcache, self.retry) if enf else None,
            self.hubble.store,
            self.nodes,
            self.routes,
        )
        self._stops.append(await serve_api(cfg, self.endpoints, self.status, self.hubble))
        if cfg.prometheus_serve_addr:
            metrics = start_metrics_server(
                cfg.prometheus_serve_addr, self.metrics.registry, flag="--prometheus-serve-addr"
            )
            announce_listening(log, "metrics", metrics.address)
            self._stops.append(functools.partial(asyncio.to_thread, metrics.close))
        if cfg.hubble_metrics_server and self.hubble.metrics.enabled:
            hubble_metrics = start_metrics_server(
                cfg.hubble_metrics_server,
                self.hubble.metrics.flow_registry,
                flag="--hubble-metrics-server",
            )
            announce_listening(log, "hubble-metrics", hubble_metrics.address)
            self._stops.append(functools.partial(asyncio.to_thread, hubble_metrics.close))
        if channel is not None and isinstance(control, OperatorAPI):
            self._start_operator(cfg, channel, control)
        elif enf is not None:
            enf.streams.local_synced()
        self._spawn("del-queue-replay", self.cni.replay_loop)
        if enf is not None:
            gc = ConntrackGC.from_config(cfg, enf.bpf.ct_map, self.metrics, self.executor)
            self._spawn("conntrack-gc", gc.run)
        if self.iptables_reconciler.interval > 0:
            self._spawn("iptables-reconcile", self.iptables_reconciler.run)
        if self.masquerade is not None:
            self._spawn("masquerade", self.masquerade.run)
        if cfg.bpf_masquerade_enabled:
            masq_gc = MasqGC(cfg.bpf_pin_dir, cfg.bpf_nat_masquerade_timeout,
                             cfg.bpf_masquerade_gc_interval, self.executor, self.metrics.registry)  # fmt: skip
            self._spawn("masquerade-gc", masq_gc.run)

    def _masquerade(self, cfg: Config, networks: Sequence[tuple[str, str]]) -> Masquerade:
        """The iptables masquerade (``--enable-ipv4-masquerade``; masquerade/)."""
        return Masquerade(
            NatChain(iptables_binary(cfg), cfg.iptables_timeout),
            self.ipam.cidrs,
            lambda: self.node.default_pool,
            lambda: networks,
            self.executor,
            self.metrics.registry,
            native_routing_cidr=cfg.ipv4_native_routing_cidr,
            devices=cfg.egress_masquerade_interfaces,
            ip_masq_agent=cfg.ip_masq_agent_config_path if cfg.enable_ip_masq_agent else None,
            only_default_pool=cfg.only_masquerade_default_pool,
            interval=cfg.iptables_reconcile_interval,
        )

    def _bpf_masquerade(self, cfg: Config, addresses: Sequence[str]) -> BpfMasquerade:
        """The BPF masquerade (``--enable-bpf-masquerade``; masquerade/bpf.py) on the
        NodePort devices."""
        return BpfMasquerade(
            BpfMasqMaps(cfg.bpf_pin_dir),
            NatChain(iptables_binary(cfg), cfg.iptables_timeout),
            self.ipam.cidrs,
            lambda: self.node.default_pool,
            functools.partial(device_addresses, tuple(cfg.devices)),
            lambda: addresses,
            self.executor,
            self.metrics.registry,
            native_routing_cidr=cfg.ipv4_native_routing_cidr,
            ip_masq_agent=cfg.ip_masq_agent_config_path if cfg.enable_ip_masq_agent else None,
            only_default_pool=cfg.only_masquerade_default_pool,
            interval=cfg.iptables_reconcile_interval,
        )

    async def _operator_channel(self, cfg: Config) -> Any:
        """The one operator channel (None without ``--operator``): to ``host:port``, or to
        the addresses ``k8s:NAMESPACE/SERVICE`` lists (listed once now, then by the
        ``operator-discovery`` task; see ``controlplane/discovery``). Closed last on stop.

        Raises:
            KubeConfigError: ``k8s:`` without a usable API server configuration.
            TLSFileError: a TLS file is unusable.
        """
        if not cfg.operator:
            return None
        lo, hi = cfg.operator_reconnect_min_backoff, cfg.operator_reconnect_max_backoff
        if not cfg.operator.startswith("k8s:"):
            channel = operator_channel(
                cfg.operator, lo, hi, tls=cfg.operator_tls,
                max_message_bytes=cfg.operator_max_message_bytes,
            )  # fmt: skip
            self._stops.append(channel.close)  # closed last, also after a failed start
            return channel
        from cilia_agent.controlplane.discovery import discovered_channel

        found = discovered_channel(cfg, reconnect_options(lo, hi, cfg.operator_max_message_bytes))
        self._stops.append(found.close)
        await found.refresh()  # a failure is logged; the task below lists again
        self._spawn("operator-discovery", found.run)
        return found

    async def _registered(self, resp: cp.RegisterResponse) -> None:
        """The operator accepted the node: Kubernetes mode or not, then the node's part."""
        self.pods.set_enabled(resp.pods_from_api)
        await self.node.registered(resp)

    async def _pod_relabelled(self, namespace: str, name: str, labels: dict[str, str]) -> None:
        """A running Pod's labels changed: its endpoints get a new identity and policy."""
        await self.endpoints.relabel(namespace, name, labels)

    def _spawn(self, name: str, factory: Callable[[], Coroutine[Any, Any, object]]) -> None:
        cfg = self.config
        self.tasks.spawn(
            name,
            factory,
            min_backoff=cfg.operator_reconnect_min_backoff,
            max_backoff=cfg.operator_reconnect_max_backoff,
        )

    def _start_operator(self, cfg: Config, channel: Any, api: OperatorAPI) -> None:
        """The operator session and the watch streams, on the one channel."""
        operator = OperatorClient(
            address=cfg.operator,
            node_name=cfg.node_name,
            version=__version__,
            timeout=cfg.operator_timeout,
            min_backoff=cfg.operator_reconnect_min_backoff,
            max_backoff=cfg.operator_reconnect_max_backoff,
            exclude_devices=(cfg.host_device_name,),
            demand=self.ipam_manager.demand,
            on_registered=self._registered,
            on_allocation=self.ipam_manager.apply_allocation,
            hubble_address=functools.partial(hubble_advertise_address, cfg),
            on_demand_sent=self.ipam_manager.demand_sent,
            channel=channel,
            alias_uses=self.lb.usage.uses if self.lb is not None and self.lb.usage else None,
            ipv4_node=cfg.ipv4_node,
        )
        self.ipam_manager.on_demand_changed(operator.demand_changed)
        self._spawn("operator-session", operator.run)
        if self.lb is not None and self.lb.usage is not None:
            loop = functools.partial(self.lb.usage.report_loop, operator.report_alias_use,
                                     cfg.alias_use_report_interval)  # fmt: skip
            self._spawn("alias-use-report", loop)
        if cfg.node_address_check_interval > 0:
            watch = functools.partial(self._watch_addresses, operator)
            self._spawn("node-addresses", watch)
        watches: list[enforcement_owners.Watch] = [
            ("nodes", api.watch_nodes, self.nodes.consume),
            ("pods", functools.partial(self.pods.stream, api.watch_pods), self.pods.consume),
        ]
        if self.enforcement is not None:
            watches += enforcement_owners.watches(self.enforcement, api)
        watches += loadbalancer.watches(self.lb, api)
        for name, open_stream, consume in watches:
            self._spawn(
                f"watch-{name}",
                functools.partial(
                    run_watch,
                    name,
                    open_stream,
                    consume,
                    min_backoff=cfg.operator_reconnect_min_backoff,
                    max_backoff=cfg.operator_reconnect_max_backoff,
                ),
            )

    async def _restore_endpoints(self) -> None:
        """Endpoints from their state files; the eBPF side re-enforces them."""
        loop = asyncio.get_running_loop()
        report = await loop.run_in_executor(self.executor, self.endpoints.restore)
        self.restore_report = report
        if self.enforcement is not None:
            missing = await enforcement_owners.restore(
                self.enforcement, self.endpoints.list(), report.cleaned
            )
            for rec in missing:
                late = functools.partial(
                    enforcement_owners.late_enforce, self.enforcement, self.endpoints, rec
                )
                self._spawn(f"late-enforce-{rec.id}", late)
        log.info(
            "endpoints restored",
            extra={
                "restored": len(report.restored),
                "removed_stale": report.removed_stale,
                "rolled_back": report.rolled_back,
                "bpf": self.enforcement is not None,
            },
        )

    async def _watch_addresses(self, operator: OperatorClient) -> None:
        """Every ``--node-address-check-interval`` s: the routes to other nodes are synced
        again (the kernel drops routes via an address that went away; an admin may delete
        one), and when this node's addresses changed (an address removed, the interface
        renumbered) that is logged and registered again, so the operator's record and every
        other node's routes follow."""
        cfg, loop = self.config, asyncio.get_running_loop()
        while True:
            await asyncio.sleep(cfg.node_address_check_interval)
            if self.nodes.synced:  # repairs routes the kernel or an admin removed
                await self.routes.nodes_changed(self.nodes.nodes)
            nets = await loop.run_in_executor(
                self.executor, read_node_networks, (cfg.host_device_name,),
                AGENT_DEVICE_PREFIXES, cfg.ipv4_node,
            )  # fmt: skip
            if nets.addresses == self.node.addresses:
                continue
            log.warning(
                "node addresses changed; registering again",
                extra={"old": self.node.addresses, "new": nets.addresses},
            )
            try:
                await operator.register_again(nets)
            except OperatorUnavailable as exc:  # tried again at the next check
                log.warning("cannot register the new addresses", extra={"reason": str(exc)})
                continue
            self.node.addresses = nets.addresses

    async def _router_ip_chosen(self, router: ipaddress.IPv4Address) -> None:
        """The first CIDR arrived after start: plumb the router IP, name it in the ipcache."""
        await asyncio.get_running_loop().run_in_executor(
            self.executor, self.datapath.setup_node, router
        )
        if self.enforcement is not None:
            self.ipcache.set_host_addresses([str(router)])

    async def stop(self) -> None:
        """Stop serving in the reverse order of start; keeps pods, programs, pinned maps,
        state files and (unless ``--cni-uninstall``) the conflist. Idempotent."""
        if self._stopped.is_set():
            return
        if hasattr(self, "cni"):
            self.cni.uninstall()
        await self.tasks.stop()
        await self.retry.close()
        for stop in reversed(self._stops):
            try:
                await stop()
            except Exception:
                log.exception("stopping a component failed")
        self._stops.clear()
        self.executor.shutdown(wait=True)
        if self.enforcement is not None:
            self.metrics.scrape_hook.refresh = None
            self.enforcement.bpf.close()
        if self.lb is not None:
            self.lb.close()
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        """Wait until :meth:`stop` has finished."""
        await self._stopped.wait()


def run(config: Config) -> None:
    """Blocking entry point of ``cilia-agent serve``: run until SIGTERM/SIGINT, then stop."""
    agent = Agent(config)
    asyncio.run(run_until_signal(agent.start, agent.stop))
