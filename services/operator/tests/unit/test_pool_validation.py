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
