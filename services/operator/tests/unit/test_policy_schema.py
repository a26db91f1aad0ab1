"""Policy validation against the packaged CRD / NetworkPolicy schemas."""

import pathlib
from typing import Any

import pytest
import yaml

from cilia_common.durations import parse_duration
from cilia_operator.errors import InvalidResource
from cilia_operator.policy.validation import (
    CRD_RESOURCE,
    crd_schema,
    resource_text,
    validate_cnp,
    validate_np,
)

REPO = pathlib.Path(__file__).resolve().parents[4]
SCTP_80 = {"port": "80", "protocol": "SCTP"}


def cnp(spec: Any, **meta: Any) -> dict[str, Any]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": "p", **meta},
        "spec": spec,
    }


def errors_of(doc: dict[str, Any], validate: Any = validate_cnp) -> list[str]:
    with pytest.raises(InvalidResource) as err:
        validate(doc)
    return [str(e) for e in err.value.errors]


def test_deploy_copy_of_the_crd_is_byte_identical_to_the_packaged_schema_source() -> None:
    deployed = (REPO / "deploy/helm/cilia/files/crds/ciliumnetworkpolicies.yaml").read_text()
    assert deployed == resource_text(CRD_RESOURCE)
    crd = yaml.safe_load(deployed)
    assert crd["spec"]["names"]["shortNames"] == ["cnp", "ciliumnp"]
    assert crd["spec"]["scope"] == "Namespaced"
    assert crd_schema(crd, "v2")["properties"]["spec"]["required"] == ["endpointSelector"]


def test_documented_frontend_to_backend_policy_is_valid_and_gets_namespace_default() -> None:
    doc = cnp(
        {
            "endpointSelector": {"matchLabels": {"app": "backend"}},
            "ingress": [
                {
                    "fromEndpoints": [{"matchLabels": {"k8s:app": "frontend"}}],
                    "toPorts": [{"ports": [{"port": "8080", "protocol": "TCP"}]}],
                }
            ],
            "egressDeny": [{"toEntities": ["world"]}],
            "enableDefaultDeny": {"ingress": True},
            "description": "frontend may reach backend",
        }
    )
    assert validate_cnp(doc)["metadata"] == {"name": "p", "namespace": "default"}
    assert (
        validate_cnp({**doc, "metadata": {"name": "p", "namespace": "prod"}})["metadata"][
            "namespace"
        ]
        == "prod"
    )


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, "spec.endpointSelector: required field is missing"),
        (
            {"endpointSelector": {}, "ingress": [{"fromCIDR": ["fd00::/8"]}]},
            "spec.ingress[0].fromCIDR[0]: 'fd00::/8' is not an IPv4 CIDR: IPv6 is not supported",
        ),
        (
            {"endpointSelector": {}, "egressDeny": [{"toCIDRSet": [{"except": ["10.1.0.0/16"]}]}]},
            "spec.egressDeny[0].toCIDRSet[0].cidr: required field is missing",
        ),
        (
            {
                "endpointSelector": {},
                "egress": [{"toCIDRSet": [{"cidr": "10.0.0.0/16", "except": ["10.1.0.0/24"]}]}],
            },
            "spec.egress[0].toCIDRSet[0].except[0]: 10.1.0.0/24 is not strictly inside cidr 10.0.0.0/16",
        ),
        (
            {
                "endpointSelector": {},
                "egress": [{"toPorts": [{"ports": [{"port": "80", "protocol": "ICMP"}]}]}],
            },
            "spec.egress[0].toPorts[0].ports[0].protocol: 'ICMP' is not one of",
        ),
        (
            {"endpointSelector": {}, "egress": [{"toPorts": [{"ports": [{"port": "http"}]}]}]},
            "spec.egress[0]: named port 'http' in an egress rule not supported by Cilia",
        ),
        (
            {"endpointSelector": {}, "ingress": [{"toPorts": [{"ports": [{"port": 70000}]}]}]},
            "spec.ingress[0].toPorts[0].ports[0].port: 70000 is not a port",
        ),
        (
            {"endpointSelector": {}, "ingressDeny": [{"fromEntities": ["moon"]}]},
            "spec.ingressDeny[0].fromEntities[0]: 'moon' is not one of",
        ),
        (
            {"endpointSelector": {"matchExpressions": [{"key": "app", "operator": "In"}]}},
            "spec.endpointSelector.matchExpressions[0].values: operator In needs a non-empty",
        ),
        ({"endpointSelector": {}, "nodeSelector": {}}, "spec.nodeSelector: unknown field"),
    ],
)
def test_invalid_cnp_is_refused_with_field_path_and_reason(spec: Any, expected: str) -> None:
    assert any(e.startswith(expected) for e in errors_of(cnp(spec))), errors_of(cnp(spec))


def test_cnp_without_spec_or_specs_and_bad_names_are_refused() -> None:
    doc = cnp({})
    del doc["spec"]
    assert errors_of(doc) == ["one of spec, specs is required"]
    bad = errors_of(cnp({"endpointSelector": {}}, name="Bad_Name", namespace="x" * 64))
    assert bad[0].startswith("metadata.name: 'Bad_Name' is not a valid name")
    assert bad[1].startswith("metadata.namespace:")
    specs = {**cnp({}), "specs": [{"endpointSelector": {}, "egress": [{"toFQDNs": []}]}]}
    del specs["spec"]
    assert errors_of(specs)[0].startswith("specs[0].egress[0].toFQDNs: unknown field")


def test_network_policy_subset_is_validated_with_paths() -> None:
    doc = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "np", "namespace": "prod"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "db"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 5432}]}],
        },
    }
    assert validate_np(doc)["metadata"]["namespace"] == "prod"
    doc["spec"]["ingress"][0]["from"] = [
        {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}
    ]
    assert validate_np(doc)["spec"]["ingress"][0]["from"][0]["ipBlock"]["cidr"] == "10.0.0.0/8"
    doc["spec"]["ingress"][0]["from"] = [
        {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["11.0.0.0/16"]}}
    ]
    assert errors_of(doc, validate_np) == [
        "spec.ingress[0].from[0].ipBlock.except[0]: 11.0.0.0/16 is not strictly inside cidr "
        "10.0.0.0/8"
    ]
    doc["spec"]["ingress"][0]["from"] = [
        {"ipBlock": {"cidr": "10.0.0.5/8", "except": ["10.0.0.0/8"]}}
    ]
    assert errors_of(doc, validate_np) == [
        "spec.ingress[0].from[0].ipBlock.except[0]: 10.0.0.0/8 is not strictly inside cidr "
        "10.0.0.5/8"
    ]
    doc["spec"]["ingress"][0]["from"] = [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]
    assert errors_of(doc, validate_np) == [
        "spec.ingress[0].from[0].ipBlock: ipBlock may not be combined with podSelector or "
        "namespaceSelector"
    ]
    doc["spec"]["ingress"][0]["from"] = [{"ipBlock": {"cidr": "10.0.0.0/33"}}]
    assert errors_of(doc, validate_np) == [
        "spec.ingress[0].from[0].ipBlock.cidr: '10.0.0.0/33' is not an IPv4 CIDR: use an IPv4 "
        "prefix a.b.c.d/n (0..32) or a bare address"
    ]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("15m", 900.0), ("30m0s", 1800.0), ("1h30m", 5400.0), ("500ms", 0.5), ("0", 0.0),
     ("2.5", 2.5)],
)  # fmt: skip
def test_durations_are_parsed_like_upstream_flags(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "15 m", "-1s", "-1", "1d"])
def test_bad_durations_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"duration|negative"):
        parse_duration(text)
