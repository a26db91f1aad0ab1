"""The load balancer's pure parts: a Service's frontends and the flags."""

from __future__ import annotations

import pydantic
import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.config import Config
from cilia_agent.loadbalancer.model import Backend, Frontend, frontends


def backend(
    ip: str, *, ready: bool = True, terminating: bool = False, serving: bool | None = None
) -> cp.ServiceBackend:
    serving = ready if serving is None else serving
    return cp.ServiceBackend(
        ip=ip, port=8080, ready=ready, serving=serving, terminating=terminating
    )


def test_each_vip_and_port_is_a_frontend_with_aliases_served_alike() -> None:
    svc = cp.Service(
        namespace="ns",
        name="web",
        cluster_ips=["10.96.0.10"],
        alias_ips=["10.112.0.10"],
        ports=[
            cp.ServicePort(protocol="TCP", port=80, backends=[backend("10.0.0.1")]),
            cp.ServicePort(protocol="UDP", port=53, backends=[backend("10.0.0.1")]),
        ],
    )

    out = frontends(svc)

    assert out.problems == []
    assert sorted(s.frontend for s in out.specs) == [
        Frontend("10.112.0.10", 53, 17),
        Frontend("10.112.0.10", 80, 6),
        Frontend("10.96.0.10", 53, 17),
        Frontend("10.96.0.10", 80, 6),
    ]
    assert {s.service for s in out.specs} == {"ns/web"}
    udp = next(s for s in out.specs if s.frontend.proto == 17)
    assert udp.active == (Backend("10.0.0.1", 8080, 17),)


def test_ready_backends_take_connections_terminating_ones_are_kept_others_left_out() -> None:
    svc = cp.Service(
        namespace="ns",
        name="web",
        cluster_ips=["10.96.0.10"],
        ports=[
            cp.ServicePort(
                protocol="TCP",
                port=80,
                backends=[
                    backend("10.0.0.3"),
                    backend("10.0.0.1"),
                    backend("10.0.0.2", ready=False, terminating=True),
                    backend("10.0.0.4", ready=False),  # starting: no traffic at all
                ],
            )
        ],
    )

    (spec,) = frontends(svc).specs

    assert [b.address for b in spec.active] == ["10.0.0.1", "10.0.0.3"]
    assert [b.address for b in spec.terminating] == ["10.0.0.2"]


def test_with_no_ready_backend_the_serving_terminating_ones_take_connections() -> None:
    svc = cp.Service(
        namespace="ns",
        name="rollout",
        cluster_ips=["10.96.0.14"],
        ports=[
            cp.ServicePort(
                protocol="TCP",
                port=80,
                backends=[
                    backend("10.0.0.1", ready=False, terminating=True, serving=True),
                    backend("10.0.0.2", ready=False, terminating=True, serving=False),
                    backend("10.0.0.3", ready=False),
                ],
            )
        ],
    )

    (spec,) = frontends(svc).specs

    assert [b.address for b in spec.active] == ["10.0.0.1"]
    assert [b.address for b in spec.terminating] == ["10.0.0.2"]


def test_client_ip_affinity_takes_the_kubernetes_default_timeout_when_unset() -> None:
    svc = cp.Service(
        namespace="ns",
        name="s",
        cluster_ips=["10.96.0.11"],
        session_affinity="ClientIP",
        ports=[cp.ServicePort(protocol="TCP", port=80)],
    )
    none = cp.Service(namespace="ns", name="n", cluster_ips=["10.96.0.12"],
                      session_affinity_timeout_seconds=99,
                      ports=[cp.ServicePort(port=80)])  # fmt: skip

    assert frontends(svc).specs[0].affinity_timeout == 10800
    (plain,) = frontends(none).specs
    assert plain.affinity_timeout == 0 and plain.frontend.proto == 6  # "" protocol = TCP


def test_ipv6_addresses_are_left_out_silently_bad_ones_reported() -> None:
    svc = cp.Service(
        namespace="ns",
        name="dual",
        cluster_ips=["fd00::10", "10.96.0.13", "bogus"],
        ports=[
            cp.ServicePort(protocol="TCP", port=0),
            cp.ServicePort(
                protocol="TCP", port=80, backends=[backend("fd00::1"), backend("10.0.0.1")]
            ),
        ],
    )

    out = frontends(svc)

    assert [s.frontend for s in out.specs] == [Frontend("10.96.0.13", 80, 6)]
    assert [b.address for b in out.specs[0].active] == ["10.0.0.1"]
    assert len(out.problems) == 2
    assert any("'bogus'" in p for p in out.problems)
    assert any("port 0" in p for p in out.problems)


def test_lb_flags_default_as_the_deckhouse_module_runs_them() -> None:
    cfg = Config(operator="")

    assert cfg.kube_proxy_replacement_enabled and cfg.bpf_lb_sock
    assert (cfg.bpf_lb_algorithm, cfg.bpf_lb_map_max) == ("random", 65536)


@pytest.mark.parametrize(("value", "enabled"), [("strict", True), ("true", True), ("false", False)])
def test_kube_proxy_replacement_accepts_strict_as_true(value: str, enabled: bool) -> None:
    assert (
        Config(operator="", kube_proxy_replacement=value).kube_proxy_replacement_enabled is enabled
    )


def test_maglev_is_refused_as_not_implemented() -> None:
    with pytest.raises(pydantic.ValidationError, match="maglev is not implemented"):
        Config(operator="", bpf_lb_algorithm="maglev")
