"""Wires the agent's parts and owns their start/stop order.

Start: state dir → node state (router IP, last allocation) into IPAM →
node datapath (ip_forward, iptables, host device) → eBPF datapath (bpffs
mounted if needed, ``bpf_lxc.c`` compiled once, pinned maps opened, the policy
engine adopts the pinned policy entries, Hubble's ring-buffer reader started) →
restore endpoints (IPs re-occupied; programs re-attached with ``replace-filter``
and endpoint entries rewritten — filters and maps stay pinned throughout, so
running pods keep their enforcement and lose no packets) → gRPC sockets (agent,
Hubble unix + TCP) → metrics → operator session (Register with the Hubble
address; IPAM; identity, policy, ipcache and node watch streams with reconnect).
The conflist is written the first time the agent is ready: registered (now, or
in an earlier run whose allocation was persisted) and ≥1 free address in the
default pool.

IPAM (``--ipam``): :class:`~cilia_agent.ipam.node.NodePools` turns each allocation
(cluster-pool podCIDRs, multi-pool pools, draining CIDRs) into IPAM's CIDRs and computes
the demand and the CIDRs handed back; :class:`~cilia_agent.ipam.selection.PoolSelector`
picks each new pod's pool (multi-pool: the operator's ResolvePool, never cached).

Routes to other nodes' pod CIDRs are not installed yet (single-node datapath):
the ipcache already carries their pods' identities and host IPs for that.

Stop (SIGTERM/SIGINT): operator client and watches → gRPC servers (in-flight
RPCs get ``--shutdown-grace-period``) → Hubble reader → worker threads → BPF
handles (programs stay attached, maps stay pinned) → metrics. The conflist,
the host device, the pods' veths and the state files are kept, so a restarted
agent serves the same pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from prometheus_client import start_http_server

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent import __version__
from cilia_agent.api import ATTACHMENT_SERVICE, DEBUG_SERVICE, AttachmentServicer, DebugServicer
from cilia_agent.cni import uninstall, write_conflist
from cilia_agent.cni.delqueue import ReplayReport, replay
from cilia_agent.config import Config
from cilia_agent.controlplane import (
    OperatorAPI,
    OperatorClient,
    PoolResolver,
    RetryQueue,
    backoff_delay,
    read_node_networks,
    run_watch,
)
from cilia_agent.datapath import LinuxDatapath
from cilia_agent.datapath.iptables import Iptables, IptablesReconciler
from cilia_agent.endpoint import EndpointManager, NodeState, RestoreReport, StateStore
from cilia_agent.endpoint.enforcement import ControlPlane, Enforcement, LocalControlPlane
from cilia_agent.endpoint.state import EndpointRecord
from cilia_agent.hubble.enrich import MemoryResolver
from cilia_agent.hubble.metrics import read_bcc_counters
from cilia_agent.hubble.peer import join_host_port
from cilia_agent.hubble.service import Hubble, HubbleConfig
from cilia_agent.ipam import IPAM
from cilia_agent.ipam.node import Demand, NodePools
from cilia_agent.ipam.selection import PoolSelectingEndpointManager, PoolSelector
from cilia_agent.metrics import Metrics
from cilia_common.grpcserver import BindError, Service, set_serving, start_server

log = logging.getLogger(__name__)

ROUTER_OWNER = "router"


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
        self.config = config
        self.static_allocation = {k: list(v) for k, v in (static_allocation or {}).items()}
        self.metrics = Metrics()
        self.store = StateStore(config.state_dir, durable=config.state_fsync)
        self.ipam = IPAM(
            config.ipam_multi_pool_pre_allocation,
            pending_ttl=config.ipam_pending_allocation_ttl,
        )
        self.datapath = LinuxDatapath(
            config.host_device_name,
            install_iptables_rules=config.install_iptables_rules,
            iptables=Iptables(timeout=config.iptables_timeout),
        )
        self.executor = ThreadPoolExecutor(
            max_workers=config.datapath_workers, thread_name_prefix="datapath"
        )
        # --iptables-reconcile-interval: the rules are re-checked and repaired while serving
        self.iptables_reconciler = IptablesReconciler(
            self.datapath.iptables,
            config.iptables_reconcile_interval if config.install_iptables_rules else 0.0,
            self.executor,
            self.metrics.registry,
        )
        self.node = NodeState()
        self.router_ip: ipaddress.IPv4Address | None = None
        self.default_pool = config.ipam_default_ip_pool
        self.ready = False
        self.not_ready_reason = "starting"
        self.conflist_path = config.cni_conf_dir / config.cni_conf_name
        self.restore_report = RestoreReport()
        self.pools = NodePools(self.ipam, config.ipam, static=self.static_allocation)
        self.selector = PoolSelector(config.ipam, lambda: self.default_pool)
        self.pool_resolver: PoolResolver | None = None
        self.endpoints: EndpointManager = PoolSelectingEndpointManager(
            selector=self.selector,
            operator_error=self.pools.error_about,
            allocation_wait=config.ipam_allocation_wait if config.operator else 0.0,
            wait_when_full=config.ipam == "multi-pool",
            ipam=self.ipam,
            datapath=self.datapath,
            store=self.store,
            metrics=self.metrics,
            executor=self.executor,
            mtu=config.mtu,
            readiness=lambda: None if self.ready else self.not_ready_reason,
            default_pool=lambda: self.default_pool,
            router_ip=lambda: self.router_ip,
            on_change=self._on_endpoints_changed,
        )
        self.operator: OperatorClient | None = None
        self.operator_api: OperatorAPI | None = None
        self.retry = RetryQueue(
            min_backoff=config.operator_reconnect_min_backoff,
            max_backoff=config.operator_reconnect_max_backoff,
        )
        self.bpf: Any = None  # cilia_agent.datapath.loader.Datapath once loaded
        self.enforcement: Enforcement | None = None
        self.hubble: Hubble | None = None
        self.node_addresses: list[str] = []
        self._hubble_server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._server: grpc.aio.Server | None = None
        self._metrics_server: Any = None
        self._stopped = asyncio.Event()
        self._uninstalled = False
        self.del_queue_report = ReplayReport()
        self._alloc_lock = asyncio.Lock()

    # --- start/stop -------------------------------------------------------------------
    async def start(self) -> None:
        """Restore state, then serve. Returns once the socket is serving.

        Raises:
            StateError: the state dir or node state is unusable.
            DatapathError: node plumbing failed.
            BindError: the socket or metrics address cannot be bound.
        """
        cfg = self.config
        loop = asyncio.get_running_loop()

        # A failed allocation grows the demand: send it at once (thread-safe), and again
        # when that request's --ipam-pending-allocation-ttl has run out (it then no longer
        # counts: a pool nothing else uses is handed back without waiting for another change).
        def pending() -> None:
            loop.call_soon_threadsafe(self._on_endpoints_changed)
            loop.call_soon_threadsafe(
                loop.call_later, cfg.ipam_pending_allocation_ttl + 0.5, self._on_endpoints_changed
            )

        self.ipam.on_pending = pending
        self.node = self.store.load_node()
        if self.node.default_pool:
            self.default_pool = self.node.default_pool
        for pool, cidrs in self.node.allocation.items():
            self.ipam.add_cidrs(pool, cidrs)
        for pool, cidrs in self.static_allocation.items():
            self.ipam.add_cidrs(pool, cidrs)
        if self.static_allocation:
            self.node = self.node.model_copy(update={"registered": True})
        if self.node.router_ip:
            self.router_ip = ipaddress.IPv4Address(self.node.router_ip)
            self.ipam.occupy(self.router_ip, ROUTER_OWNER)
        else:
            self._choose_router_ip()
        await loop.run_in_executor(self.executor, self.datapath.setup_node, self.router_ip)
        nets = await loop.run_in_executor(
            self.executor, read_node_networks, (cfg.host_device_name,)
        )
        self.node_addresses = nets.addresses
        self.hubble = Hubble(
            HubbleConfig(
                node_name=cfg.node_name,
                capacity=cfg.hubble_event_buffer_capacity,
                advertise_address=self.hubble_address(self.node_addresses),
                version=__version__,
                queue_size=cfg.hubble_event_queue_size,
            ),
            registry=self.metrics.registry,
        )
        if cfg.enable_bpf:
            await self._load_bpf()
        else:
            log.warning(
                "eBPF datapath disabled (--enable-bpf=false): pods are plumbed but get no "
                "identity, no policy is enforced and Hubble records no flows"
            )
        self.restore_report = await loop.run_in_executor(self.executor, self.endpoints.restore)
        if self.enforcement is not None:
            missing = await self.enforcement.restore(self.endpoints.list())
            # a record cleaned while `creating` may have reached the operator already
            self.enforcement.forget(self.restore_report.cleaned)
            self.enforcement.purge_ipcache(self.restore_report.cleaned)
            for rec in missing:
                self._tasks.append(loop.create_task(self._late_enforce(rec)))
        log.info(
            "endpoints restored",
            extra={
                "restored": len(self.restore_report.restored),
                "removed_stale": self.restore_report.removed_stale,
                "rolled_back": self.restore_report.rolled_back,
                "bpf": self.enforcement is not None,
            },
        )
        await self.replay_del_queue()
        await self._persist_node()
        await self._check_ready()
        self._server, health = await start_server(
            [
                Service(
                    agent_pb2_grpc.add_AttachmentServiceServicer_to_server,
                    AttachmentServicer(self.endpoints, self._router_str),
                    ATTACHMENT_SERVICE,
                ),
                Service(
                    agent_pb2_grpc.add_DebugServiceServicer_to_server,
                    DebugServicer(self.endpoints, self.status),
                    DEBUG_SERVICE,
                ),
            ],
            [f"unix:{cfg.socket}"],
            socket_mode=0o600,
        )
        await set_serving(health, [ATTACHMENT_SERVICE, DEBUG_SERVICE])
        hubble_addresses = [f"unix:{cfg.hubble_socket_path()}"]
        tcp = cfg.hubble_listen()
        if tcp is not None:
            hubble_addresses.append(tcp)
        self._hubble_server, _ = await self.hubble.serve(hubble_addresses)
        log.info(
            "serving",
            extra={"socket": str(cfg.socket), "hubble": hubble_addresses},
        )
        listen = cfg.metrics_listen()
        if listen is not None:
            try:
                self._metrics_server, _ = start_http_server(
                    listen[1], addr=listen[0], registry=self.metrics.registry
                )
            except OSError as exc:
                raise BindError(
                    f"--prometheus-serve-addr {listen[0]}:{listen[1]}: {exc.strerror} "
                    "(another agent on this host? pick another address or '' to disable)"
                ) from exc
        self._update_ipam_gauges()
        if cfg.operator:
            if cfg.ipam == "multi-pool":
                self.pool_resolver = PoolResolver.from_config(cfg)
                self.selector.resolver = self.pool_resolver
            self.operator = OperatorClient(
                address=cfg.operator,
                node_name=cfg.node_name,
                version=__version__,
                timeout=cfg.operator_timeout,
                min_backoff=cfg.operator_reconnect_min_backoff,
                max_backoff=cfg.operator_reconnect_max_backoff,
                exclude_devices=(cfg.host_device_name,),
                demand=self._demand,
                on_registered=self._on_registered,
                on_allocation=self.apply_allocation,
                hubble_address=self.hubble_address,
                on_demand_sent=lambda d, rv: self.pools.release_acknowledged(d.released, rv),
            )
            self.operator.start()
            self._start_watches()
        elif self.enforcement is not None:
            self.enforcement.local_synced()
        self._tasks.append(loop.create_task(self._replay_loop(), name="del-queue-replay"))
        if self.iptables_reconciler.interval > 0:
            self._tasks.append(
                loop.create_task(self.iptables_reconciler.run(), name="iptables-reconcile")
            )

    async def _load_bpf(self) -> None:
        """Mount bpffs if needed, compile and load the datapath, wire policy and Hubble."""
        from cilia_agent.datapath.bpffs import ensure_bpffs
        from cilia_agent.datapath.loader import Datapath, DatapathConfig, default_bpf_dir

        cfg = self.config
        assert self.hubble is not None
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(self.executor, ensure_bpffs, cfg.bpf_pin_dir):
            log.info("mounted bpffs", extra={"path": "/sys/fs/bpf"})
        dp_config = DatapathConfig(
            bpf_dir=cfg.bpf_dir or default_bpf_dir(),
            pin_dir=cfg.bpf_pin_dir,
            ipcache_max=cfg.bpf_ipcache_map_max,
            policy_max=cfg.bpf_policy_map_max,
            ct_max=cfg.bpf_ct_global_max,
            events_pages=cfg.bpf_events_ringbuf_pages,
        )
        started = time.perf_counter()
        self.bpf = await loop.run_in_executor(self.executor, Datapath.load, dp_config)
        for table in ("cilia_ipcache", "cilia_endpoints", "cilia_policy", "cilia_metrics"):
            self.bpf.table(table)  # create bcc's table objects once, on this thread
        control: ControlPlane
        if cfg.operator:
            self.operator_api = OperatorAPI.from_config(cfg)
            control = self.operator_api
        else:
            control = LocalControlPlane()
        resolver = self.hubble.resolver
        assert isinstance(resolver, MemoryResolver)
        self.enforcement = Enforcement(
            datapath=self.bpf,
            resolver=resolver,
            control=control,
            retry=self.retry,
            executor=self.executor,
            metrics=self.metrics,
            node_name=cfg.node_name,
            mode=cfg.enable_policy,
            policy_wait_timeout=cfg.endpoint_policy_wait_timeout,
            policy_map_max=cfg.bpf_policy_map_max,
        )
        adopted = self.enforcement.engine.restore()
        self.endpoints.hooks = self.enforcement
        self.enforcement.set_host_addresses(
            [*self.node_addresses, *([str(self.router_ip)] if self.router_ip else [])]
        )
        await self.hubble.start_reader(self.bpf.bpf)
        hubble_metrics = self.hubble.metrics
        bpf = self.bpf.bpf
        self.metrics.scrape_hook.refresh = lambda: hubble_metrics.update_datapath_counters(
            read_bcc_counters(bpf)
        )
        log.info(
            "eBPF datapath ready",
            extra={
                "pin_dir": str(cfg.bpf_pin_dir),
                "load_s": round(time.perf_counter() - started, 2),
                "adopted_policy_endpoints": len(adopted),
                "policy_mode": cfg.enable_policy,
            },
        )

    def _start_watches(self) -> None:
        api, enf, hubble = self.operator_api, self.enforcement, self.hubble
        if api is None or enf is None or hubble is None:
            return
        cfg = self.config
        peers = hubble.peers

        async def nodes(stream: Any) -> bool:
            await peers.consume_watch(stream)
            return True

        watches: list[tuple[str, Any, Any]] = [
            ("identities", api.watch_identities, enf.consume_identities),
            ("policies", api.watch_policies, enf.consume_policies),
            ("ipcache", api.watch_ipcache, enf.consume_ipcache),
            ("nodes", api.watch_nodes, nodes),
        ]
        loop = asyncio.get_running_loop()
        for name, open_stream, consume in watches:
            self._tasks.append(
                loop.create_task(
                    run_watch(
                        name,
                        open_stream,
                        consume,
                        min_backoff=cfg.operator_reconnect_min_backoff,
                        max_backoff=cfg.operator_reconnect_max_backoff,
                    ),
                    name=f"watch-{name}",
                )
            )

    async def _late_enforce(self, rec: EndpointRecord) -> None:
        """Give an endpoint restored without identity (created with BPF off) its enforcement."""
        assert self.enforcement is not None
        attempt = 0
        cfg = self.config
        while True:
            try:
                identity = await self.enforcement.create(rec, 0)
                await self.endpoints.set_identity(rec.key, identity)
                log.info("restored endpoint enforced", extra={"endpoint_id": rec.id})
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = backoff_delay(
                    attempt, cfg.operator_reconnect_min_backoff, cfg.operator_reconnect_max_backoff
                )
                attempt += 1
                log.warning(
                    "restored endpoint without identity: enforcement failed, retrying",
                    extra={"endpoint_id": rec.id, "reason": str(exc), "retry_in_s": delay},
                )
                await asyncio.sleep(delay)

    def hubble_address(self, addresses: Sequence[str]) -> str:
        """``host:port`` of this node's Hubble TCP server ("" when disabled or no address).

        The host is the listen address's host when one is given, else the node's first IP.
        """
        port = self.config.hubble_port()
        if not self.config.hubble_listen_address or port == 0:
            return ""
        host = self.config.hubble_listen_address.rpartition(":")[0]
        if host in ("", "0.0.0.0", "[::]", "::"):
            host = addresses[0] if addresses else ""
        return join_host_port(host, port) if host else ""

    async def replay_del_queue(self) -> ReplayReport:
        """Replay the plugin's DEL queue (``--cni-del-queue-dir``) through the Del path;
        runs at start after the restore, before serving (:mod:`cilia_agent.cni.delqueue`)."""
        report = await replay(self.config.cni_del_queue_dir, self.endpoints.delete)
        self.del_queue_report = report
        if report.deleted or report.nothing or report.failed or report.corrupt:
            log.info(
                "DEL queue replayed",
                extra={
                    "dir": str(self.config.cni_del_queue_dir),
                    "deleted": len(report.deleted),
                    "nothing_to_delete": len(report.nothing),
                    "failed": report.failed,
                    "corrupt": report.corrupt,
                },
            )
        return report

    async def _replay_loop(self) -> None:
        """Replay the DEL queue every ``--cni-del-queue-replay-interval`` seconds while
        serving: a plugin that found the socket not yet serving queues its DEL after the
        start-up replay. Replays never delete an endpoint newer than the queued DEL."""
        while True:
            await asyncio.sleep(self.config.cni_del_queue_replay_interval)
            try:
                if any(self.config.cni_del_queue_dir.glob("*.del")):
                    await self.replay_del_queue()
            except OSError as exc:
                log.warning("cannot read the DEL queue", extra={"reason": str(exc)})

    async def stop(self) -> None:
        """Stop serving; keeps pods, programs, pinned maps, state files and the conflist
        (idempotent). With ``--cni-uninstall`` the conflist is removed first (no new ADD
        reaches this agent) and the configs ``--cni-exclusive`` moved aside come back."""
        if self.config.cni_uninstall and not self._uninstalled:
            self._uninstalled = True
            uninstall(self.config.cni_conf_dir, self.config.cni_conf_name)
        if self.operator is not None:
            await self.operator.stop()
            self.operator = None
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        await self.retry.close()
        if self.pool_resolver is not None:
            self.selector.resolver = None
            await self.pool_resolver.close()
            self.pool_resolver = None
        if self.operator_api is not None:
            await self.operator_api.close()
            self.operator_api = None
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_period)
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                self.config.socket.unlink()
        if self._hubble_server is not None:
            await self._hubble_server.stop(self.config.shutdown_grace_period)
            self._hubble_server = None
            with contextlib.suppress(FileNotFoundError):
                self.config.hubble_socket_path().unlink()
        if self.hubble is not None:
            await self.hubble.stop()
        self.executor.shutdown(wait=True)
        if self.bpf is not None:
            self.metrics.scrape_hook.refresh = None
            self.bpf.close()
            self.bpf = None
        if self._metrics_server is not None:
            server = self._metrics_server
            self._metrics_server = None
            threading.Thread(target=server.shutdown, daemon=True).start()
            server.server_close()
        self._stopped.set()
        log.info("stopped")

    async def wait_stopped(self) -> None:
        """Wait until :meth:`stop` has finished."""
        await self._stopped.wait()

    # --- allocation -------------------------------------------------------------------
    def _choose_router_ip(self) -> None:
        if self.router_ip is not None:
            return
        cidrs = self.ipam.cidrs()
        default = cidrs.get(self.default_pool) or []
        first: str | None = default[0] if default else None
        if first is None:
            for pool in sorted(cidrs):
                if cidrs[pool]:
                    first = cidrs[pool][0]
                    break
        if first is None:
            return
        router = self.ipam.first_usable(first)
        self.ipam.occupy(router, ROUTER_OWNER)
        self.router_ip = router
        log.info("router IP chosen", extra={"router_ip": str(router), "cidr": first})

    async def _on_registered(self, resp: cp.RegisterResponse) -> None:
        if resp.default_pool:
            self.default_pool = resp.default_pool
        if resp.ipam_mode and resp.ipam_mode != self.config.ipam:
            log.warning(
                "the operator's IPAM mode differs from this agent's --ipam: the node keeps "
                "its CIDRs (podCIDRs and the default pool's are both honoured); restart the "
                f"agent with --ipam {resp.ipam_mode} once the operator's migration is done",
                extra={"operator_ipam_mode": resp.ipam_mode, "agent_ipam_mode": self.config.ipam},
            )
        self.node = self.node.model_copy(
            update={"registered": True, "default_pool": self.default_pool}
        )
        await self._persist_node()
        await self._check_ready()

    async def apply_allocation(self, allocation: cp.NodeAllocation) -> None:
        """Take the node's allocation from the operator into IPAM (:meth:`NodePools.apply`).

        New CIDRs are added (cluster-pool: ``pod_cidrs``; both modes: the pools, the
        default pool also from ``pod_cidrs``); CIDRs the operator no longer lists are
        dropped only when no address in them is in use; draining CIDRs give out no new
        address. The router IP is chosen from the first CIDR the first time one arrives,
        the node state is persisted, readiness is re-checked and the demand recomputed.
        """
        async with self._alloc_lock:
            if allocation.error:
                log.warning("operator reports an IPAM error", extra={"error": allocation.error})
            change = self.pools.apply(
                self.default_pool,
                {p.pool: list(p.cidrs) for p in allocation.pools},
                list(allocation.pod_cidrs),
                {p.pool: list(p.cidrs) for p in allocation.draining},
                allocation.error,
                {p.pool: (p.allow_first_ip, p.allow_last_ip) for p in allocation.pools},
                allocation.resource_version,
            )
            if change.stale:
                return
            for pool, reason in change.rejected.items():
                log.error("allocation rejected", extra={"pool": pool, "reason": reason})
            for pool, cidrs in change.added.items():
                log.info("CIDRs added", extra={"pool": pool, "cidrs": cidrs})
            for pool, cidrs in change.dropped.items():
                log.info("CIDRs dropped", extra={"pool": pool, "cidrs": cidrs})
            for pool, cidrs in change.draining.items():
                log.info("CIDRs draining", extra={"pool": pool, "cidrs": cidrs})
            had_router = self.router_ip is not None
            self._choose_router_ip()
            if self.router_ip is not None and not had_router:
                await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.datapath.setup_node, self.router_ip
                )
                if self.enforcement is not None:
                    self.enforcement.set_host_addresses([str(self.router_ip)])
            await self._persist_node()
            self._update_ipam_gauges()
            await self._check_ready()
        self._on_endpoints_changed()

    async def _demand(self) -> Demand | None:
        """The demand to send (None in cluster-pool mode); persists CIDRs handed back."""
        demand = self.pools.demand(self.default_pool)
        if demand is not None and demand.handed_back_now:
            async with self._alloc_lock:
                await self._persist_node()
            self._update_ipam_gauges()
        return demand

    async def _persist_node(self) -> None:
        self.node = self.node.model_copy(
            update={
                "router_ip": str(self.router_ip) if self.router_ip else "",
                "default_pool": self.default_pool,
                "allocation": self.ipam.cidrs(),
            }
        )
        await asyncio.get_running_loop().run_in_executor(
            self.executor, self.store.write_node, self.node
        )

    async def _check_ready(self) -> None:
        if self.ready:
            return
        if not self.node.registered:
            self.not_ready_reason = "not registered with the operator yet"
        elif self.router_ip is None:
            self.not_ready_reason = "no CIDR allocated to this node yet"
        elif self.ipam.free(self.default_pool) < 1:
            self.not_ready_reason = f"no free address in default pool {self.default_pool!r} yet"
        else:
            self.ready = True
            self.not_ready_reason = ""
            cfg = self.config
            path = await asyncio.get_running_loop().run_in_executor(
                self.executor,
                functools.partial(
                    write_conflist,
                    cfg.cni_conf_dir,
                    cfg.cni_conf_name,
                    cfg.socket,
                    cfg.cni_log_file,
                    cfg.cni_del_queue_dir,
                    exclusive=cfg.cni_exclusive,
                ),
            )
            log.info("agent ready, CNI config written", extra={"path": str(path)})

    def _on_endpoints_changed(self) -> None:
        self._update_ipam_gauges()
        if self.operator is not None:
            self.operator.demand_changed()

    def _update_ipam_gauges(self) -> None:
        status = self.ipam.status()
        self.metrics.ip_addresses.labels(family="ipv4").set(sum(p.used for p in status))
        self.metrics.ipam_capacity.labels(family="ipv4").set(sum(p.capacity for p in status))

    # --- status -----------------------------------------------------------------------
    def _router_str(self) -> str:
        return str(self.router_ip) if self.router_ip else ""

    def status_lines(
        self,
        datapath: agent_pb2.DatapathStatus | None,
        hubble: agent_pb2.HubbleStatus | None,
        pools: list[agent_pb2.PoolStatus],
    ) -> list[str]:
        """Datapath, policy, identity, IPAM and Hubble lines of ``cilia-agent status``: the
        text of the :meth:`status` fields (``None``: the datapath / Hubble does not run)."""
        cfg = self.config
        lines: list[str] = []
        if datapath is not None:
            lines.append(
                f"Datapath: eBPF loaded, pin dir {datapath.pin_dir}, "
                f"policy mode {datapath.policy_mode}"
            )
            lines.append(
                f"Policy: revision {datapath.policy_revision}, {datapath.policies} policies, "
                f"{'synced' if datapath.policy_synced else 'waiting for identity/policy streams'}"
            )
            lines.append(
                f"Identities: {datapath.identities} known, "
                f"ipcache {datapath.ipcache_entries} entries"
            )
            lines.append(f"Operator calls pending retry: {datapath.pending_operator_calls}")
        else:
            lines.append("Datapath: eBPF disabled (--enable-bpf=false), plumbing only")
        draining = [f"{p.pool} {c}" for p in pools for c in p.draining_cidrs]
        lines.append(
            f"IPAM: {cfg.ipam}, default pool {self.default_pool}"
            + (f", draining: {', '.join(draining)}" if draining else "")
            + (f", handing back: {len(self.pools.released)} CIDRs" if self.pools.released else "")
        )
        if hubble is not None:
            lines.append(
                f"Hubble: {hubble.num_flows}/{hubble.max_flows} flows, {hubble.seen_flows} seen, "
                f"unix:{cfg.hubble_socket_path()}"
                + (f", {cfg.hubble_listen_address}" if cfg.hubble_listen_address else "")
            )
        return lines

    def status(self) -> agent_pb2.StatusResponse:
        """The debug Status response.

        ``message``: first line the not-ready reason ("" when ready), then one line each
        for datapath, policy, identities, IPAM and Hubble (:meth:`status_lines`, the text of
        the same fields). ``datapath``/``hubble`` are set only when the eBPF datapath /
        Hubble runs. Every count is read once per call.
        """
        datapath = None
        if self.bpf is not None and self.enforcement is not None:
            st = self.enforcement.status()
            datapath = agent_pb2.DatapathStatus(
                pin_dir=str(self.config.bpf_pin_dir),
                policy_mode=self.config.enable_policy,
                policy_revision=st.policy_revision,
                policies=st.policies,
                policy_synced=st.synced,
                identities=st.identities,
                ipcache_entries=st.ipcache_entries,
                pending_operator_calls=st.pending_operator_calls,
            )
        hubble = None
        if self.hubble is not None:
            hs = self.hubble.store.status()
            hubble = agent_pb2.HubbleStatus(
                num_flows=hs.num_flows, max_flows=hs.max_flows, seen_flows=hs.seen_flows
            )
        pools = [
            agent_pb2.PoolStatus(
                pool=p.pool,
                cidrs=p.cidrs,
                used=p.used,
                capacity=p.capacity,
                draining_cidrs=p.draining,
            )
            for p in self.ipam.status()
        ]
        return agent_pb2.StatusResponse(
            ready=self.ready,
            message="\n".join([self.not_ready_reason, *self.status_lines(datapath, hubble, pools)]),
            node_name=self.config.node_name,
            router_ip=self._router_str(),
            pools=pools,
            endpoint_count=len(self.endpoints.list()),
            version=__version__,
            datapath=datapath,
            hubble=hubble,
        )


async def serve(config: Config) -> None:
    """Run the agent until SIGTERM/SIGINT, then stop it cleanly."""
    agent = Agent(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await agent.start()
        await stop.wait()
        log.info("signal received, shutting down")
    finally:
        await agent.stop()


def run(config: Config) -> None:
    """Blocking entry point of ``cilia-agent serve``."""
    asyncio.run(serve(config))
