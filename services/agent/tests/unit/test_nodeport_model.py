"""NodePort frontends and the Local traffic policies (pure), and the NodePort flags."""

from __future__ import annotations

import pydantic
import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.config import Config
from cilia_agent.loadbalancer.model import NODE_PORT_ADDRESS, Backend, Frontend, frontends


def be(ip: str, node: str, *, ready: bool = True, terminating: bool = False) -> cp.ServiceBackend:
    return cp.ServiceBackend(
        ip=ip, port=8080, ready=ready, serving=True, terminating=terminating, node_name=node
    )


def service(
    kind: str = "NodePort", *, external: str = "Cluster", internal: str = "Cluster"
) -> cp.Service:
    backends = [be("10.0.0.1", "node-a"), be("10.0.1.1", "node-b")]
    return cp.Service(
        namespace="ns",
        name="web",
        type=kind,
        cluster_ips=["10.96.0.10"],
        external_traffic_policy=external,
        internal_traffic_policy=internal,
        ports=[
            cp.ServicePort(protocol="TCP", port=80, node_port=30080, backends=backends),
            cp.ServicePort(protocol="UDP", port=53, node_port=30053, backends=backends),
        ],
    )


def specs(svc: cp.Service, node: str = "node-a") -> dict[Frontend, tuple[Backend, ...]]:
    out = frontends(svc, node)
    assert out.problems == []
    return {s.frontend: s.active for s in out.specs}


A_TCP, B_TCP = Backend("10.0.0.1", 8080, 6), Backend("10.0.1.1", 8080, 6)


def test_a_nodeport_is_the_zero_address_surrogate_frontend_per_port() -> None:
    out = frontends(service(), "node-a")
    node_ports = {s.frontend: s for s in out.specs if s.node_port}
    assert set(node_ports) == {
        Frontend(NODE_PORT_ADDRESS, 30080, 6),
        Frontend(NODE_PORT_ADDRESS, 30053, 17),
    }
    assert node_ports[Frontend("0.0.0.0", 30080, 6)].active == (A_TCP, B_TCP)
    clusterip = [s for s in out.specs if not s.node_port]
    assert {s.frontend for s in clusterip} == {
        Frontend("10.96.0.10", 80, 6),
        Frontend("10.96.0.10", 53, 17),
    }


@pytest.mark.parametrize("kind", ["ClusterIP", ""])
def test_a_clusterip_service_has_no_nodeport_even_when_the_field_is_set(kind: str) -> None:
    assert all(f.address != "0.0.0.0" for f in specs(service(kind)))


def test_loadbalancer_services_have_their_nodeports_too() -> None:
    assert Frontend("0.0.0.0", 30080, 6) in specs(service("LoadBalancer"))


def test_external_local_keeps_node_local_backends_on_the_nodeport_only() -> None:
    on_a = specs(service(external="Local"), "node-a")
    assert on_a[Frontend("0.0.0.0", 30080, 6)] == (A_TCP,)
    assert on_a[Frontend("10.96.0.10", 80, 6)] == (A_TCP, B_TCP)  # ClusterIP unaffected
    # a node without a local backend: the NodePort has none (the datapath drops)
    on_c = specs(service(external="Local"), "node-c")
    assert on_c[Frontend("0.0.0.0", 30080, 6)] == ()
    # an agent that does not know its node name treats no backend as local
    assert specs(service(external="Local"), "")[Frontend("0.0.0.0", 30080, 6)] == ()


def test_internal_local_keeps_node_local_backends_on_the_clusterip_only() -> None:
    on_b = specs(service(internal="Local"), "node-b")
    assert on_b[Frontend("10.96.0.10", 80, 6)] == (B_TCP,)
    assert on_b[Frontend("0.0.0.0", 30080, 6)] == (A_TCP, B_TCP)
    out = frontends(service(internal="Local"), "node-b")
    assert {s.local_scope for s in out.specs if not s.node_port} == {True}


def test_local_policy_falls_back_to_local_serving_terminating_backends() -> None:
    svc = service(external="Local")
    for port in svc.ports:
        del port.backends[:]
        port.backends.extend([
            be("10.0.0.1", "node-a", ready=False, terminating=True),
            be("10.0.1.1", "node-b"),
        ])  # fmt: skip
    out = {s.frontend: s for s in frontends(svc, "node-a").specs}
    assert out[Frontend("0.0.0.0", 30080, 6)].active == (A_TCP,)


def test_a_nodeport_out_of_range_is_a_problem_and_skipped() -> None:
    svc = service()
    svc.ports[0].node_port = 70000
    out = frontends(svc, "node-a")
    assert any("nodePort 70000" in p for p in out.problems)
    assert Frontend("0.0.0.0", 70000, 6) not in {s.frontend for s in out.specs}


def test_nodeport_flags() -> None:
    cfg = Config(devices=["eth0,eth1", "bond0"])
    assert cfg.devices == ["eth0", "eth1", "bond0"]
    assert Config().devices == [] and Config().bpf_lb_mode == "snat"
    assert Config().bpf_nat_global_max == 524288
    for mode in ("dsr", "hybrid"):
        with pytest.raises(pydantic.ValidationError, match="not implemented"):
            Config(bpf_lb_mode=mode)
    with pytest.raises(pydantic.ValidationError, match="interface name"):
        Config(devices=["bad name!"])


def test_the_writer_keys_nodeports_by_the_surrogate_with_upstream_flags() -> None:
    from cilia_agent.loadbalancer import layout
    from cilia_agent.loadbalancer.maps import ServiceMapWriter, frontend_key

    from .test_lb_writer import MemoryMaps

    maps = MemoryMaps()
    writer = ServiceMapWriter(maps, 1024, "node-a")  # type: ignore[arg-type]
    assert writer.upsert_service(service(external="Local", internal="Local")) == []
    nodeport = maps.services.lookup(frontend_key(Frontend("0.0.0.0", 30080, 6)))
    clusterip = maps.services.lookup(frontend_key(Frontend("10.96.0.10", 80, 6)))
    assert nodeport is not None and clusterip is not None
    key = frontend_key(Frontend("0.0.0.0", 30080, 6))
    assert (key.address, key.scope) == (0, layout.LB_LOOKUP_SCOPE_EXT)
    assert nodeport.flags == layout.SVC_FLAG_NODEPORT | layout.SVC_FLAG_EXT_LOCAL_SCOPE
    assert nodeport.count == 1  # node-a's own backend only
    assert clusterip.flags == layout.SVC_FLAG_ROUTABLE
    assert clusterip.flags2 == layout.SVC_FLAG_INT_LOCAL_SCOPE
    # the Service becomes ClusterIP: its NodePort frontends go
    assert writer.upsert_service(service("ClusterIP")) == []
    assert maps.services.lookup(key) is None
    assert maps.services.lookup(frontend_key(Frontend("10.96.0.10", 80, 6))) is not None
