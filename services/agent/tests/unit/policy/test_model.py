"""Manifest validation: supported CNP/NetworkPolicy fields parse, anything else is refused
with its field path."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cilia_common.policy.model import (
    CiliumNetworkPolicy,
    InvalidPolicy,
    NetworkPolicy,
    parse_policy,
    policy_namespace,
)


def cnp(spec: Any = None, **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": "p", "namespace": "prod"},
    }
    if spec is not None:
        doc["spec"] = spec
    doc.update(extra)
    return doc


FULL_RULE = {
    "endpointSelector": {
        "matchLabels": {"app": "backend"},
        "matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["x"]}],
    },
    "ingress": [
        {
            "fromEndpoints": [{"matchLabels": {"app": "frontend"}}],
            "toPorts": [{"ports": [{"port": "8080", "protocol": "TCP"}, {"port": 53}]}],
        },
        {"fromEntities": ["world", "cluster"]},
    ],
    "ingressDeny": [{"fromEndpoints": [{}]}],
    "egress": [{"toEndpoints": [{}], "toEntities": ["host"]}],
    "egressDeny": [{"toPorts": [{"ports": [{"port": 25, "protocol": "UDP"}]}]}],
    "enableDefaultDeny": {"egress": False},
    "description": "backend",
}


def test_full_cnp_parses_with_ports_normalised() -> None:
    policy = parse_policy(json.dumps(cnp(FULL_RULE)))
    assert isinstance(policy, CiliumNetworkPolicy)
    (rule,) = policy.rules
    assert rule.ingress is not None and rule.ingress[0].to_ports is not None
    ports = rule.ingress[0].to_ports[0].ports
    assert [(p.port, p.protocol) for p in ports or []] == [(8080, "TCP"), (53, "ANY")]
    assert rule.enable_default_deny is not None and rule.enable_default_deny.egress is False
    assert policy_namespace(policy) == "prod"


def test_specs_list_and_spec_are_combined_in_order() -> None:
    first = {"endpointSelector": {"matchLabels": {"app": "a"}}}
    second = {"endpointSelector": {"matchLabels": {"app": "b"}}}
    policy = parse_policy(cnp(first, specs=[second]))
    assert isinstance(policy, CiliumNetworkPolicy)
    assert [r.endpoint_selector.match_labels for r in policy.rules] == [{"app": "a"}, {"app": "b"}]


def test_missing_namespace_defaults_to_default() -> None:
    doc = cnp({"endpointSelector": {}})
    del doc["metadata"]["namespace"]
    assert policy_namespace(parse_policy(doc)) == "default"


def test_network_policy_parses_with_kubernetes_defaults() -> None:
    policy = parse_policy(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "np", "namespace": "prod"},
            "spec": {
                "podSelector": {"matchLabels": {"app": "db"}},
                "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": 5432}]}],
                "egress": [],
            },
        }
    )
    assert isinstance(policy, NetworkPolicy)
    assert policy.spec.effective_policy_types == {"Ingress", "Egress"}
    assert policy.spec.ingress is not None
    assert policy.spec.ingress[0].ports is not None
    assert policy.spec.ingress[0].ports[0].protocol == "TCP"


@pytest.mark.parametrize(
    ("doc", "path", "message"),
    [
        (cnp(), "", "spec or specs must be set"),
        (cnp({}), "spec.endpointSelector", "Field required"),
        (cnp({"endpointSelector": {}, "ingres": []}), "spec.ingres", "unknown field"),
        (
            cnp({"endpointSelector": {"matchLabel": {"a": "b"}}}),
            "spec.endpointSelector.matchLabel",
            "unknown field",
        ),
        (
            cnp({"endpointSelector": {}, "ingress": [{"fromEndpoint": [{}]}]}),
            "spec.ingress[0].fromEndpoint",
            "unknown field",
        ),
        (
            cnp(
                {
                    "endpointSelector": {},
                    "egress": [{"toPorts": [{"ports": [{"port": "8080", "protocol": "ICMP"}]}]}],
                }
            ),
            "spec.egress[0].toPorts[0].ports[0].protocol",
            "'TCP', 'UDP', 'SCTP' or 'ANY'",
        ),
        (
            cnp({"endpointSelector": {}, "egress": [{"toPorts": [{"ports": [{"port": "http"}]}]}]}),
            "spec.egress[0]",
            "named port 'http' in an egress rule not supported by Cilia",
        ),
        (
            cnp({"endpointSelector": {}, "egress": [{"toPorts": [{"ports": [{"port": 70000}]}]}]}),
            "spec.egress[0].toPorts[0].ports[0].port",
            "port must be 0..65535",
        ),
        (
            cnp(
                {
                    "endpointSelector": {},
                    "egress": [{"toPorts": [{"ports": [{"port": 80, "endPort": 70}]}]}],
                }
            ),
            "spec.egress[0].toPorts[0].ports[0]",
            "endPort 70 is below port 80",
        ),
        (
            cnp({"endpointSelector": {}, "ingress": [{"fromCIDR": ["fd00::/8"]}]}),
            "spec.ingress[0].fromCIDR[0]",
            "IPv6 CIDR 'fd00::/8' not supported by Cilia",
        ),
        (
            cnp({"endpointSelector": {}, "egress": [{"toPorts": [{"rules": {"http": []}}]}]}),
            "spec.egress[0].toPorts[0].rules",
            "not supported by Cilia",
        ),
        (
            cnp({"endpointSelector": {}, "ingressDeny": [{"fromEntities": ["moon"]}]}),
            "spec.ingressDeny[0].fromEntities[0]",
            "Input should be",
        ),
        (
            cnp(
                {
                    "endpointSelector": {
                        "matchExpressions": [{"key": "app", "operator": "In", "values": []}]
                    }
                }
            ),
            "spec.endpointSelector.matchExpressions[0]",
            "non-empty values",
        ),
        (
            cnp(
                {
                    "endpointSelector": {
                        "matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]
                    }
                }
            ),
            "spec.endpointSelector.matchExpressions[0]",
            "takes no values",
        ),
        (
            cnp(
                {
                    "endpointSelector": {
                        "matchExpressions": [{"key": "a", "operator": "Like", "values": ["x"]}]
                    }
                }
            ),
            "spec.endpointSelector.matchExpressions[0].operator",
            "Input should be",
        ),
        (
            cnp(specs=[{"endpointSelector": {}}, {"endpointSelector": {}, "nodeSelector": {}}]),
            "specs[1].nodeSelector",
            "not supported by Cilia",
        ),
        (cnp({"endpointSelector": {}}, extra=1), "extra", "unknown field"),
        (
            {**cnp({"endpointSelector": {}}), "apiVersion": "cilium.io/v1"},
            "apiVersion",
            "cilium.io/v2",
        ),
        ({**cnp({"endpointSelector": {}}), "kind": "Pod"}, "kind", "must be one of"),
        (
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "np"},
                "spec": {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "0/0"}}]}]},
            },
            "spec.ingress[0].from[0].ipBlock.cidr",
            "'0/0' is not a valid CIDR",
        ),
        (
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "np"},
                "spec": {"podSelector": {}, "egress": [{"to": [{}]}]},
            },
            "spec.egress[0].to[0]",
            "podSelector and/or namespaceSelector",
        ),
    ],
)
def test_invalid_manifest_is_rejected_with_field_path(
    doc: dict[str, Any], path: str, message: str
) -> None:
    with pytest.raises(InvalidPolicy) as info:
        parse_policy(doc)
    errors = {e.path: e.message for e in info.value.errors}
    assert path in errors, errors
    assert message in errors[path]
    assert path in str(info.value)


@pytest.mark.parametrize("text", ["{", "[]", "null"])
def test_non_object_json_is_rejected(text: str) -> None:
    with pytest.raises(InvalidPolicy, match="JSON"):
        parse_policy(text)


def test_error_names_the_policy() -> None:
    with pytest.raises(InvalidPolicy, match="CiliumNetworkPolicy prod/p is invalid"):
        parse_policy(cnp({}))
