"""One special-purpose range list (``cilia_operator.addresses``) behind every check that
refuses one: pool CIDRs, ServiceCIDRs, ClusterIPs and a migration's target each refuse
every range of the list, naming it, and accept the private address next to it."""

from __future__ import annotations

import ipaddress

import pytest

from cilia_operator.addresses import SPECIAL_RANGES, special_ranges
from cilia_operator.errors import InvalidResource
from cilia_operator.ipam.pool import validate_pool
from cilia_operator.service import migration, model


def _pool(cidr: str) -> dict[str, object]:
    return {"apiVersion": "cilium.io/v2alpha1", "kind": "CiliumPodIPPool",
            "metadata": {"name": "p"},
            "spec": {"ipv4": {"cidrs": [cidr], "maskSize": 28}}}  # fmt: skip


def _service_cidr(cidr: str) -> dict[str, object]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
            "metadata": {"name": "s"}, "spec": {"cidrs": [cidr]}}  # fmt: skip


@pytest.mark.parametrize(("name", "special"), SPECIAL_RANGES, ids=[n for n, _ in SPECIAL_RANGES])
def test_every_check_refuses_each_special_range_by_its_name(
    name: str, special: ipaddress.IPv4Network
) -> None:
    inside = ipaddress.IPv4Network(f"{special.network_address}/{max(special.prefixlen, 24)}")
    assert special_ranges(inside) == [(name, special)]
    with pytest.raises(InvalidResource, match=f"the {name} range {special}"):
        validate_pool(_pool(str(inside)))
    with pytest.raises(InvalidResource, match=f"special-purpose range \\({name} {special}\\)"):
        model.validate_service_cidr(_service_cidr(str(inside)))
    with pytest.raises(migration.MigrationRefused, match=f"{special} \\({name}\\)"):
        migration.check_target(inside, [], [])


def test_a_private_range_passes_every_check() -> None:
    net = ipaddress.IPv4Network("10.96.0.0/24")
    assert special_ranges(net) == []
    validate_pool(_pool(str(net)))
    model.validate_service_cidr(_service_cidr(str(net)))
    migration.check_target(net, [], [])
