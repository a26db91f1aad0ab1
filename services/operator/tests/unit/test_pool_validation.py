import ipaddress
from typing import Any

import pytest

from cilia_operator.errors import InvalidResource
from cilia_operator.ipam.pool import PoolSpec, validate_pool
from cilia_operator.manifests import InvalidManifest, validate_manifest


def pool(name: str = "blue", **spec: Any) -> dict[str, Any]:
    body = {"ipv4": {"cidrs": ["10.10.0.0/16"], "maskSize": 24}}
    body.update(spec)
    return {"apiVersion": "cilium.io/v2alpha1", "kind": "CiliumPodIPPool",
            "metadata": {"name": name}, "spec": body}  # fmt: skip


def paths(exc: InvalidResource) -> list[str]:
    return [e.path for e in exc.errors]


def test_valid_pool_is_accepted_with_defaults() -> None:
    model = validate_pool(pool())
    assert model.spec.allowFirstIP is False and model.spec.allowLastIP is False
    assert model.spec.ipv4 is not None and model.spec.ipv4.maskSize == 24


@pytest.mark.parametrize(
    ("spec", "path"),
    [
        ({"ipv4": {"cidrs": [], "maskSize": 24}}, "spec.ipv4.cidrs"),
        ({"ipv4": {"cidrs": ["10.0.0.0/33"], "maskSize": 24}}, "spec.ipv4.cidrs[0]"),
        ({"ipv4": {"cidrs": ["10.10.0.0/16"], "maskSize": 0}}, "spec.ipv4.maskSize"),
        ({"ipv4": {"cidrs": ["10.10.0.0/16"], "maskSize": 33}}, "spec.ipv4.maskSize"),
        ({"ipv4": {"cidrs": ["10.10.0.0/16"], "maskSize": 8}}, "spec.ipv4.maskSize"),
        ({"ipv4": {"cidrs": ["10.10.0.0/16"], "maskSize": "24"}}, "spec.ipv4.maskSize"),
        (
            {"ipv4": {"cidrs": ["10.10.0.0/16", "10.10.4.0/24"], "maskSize": 24}},
            "spec.ipv4.cidrs[1]",
        ),
        ({"allowFirstIP": "yes"}, "spec.allowFirstIP"),
        ({"colour": "blue"}, "spec.colour"),
    ],
)
def test_invalid_pool_is_rejected_with_field_path(spec: dict[str, Any], path: str) -> None:
    doc = pool()
    doc["spec"] = {**doc["spec"], **spec}
    with pytest.raises(InvalidResource) as err:
        validate_pool(doc)
    assert path in paths(err.value)


def test_invalid_name_is_rejected() -> None:
    with pytest.raises(InvalidResource) as err:
        validate_pool(pool(name="Blue_Pool"))
    assert paths(err.value) == ["metadata.name"]


def test_usable_addresses_honour_first_and_last_ip_and_tiny_blocks() -> None:
    net = ipaddress.IPv4Network
    plain = PoolSpec("p", (), 24)
    assert plain.usable(net("10.0.0.0/24")) == 254
    assert PoolSpec("p", (), 24, allow_first_ip=True).usable(net("10.0.0.0/24")) == 255
    assert PoolSpec("p", (), 24, True, True).usable(net("10.0.0.0/24")) == 256
    assert plain.usable(net("10.0.0.0/31")) == 2
    assert plain.usable(net("10.0.0.0/32")) == 1


def test_manifest_reports_every_bad_document_with_its_index() -> None:
    text = """
apiVersion: cilium.io/v2alpha1
kind: CiliumPodIPPool
metadata: {name: ok}
spec: {ipv4: {cidrs: [10.1.0.0/16], maskSize: 24}}
---
apiVersion: cilium.io/v2alpha1
kind: CiliumPodIPPool
metadata: {name: bad}
spec: {ipv4: {cidrs: [10.2.0.0/16], maskSize: 99}}
---
apiVersion: v1
kind: Pod
metadata: {name: nope}
"""
    with pytest.raises(InvalidManifest) as err:
        validate_manifest(text, {})
    got = [(e.index, e.error.path) for e in err.value.errors]
    assert got == [(1, "spec.ipv4.maskSize"), (2, "kind")]


def test_manifest_pool_overlapping_a_stored_pool_names_both_sides() -> None:
    stored = {"default": PoolSpec("default", (ipaddress.IPv4Network("10.10.0.0/16"),), 24)}
    with pytest.raises(InvalidManifest) as err:
        validate_manifest(str(pool(name="blue")).replace("'", '"'), stored)
    message = str(err.value)
    assert "document 0" in message and "10.10.0.0/16 overlaps pool 'default'" in message


def test_manifest_pools_overlapping_each_other_are_rejected() -> None:
    a = str(pool(name="a")).replace("'", '"')
    b = str(pool(name="b")).replace("'", '"')
    with pytest.raises(InvalidManifest) as err:
        validate_manifest(f"{a}\n---\n{b}", {})
    assert [e.index for e in err.value.errors] == [1]
    assert "overlaps pool 'a'" in str(err.value)


def test_manifest_changing_mask_size_of_stored_pool_is_rejected() -> None:
    stored = {"blue": PoolSpec("blue", (ipaddress.IPv4Network("10.10.0.0/16"),), 25)}
    with pytest.raises(InvalidManifest) as err:
        validate_manifest(str(pool()).replace("'", '"'), stored)
    assert "cannot change IPv4 mask size in existing pool" in str(err.value)


def test_manifest_that_is_not_yaml_names_the_line() -> None:
    with pytest.raises(InvalidManifest) as err:
        validate_manifest("a: [1, 2\nb: 3\n", {})
    assert "line" in str(err.value)


@pytest.mark.parametrize(
    ("cidr", "name"),
    [
        ("127.0.0.0/16", "loopback"),
        ("224.1.0.0/16", "multicast"),
        ("169.254.0.0/16", "link-local"),
        ("0.0.0.0/8", "this network"),
        ("240.0.0.0/16", "reserved"),
    ],
)
def test_special_purpose_ipv4_ranges_are_refused(cidr: str, name: str) -> None:
    with pytest.raises(InvalidResource) as err:
        validate_pool(pool(ipv4={"cidrs": ["10.10.0.0/16", cidr], "maskSize": 24}))
    assert paths(err.value) == ["spec.ipv4.cidrs[1]"]
    assert name in str(err.value)


@pytest.mark.parametrize(
    ("mask", "flags", "refused"),
    [
        (32, {}, True),
        (32, {"allowFirstIP": True, "allowLastIP": True}, True),
        (31, {}, False),  # /31 keeps both addresses: router + 1 pod
        (30, {}, False),  # 2 usable without the flags: router + 1 pod
        (30, {"allowFirstIP": True}, False),
    ],
)
def test_mask_leaving_no_pod_address_after_the_router_ip_is_refused(
    mask: int, flags: dict[str, bool], refused: bool
) -> None:
    doc = pool("default", ipv4={"cidrs": ["10.10.0.0/16"], "maskSize": mask}, **flags)
    if not refused:
        validate_pool(doc)
        return
    with pytest.raises(InvalidResource) as err:
        validate_pool(doc)
    [only] = err.value.errors
    assert only.path == "spec.ipv4.maskSize"
    assert only.reason == (
        "32: a /32 block has 1 usable address and the agent takes the first as its router "
        "IP: no pod address left (use a mask of at most 31)"
    )
    # a pool stored before the check still loads (the controller keeps serving it)
    assert validate_pool(doc, stored=True).spec.ipv4 is not None


def test_mask_32_is_usable_for_a_non_default_pool() -> None:
    doc = pool("single", ipv4={"cidrs": ["10.10.0.0/30"], "maskSize": 32})
    assert validate_pool(doc).spec.ipv4 is not None
    assert validate_pool(doc, default_pool="other").spec.ipv4 is not None
    with pytest.raises(InvalidResource):
        validate_pool(doc, default_pool="single")  # the router IP comes from this one


def test_apply_manifest_with_mask_32_names_the_pool_and_field() -> None:
    text = (
        "apiVersion: cilium.io/v2alpha1\nkind: CiliumPodIPPool\nmetadata: {name: default}\n"
        "spec: {ipv4: {cidrs: [10.20.0.0/24], maskSize: 32}}\n"
    )
    with pytest.raises(InvalidManifest) as err:
        validate_manifest(text, {})
    assert "CiliumPodIPPool default" in str(err.value)
    assert "spec.ipv4.maskSize: 32: a /32 block has 1 usable address" in str(err.value)


def test_pod_ips_per_node_is_shared_by_plan_and_apply() -> None:
    from cilia_operator.ipam.changes import plan_numbers
    from cilia_operator.ipam.pool import pods_per_node, usable_per_block

    for mask in range(16, 33):
        for first in (False, True):
            for last in (False, True):
                plan = plan_numbers([ipaddress.IPv4Network("10.0.0.0/16")], mask, first, last)
                assert plan.usable_per_block == usable_per_block(mask, first, last)
                assert plan.pods_per_node == pods_per_node(mask, first, last)
                assert plan.usable_per_block == PoolSpec("p", (), mask, first, last).usable(
                    ipaddress.IPv4Network(f"10.0.0.0/{mask}")
                )
    assert (pods_per_node(24, False, False), pods_per_node(31, False, False)) == (253, 1)
    assert pods_per_node(32, True, True) == 0


def test_a_pool_with_only_an_ipv6_section_is_refused_in_one_line() -> None:
    text = (
        "apiVersion: cilium.io/v2alpha1\nkind: CiliumPodIPPool\nmetadata: {name: six}\n"
        "spec: {ipv6: {cidrs: ['fd00:10::/64'], maskSize: 120}}\n"
    )
    with pytest.raises(InvalidManifest) as err:
        validate_manifest(text, {})
    message = str(err.value)
    assert "CiliumPodIPPool six" in message
    assert "spec.ipv4: required: Cilia carves IPv4 blocks only; a pool with only an ipv6 " \
        "section (IPv6 pools are not carved yet) would hand out no address" in message  # fmt: skip
    assert "/32" not in message  # not described as IPv4 blocks
    # a stored one (an API server without the operator's check) still loads, carving nothing
    doc = pool("six")
    doc["spec"] = {"ipv6": {"cidrs": ["fd00:10::/64"], "maskSize": 120}}
    assert validate_pool(doc, stored=True).spec.ipv4 is None
