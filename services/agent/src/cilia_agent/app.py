"""Wires the agent's parts and owns their start/stop order.

Start: state dir → node state (router IP, last allocation) into IPAM →
node datapath (ip_forward, iptables, host device) → restore endpoints (IPs
re-occupied) → gRPC socket → metrics → operator client. The conflist is
written the first time the agent is ready: registered (now, or in an earlier
run whose allocation was persisted) and ≥1 free address in the default pool.

Stop (SIGTERM/SIGINT): operator client → gRPC server (in-flight RPCs get
``--shutdown-grace-period``) → worker threads → metrics. The conflist, the
host device, the pods' veths and the state files are kept, so a restarted
agent serves the same pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import signal
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from prometheus_client import start_http_server

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent import __version__
from cilia_agent.api import ATTACHMENT_SERVICE, DEBUG_SERVICE, AttachmentServicer, DebugServicer
from cilia_agent.cni import write_conflist
from cilia_agent.config import Config
from cilia_agent.controlplane import OperatorClient
from cilia_agent.datapath import LinuxDatapath
from cilia_agent.datapath.iptables import Iptables
from cilia_agent.endpoint import EndpointManager, NodeState, RestoreReport, StateStore
from cilia_agent.ipam import IPAM
from cilia_agent.ipam.allocator import usable_hosts
from cilia_agent.metrics import Metrics
from cilia_common.grpcserver import Service, set_serving, start_server

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
        self.node = NodeState()
        self.router_ip: ipaddress.IPv4Address | None = None
        self.default_pool = config.ipam_default_ip_pool
        self.ready = False
        self.not_ready_reason = "starting"
        self.conflist_path = config.cni_conf_dir / config.cni_conf_name
        self.restore_report = RestoreReport()
        self.endpoints = EndpointManager(
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
        self._server: grpc.aio.Server | None = None
        self._metrics_server: Any = None
        self._stopped = asyncio.Event()
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
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.executor, self.datapath.setup_node, self.router_ip)
        self.restore_report = await loop.run_in_executor(self.executor, self.endpoints.restore)
        log.info(
            "endpoints restored",
            extra={
                "restored": len(self.restore_report.restored),
                "removed_stale": self.restore_report.removed_stale,
                "rolled_back": self.restore_report.rolled_back,
            },
        )
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
        log.info("serving", extra={"socket": str(cfg.socket)})
        listen = cfg.metrics_listen()
        if listen is not None:
            self._metrics_server, _ = start_http_server(
                listen[1], addr=listen[0], registry=self.metrics.registry
            )
        self._update_ipam_gauges()
        if cfg.operator:
            self.operator = OperatorClient(
                address=cfg.operator,
                node_name=cfg.node_name,
                version=__version__,
                timeout=cfg.operator_timeout,
                min_backoff=cfg.operator_reconnect_min_backoff,
                max_backoff=cfg.operator_reconnect_max_backoff,
                exclude_devices=(cfg.host_device_name,),
                demand=lambda: self.ipam.demand([self.default_pool]),
                on_registered=self._on_registered,
                on_allocation=self.apply_allocation,
            )
            self.operator.start()

    async def stop(self) -> None:
        """Stop serving; keeps pods, state files and the conflist (idempotent)."""
        if self.operator is not None:
            await self.operator.stop()
            self.operator = None
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_period)
            self._server = None
            with contextlib.suppress(FileNotFoundError):
                self.config.socket.unlink()
        self.executor.shutdown(wait=True)
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
        router = ipaddress.IPv4Address(usable_hosts(ipaddress.IPv4Network(first))[0])
        self.ipam.occupy(router, ROUTER_OWNER)
        self.router_ip = router
        log.info("router IP chosen", extra={"router_ip": str(router), "cidr": first})

    async def _on_registered(self, default_pool: str) -> None:
        if default_pool:
            self.default_pool = default_pool
        self.node = self.node.model_copy(
            update={"registered": True, "default_pool": self.default_pool}
        )
        await self._persist_node()
        await self._check_ready()

    async def apply_allocation(self, allocation: cp.NodeAllocation) -> None:
        """Take the node's allocation from the operator into IPAM.

        New CIDRs are added; CIDRs the operator no longer lists are dropped only
        when no address in them is in use. The router IP is chosen from the first
        CIDR the first time one arrives, the node state is persisted, readiness is
        re-checked and the demand recomputed.
        """
        async with self._alloc_lock:
            if allocation.error:
                log.warning("operator reports an IPAM error", extra={"error": allocation.error})
            wanted = {p.pool: list(p.cidrs) for p in allocation.pools}
            for pool, cidrs in self.static_allocation.items():
                wanted.setdefault(pool, []).extend(cidrs)
            for pool, cidrs in wanted.items():
                try:
                    added = self.ipam.add_cidrs(pool, cidrs)
                except ValueError as exc:
                    log.error("allocation rejected", extra={"pool": pool, "reason": str(exc)})
                    continue
                if added:
                    log.info("CIDRs added", extra={"pool": pool, "cidrs": [str(c) for c in added]})
            for pool in list(self.ipam):
                dropped = self.ipam.remove_unused_cidrs(pool, wanted.get(pool, []))
                if dropped:
                    log.info(
                        "CIDRs dropped", extra={"pool": pool, "cidrs": [str(c) for c in dropped]}
                    )
            had_router = self.router_ip is not None
            self._choose_router_ip()
            if self.router_ip is not None and not had_router:
                await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.datapath.setup_node, self.router_ip
                )
            await self._persist_node()
            self._update_ipam_gauges()
            await self._check_ready()
        self._on_endpoints_changed()

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
                write_conflist,
                cfg.cni_conf_dir,
                cfg.cni_conf_name,
                cfg.socket,
                cfg.cni_log_file,
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

    def status(self) -> agent_pb2.StatusResponse:
        """The debug Status response."""
        return agent_pb2.StatusResponse(
            ready=self.ready,
            message=self.not_ready_reason,
            node_name=self.config.node_name,
            router_ip=self._router_str(),
            pools=[
                agent_pb2.PoolStatus(pool=p.pool, cidrs=p.cidrs, used=p.used, capacity=p.capacity)
                for p in self.ipam.status()
            ],
            endpoint_count=len(self.endpoints.list()),
            version=__version__,
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
