"""The agent's load balancer (upstream's kube-proxy replacement), built once at start.

:func:`start`:

* ``--kube-proxy-replacement=false`` or ``--bpf-lb-sock=false``: socket-LB links left by an
  earlier run are detached, and the NodePort programs from ``--devices`` (so a node moved
  back to kube-proxy is not served twice);
  nothing else is built;
* otherwise: bpffs checked (mounted on /sys/fs/bpf if needed), the socket-LB attached or
  its programs swapped in place (``socklb``), the pinned maps opened and read back
  (``maps.ServiceMapWriter.restore``: rev-NAT indexes and backend ids kept), and the
  Service watcher built; the NodePort programs (``hostlb``: ``bpf_host.o`` on
  ``--devices``, or the default route's device) are attached after the socket-LB (whose
  loading creates the maps they share). The Service stream
  (``ServiceService.WatchServices``) is one of the agent's operator watches
  (:func:`watches`).

Without an operator nothing feeds the maps: the restored entries keep being served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.config import Config
from cilia_agent.datapath.bpffs import ensure_bpffs
from cilia_agent.datapath.objects import default_bpf_dir
from cilia_agent.loadbalancer import hostlb, nodeaddrs, socklb
from cilia_agent.loadbalancer.maps import LBMaps, ServiceMapWriter
from cilia_agent.loadbalancer.usage import AliasUsage
from cilia_agent.loadbalancer.watcher import ServiceMetrics, ServiceWatcher

log = logging.getLogger(__name__)


class ServiceStreams(Protocol):
    """Where the Service stream comes from (``controlplane.OperatorAPI``)."""

    def watch_services(self) -> AsyncIterable[cp.WatchServicesResponse]:
        """A new ``WatchServices`` stream."""
        ...


@dataclass
class LoadBalancer:
    """The running load balancer: the pinned maps, their writer and the Service watcher."""

    maps: LBMaps
    writer: ServiceMapWriter
    watcher: ServiceWatcher
    usage: AliasUsage | None = None

    def close(self) -> None:
        """Close the map fds; the programs, links and maps stay (Services keep working)."""
        self.maps.close()
        if self.usage is not None:
            self.usage.map.close()


def sock_config(cfg: Config) -> socklb.SockConfig:
    """The socket-LB options of ``cfg``."""
    return socklb.SockConfig(
        bpf_dir=cfg.bpf_dir or default_bpf_dir(),
        pin_dir=cfg.bpf_pin_dir,
        cgroup_root=cfg.cgroup_root,
        lb_map_max=cfg.bpf_lb_map_max,
        sock_rev_map_max=cfg.bpf_sock_rev_map_max,
        variant=cfg.bpf_sock_variant,
    )


def host_config(cfg: Config) -> hostlb.HostConfig:
    """The NodePort programs' options of ``cfg``."""
    return hostlb.HostConfig(
        bpf_dir=cfg.bpf_dir or default_bpf_dir(),
        pin_dir=cfg.bpf_pin_dir,
        devices=tuple(cfg.devices),
        lb_map_max=cfg.bpf_lb_map_max,
        nat_max=cfg.bpf_nat_global_max,
        tunnel=cfg.routing_mode == "tunnel",
        masquerade=cfg.bpf_masquerade_enabled,
        nat_port_range=cfg.nat_port_range,
    )


def _build(
    cfg: Config,
) -> tuple[dict[str, str], dict[str, str], LBMaps, ServiceMapWriter, int]:
    ensure_bpffs(cfg.bpf_pin_dir)
    outcome = socklb.attach(sock_config(cfg))
    # NodePort through this node's own addresses (bpf_sock.c's wildcard lookup)
    added, removed = nodeaddrs.sync(cfg.bpf_pin_dir, nodeaddrs.local_ipv4_addresses())
    log.info("node addresses for NodePort set", extra={"added": added, "removed": removed})
    if cfg.enable_node_port:
        devices = hostlb.attach(host_config(cfg))
    else:
        # only this agent's own link pins go: tc filters on a shared device are left to
        # `--kube-proxy-replacement=false`, which detaches everything it attached
        devices = {}
        gone = hostlb.unpin_links(cfg.bpf_pin_dir)
        if gone:
            log.info("NodePort links unpinned (--enable-node-port=false)", extra={"links": gone})
    maps = LBMaps(cfg.bpf_pin_dir)
    writer = ServiceMapWriter(maps, cfg.bpf_lb_map_max, cfg.node_name)
    restored = writer.restore()
    return outcome, devices, maps, writer, restored


def _detach(cfg: Config) -> list[str]:
    gone = socklb.detach(cfg.bpf_pin_dir)
    try:
        gone += [f"{d} (NodePort)" for d in hostlb.detach(cfg.bpf_pin_dir, cfg.devices)]
    except Exception as exc:  # netlink: logged, the socket-LB part is what matters most
        log.warning("cannot detach the NodePort programs", extra={"reason": str(exc)})
    return gone


async def start(
    cfg: Config, executor: Executor, registry: CollectorRegistry
) -> LoadBalancer | None:
    """Build the load balancer per ``cfg`` (see the module docstring); None when disabled.

    Raises:
        SocketLBUnavailable: ``bpf_sock.o`` missing or refused, the cgroup2 mount or
            attachment failed.
        HostLBUnavailable: a ``--devices`` device is missing, or ``bpf_host.o`` could not
            be loaded or attached.
        BpffsUnavailable: the pin dir is not on bpffs and cannot be.
        LibbpfError: the pinned maps cannot be opened.
    """
    loop = asyncio.get_running_loop()
    if not (cfg.enable_bpf and cfg.kube_proxy_replacement_enabled and cfg.bpf_lb_sock):
        gone = await loop.run_in_executor(executor, _detach, cfg)
        log.warning(
            "Services are not load-balanced by this agent",
            extra={
                "kube_proxy_replacement": cfg.kube_proxy_replacement,
                "bpf_lb_sock": cfg.bpf_lb_sock,
                "enable_bpf": cfg.enable_bpf,
                "detached": gone,
            },
        )
        return None
    outcome, devices, maps, writer, restored = await loop.run_in_executor(executor, _build, cfg)
    if not devices and cfg.enable_node_port:
        log.warning("NodePort is not served from outside: no --devices and no default route device")
    log.info(
        "socket load balancer ready",
        extra={
            "cgroup_root": str(cfg.cgroup_root),
            "programs": outcome,
            "nodeport_devices": devices,
            "restored_frontends": restored,
            "algorithm": cfg.bpf_lb_algorithm,
        },
    )
    usage = await loop.run_in_executor(executor, AliasUsage, cfg.bpf_pin_dir)
    return LoadBalancer(
        maps, writer, ServiceWatcher(writer, ServiceMetrics(registry), usage), usage
    )


Watch = tuple[
    str, Callable[[], AsyncIterable[Any]], Callable[[AsyncIterable[Any]], Awaitable[bool]]
]
"""``(name, open_stream, consume)`` of one operator watch stream, for ``run_watch``."""


def watches(lb: LoadBalancer | None, api: ServiceStreams) -> list[Watch]:
    """The Service stream feeding ``lb`` (none when the load balancer is off)."""
    return [] if lb is None else [("services", api.watch_services, lb.watcher.consume)]
