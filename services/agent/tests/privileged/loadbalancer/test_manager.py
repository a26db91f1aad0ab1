"""The component the agent starts: flags -> attached programs, restored writer; and
``--kube-proxy-replacement=false`` detaching what an earlier run left."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent import loadbalancer
from cilia_agent.config import Config
from cilia_agent.loadbalancer import socklb


def config(sock: socklb.SockConfig, **flags: object) -> Config:
    return Config(
        operator="",
        bpf_pin_dir=sock.pin_dir,
        cgroup_root=sock.cgroup_root,
        bpf_lb_map_max=sock.lb_map_max,
        **flags,  # type: ignore[arg-type]
    )


def start(cfg: Config) -> loadbalancer.LoadBalancer | None:
    with ThreadPoolExecutor(1) as executor:
        return asyncio.run(loadbalancer.start(cfg, executor, CollectorRegistry()))


def test_start_attaches_restores_and_false_detaches(sock_config: socklb.SockConfig) -> None:
    first = start(config(sock_config))
    assert first is not None
    assert socklb.attached(sock_config.pin_dir) == [name for name, _ in socklb.PROGRAMS]
    first.writer.upsert_service(
        cp.Service(
            namespace="m",
            name="a",
            cluster_ips=["198.18.80.1"],
            ports=[cp.ServicePort(protocol="TCP", port=80)],
        )
    )
    first.close()

    again = start(config(sock_config))  # a restart: same links, same entries
    assert again is not None
    assert [f.address for f in again.writer.frontends] == ["198.18.80.1"]
    assert [w[0] for w in loadbalancer.watches(again, _NoOperator())] == ["services"]
    assert loadbalancer.watches(None, _NoOperator()) == []
    again.close()

    assert start(config(sock_config, kube_proxy_replacement="false")) is None
    assert socklb.attached(sock_config.pin_dir) == []


class _NoOperator:
    def watch_services(self) -> object:
        raise AssertionError("not opened by watch()")


def test_enable_node_port_false_leaves_no_nodeport_link(sock_config: socklb.SockConfig) -> None:
    from pyroute2 import IPRoute

    from cilia_agent.loadbalancer import hostlb

    def netdev_pins() -> list[str]:
        return sorted(p.name for p in sock_config.pin_dir.glob("link_cil_*_netdev_*"))

    with IPRoute() as ipr:
        assert hostlb.default_route_devices(ipr), "the test needs an IPv4 default route"
    first = start(config(sock_config))
    assert first is not None
    assert netdev_pins(), "NodePort links pinned with the default --enable-node-port"
    first.close()
    again = start(config(sock_config, enable_node_port=False))
    assert again is not None
    assert netdev_pins() == []  # unpinned: the tcx programs left the device
    assert socklb.attached(sock_config.pin_dir) == [name for name, _ in socklb.PROGRAMS]
    again.close()
