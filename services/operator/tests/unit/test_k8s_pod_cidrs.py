"""--ipam kubernetes: a node's pod CIDRs are its Node object's spec.podCIDRs."""

from __future__ import annotations

import ipaddress

import pytest

from cilia_operator.config import Config
from cilia_operator.ipam.controller import k8s_pod_cidrs


def test_ipv4_pod_cidrs_are_taken_and_ipv6_skipped() -> None:
    node = {"spec": {"podCIDRs": ["10.244.3.0/24", "fd00:10:244:3::/64"]}}
    assert k8s_pod_cidrs("n1", node) == ([ipaddress.IPv4Network("10.244.3.0/24")], "")
    # the older singular field
    assert k8s_pod_cidrs("n1", {"spec": {"podCIDR": "10.244.4.0/24"}})[0] == [
        ipaddress.IPv4Network("10.244.4.0/24")
    ]


@pytest.mark.parametrize(
    ("node", "needle"),
    [
        (None, "no Node object 'n1'"),
        ({"spec": {}}, "no IPv4 spec.podCIDRs"),
        ({"spec": {"podCIDRs": ["fd00::/64"]}}, "no IPv4 spec.podCIDRs"),
        ({"spec": {"podCIDRs": ["10.244.3.1/24"]}}, "malformed spec.podCIDRs"),
    ],
)
def test_a_node_without_usable_pod_cidrs_is_reported_not_guessed(
    node: dict[str, object] | None, needle: str
) -> None:
    cidrs, error = k8s_pod_cidrs("n1", node)
    assert cidrs == [] and needle in error


def test_ipam_kubernetes_needs_the_kubernetes_store() -> None:
    with pytest.raises(ValueError, match="--ipam kubernetes: needs --store kubernetes"):
        Config(ipam="kubernetes", store="redis://127.0.0.1:6379/0")
    assert Config(ipam="kubernetes", store="kubernetes").ipam == "kubernetes"
