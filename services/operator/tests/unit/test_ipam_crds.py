"""deploy/helm/cilia/files/crds for IPAM agree with the operator's validation models."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import jsonschema
import pytest
import yaml

from cilia_operator.errors import InvalidResource
from cilia_operator.ipam.node import validate_node
from cilia_operator.ipam.pool import validate_pool
from cilia_operator.kinds import IPAM_BLOCK, NODE, POOL

REPO = pathlib.Path(__file__).resolve().parents[4]
CRDS = REPO / "deploy/helm/cilia/files/crds"


def crd(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((CRDS / name).read_text())
    return loaded


def schema(doc: dict[str, Any]) -> dict[str, Any]:
    [version] = doc["spec"]["versions"]
    out: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return out


def crd_accepts(doc: dict[str, Any], obj: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(obj, schema(doc))
    except jsonschema.ValidationError:
        return False
    return True


@pytest.mark.parametrize(
    ("file", "info"),
    [("ciliumpodippools.yaml", POOL), ("ciliumnodes.yaml", NODE),
     ("ciliaipamblocks.yaml", IPAM_BLOCK)],
)  # fmt: skip
def test_crd_names_match_the_served_kind(file: str, info: Any) -> None:
    doc = crd(file)
    group, version = info.api_version.split("/")
    assert doc["spec"]["group"] == group
    assert doc["spec"]["names"]["kind"] == info.kind
    assert doc["spec"]["names"]["plural"] == info.plural
    assert doc["metadata"]["name"] == f"{info.plural}.{group}"
    assert [v["name"] for v in doc["spec"]["versions"]] == [version]
    assert set(info.short_names) <= set(doc["spec"]["names"].get("shortNames", []))
    assert doc["spec"]["scope"] == ("Namespaced" if info.namespaced else "Cluster")


POOL_OK = {
    "apiVersion": "cilium.io/v2alpha1",
    "kind": "CiliumPodIPPool",
    "metadata": {"name": "blue"},
    "spec": {
        "ipv4": {"cidrs": ["10.10.0.0/16"], "maskSize": 24},
        "allowFirstIP": True,
        "allowLastIP": False,
        "podSelector": {"matchLabels": {"app": "db"}},
        "namespaceSelector": {
            "matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold"]}]
        },
    },
}


def mutated(base: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    target = out
    for key in path[:-1]:
        target = target[key]
    if value is DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return out


DELETE = object()


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["spec", "ipv4", "cidrs"], []),
        (["spec", "ipv4", "maskSize"], 0),
        (["spec", "ipv4", "maskSize"], 33),
        (["spec", "ipv4", "maskSize"], "24"),
        (["spec", "ipv4", "cidrs"], DELETE),
        (["spec", "allowFirstIP"], "yes"),
        (["spec", "podSelector", "matchLabels"], {"app": 1}),
        (["spec", "bogus"], 1),
        (["spec", "ipv4", "bogus"], 1),
        (["spec"], DELETE),
    ],
)
def test_pool_crd_and_model_refuse_the_same_manifests(path: list[str], value: Any) -> None:
    bad = mutated(POOL_OK, path, value)
    assert not crd_accepts(_closed(crd("ciliumpodippools.yaml")), bad)
    with pytest.raises(InvalidResource):
        validate_pool(bad)


def test_pool_crd_and_model_accept_the_same_manifest() -> None:
    assert crd_accepts(_closed(crd("ciliumpodippools.yaml")), POOL_OK)
    validate_pool(POOL_OK)


NODE_OK = {
    "apiVersion": "cilium.io/v2",
    "kind": "CiliumNode",
    "metadata": {"name": "n1"},
    "spec": {
        "addresses": [{"type": "InternalIP", "ip": "192.0.2.1"}],
        "ipam": {
            "podCIDRs": ["10.0.1.0/24"],
            "pools": {
                "requested": [{"pool": "default", "needed": {"ipv4-addrs": 16}}],
                "allocated": [{"pool": "default", "cidrs": ["10.1.0.0/24"]}],
            },
        },
    },
    "status": {
        "ipam": {"operator-status": {"error": ""}},
        "localNetworks": [{"interface": "eth0", "cidr": "192.0.2.0/24"}],
    },
}


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["spec", "ipam", "pools", "requested"], [{"pool": "x"}]),
        (["spec", "ipam", "pools", "allocated"], [{"cidrs": ["10.0.0.0/24"]}]),
        (["spec", "addresses"], [{"type": "InternalIP"}]),
        (["spec", "ipam", "podCIDRs"], "10.0.1.0/24"),
    ],
)
def test_node_crd_and_model_refuse_the_same_manifests(path: list[str], value: Any) -> None:
    bad = mutated(NODE_OK, path, value)
    assert not crd_accepts(crd("ciliumnodes.yaml"), bad)
    with pytest.raises(InvalidResource):
        validate_node(bad)


def test_node_crd_and_model_accept_the_same_manifest() -> None:
    assert crd_accepts(crd("ciliumnodes.yaml"), NODE_OK)
    validate_node(NODE_OK)


def _closed(doc: dict[str, Any]) -> dict[str, Any]:
    """The CRD schema as strict field validation applies it: objects that list
    ``properties`` refuse unknown fields unless they preserve them."""
    out = copy.deepcopy(doc)

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node.setdefault("additionalProperties", False)
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema(out))
    return out
