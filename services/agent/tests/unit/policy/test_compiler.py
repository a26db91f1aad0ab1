"""compile_endpoint: per-direction default-deny, L3/L4 entries, deny precedence, entities,
namespaces, selectors, specs[] and NetworkPolicy translation.

Identities in the cache (besides reserved 1..8):
    1000 frontend/prod   1001 backend/prod   1002 other/prod
    1003 frontend/dev    1004 db,tier=data/prod
The endpoint under test is backend in prod.
"""

from __future__ import annotations

from typing import Any

import pytest

from cilia_agent.identity.cache import IdentityCache
from cilia_agent.policy.compiler import (
    EndpointSubject,
    PolicyEntry,
    Verdict,
    apply_deny_precedence,
    compile_endpoint,
)
from cilia_agent.policy.rules import CompiledPolicy, compile_policy
from cilia_common.policy.model import parse_policy, policy_namespace

FRONTEND, BACKEND, OTHER, DEV_FRONTEND, DB = 1000, 1001, 1002, 1003, 1004
IN, EG = 0, 1
TCP, UDP = 6, 17
A, D = Verdict.ALLOW, Verdict.DENY


@pytest.fixture
def cache() -> IdentityCache:
    c = IdentityCache()
    for id_, labels in {
        FRONTEND: ["k8s:app=frontend"],
        BACKEND: ["k8s:app=backend"],
        OTHER: ["k8s:app=other"],
        DB: ["k8s:app=db", "k8s:tier=data"],
    }.items():
        c.upsert(id_, [*labels, "k8s:io.kubernetes.pod.namespace=prod"])
    c.upsert(DEV_FRONTEND, ["k8s:app=frontend", "k8s:io.kubernetes.pod.namespace=dev"])
    return c


BACKEND_EP = EndpointSubject.of(["k8s:app=backend"], "prod")
SEL_BACKEND = {"matchLabels": {"app": "backend"}}
SEL_FRONTEND = {"matchLabels": {"app": "frontend"}}


def cnp(spec: dict[str, Any] | None = None, ns: str = "prod", **extra: Any) -> CompiledPolicy:
    doc: dict[str, Any] = {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNetworkPolicy",
        "metadata": {"name": "p", "namespace": ns},
        **extra,
    }
    if spec is not None:
        doc["spec"] = {"endpointSelector": SEL_BACKEND, **spec}
    policy = parse_policy(doc)
    return compile_policy(policy, policy_namespace(policy))


def np_(spec: dict[str, Any], ns: str = "prod") -> CompiledPolicy:
    policy = parse_policy(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "np", "namespace": ns},
            "spec": spec,
        }
    )
    return compile_policy(policy, ns)


def ports(*pairs: tuple[int | str, str]) -> list[dict[str, Any]]:
    return [{"ports": [{"port": p, "protocol": proto} for p, proto in pairs]}]


E = PolicyEntry
CASES: list[tuple[str, list[CompiledPolicy], dict[PolicyEntry, Verdict], tuple[bool, bool]]] = [
    ("no policy: nothing enforced", [], {}, (False, False)),
    (
        "policy selecting another pod does not enforce",
        [cnp({"endpointSelector": SEL_FRONTEND, "ingress": [{}]})],
        {},
        (False, False),
    ),
    (
        "policy of another namespace does not select",
        [cnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND]}]}, ns="dev")],
        {},
        (False, False),
    ),
    (
        "ingress rule enforces ingress only",
        [cnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND]}]})],
        {E(FRONTEND, IN, 0, 0): A},
        (True, False),
    ),
    (
        "egress rule enforces egress only",
        [cnp({"egress": [{"toEndpoints": [SEL_FRONTEND]}]})],
        {E(FRONTEND, EG, 0, 0): A},
        (False, True),
    ),
    (
        "ingressDeny alone enforces ingress",
        [cnp({"ingressDeny": [{"fromEndpoints": [SEL_FRONTEND]}]})],
        {E(FRONTEND, IN, 0, 0): D},
        (True, False),
    ),
    (
        "empty ingress rule denies all ingress",
        [cnp({"ingress": [{}]})],
        {},
        (True, False),
    ),
    (
        "empty ingress list enforces nothing",
        [cnp({"ingress": []})],
        {},
        (False, False),
    ),
    (
        "enableDefaultDeny false keeps direction open but entries stay",
        [
            cnp(
                {
                    "ingress": [{"fromEndpoints": [SEL_FRONTEND]}],
                    "enableDefaultDeny": {"ingress": False},
                }
            )
        ],
        {E(FRONTEND, IN, 0, 0): A},
        (False, False),
    ),
    (
        "port rule: TCP 8080",
        [cnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND], "toPorts": ports(("8080", "TCP"))}]})],
        {E(FRONTEND, IN, TCP, 8080): A},
        (True, False),
    ),
    (
        "ANY with a port: TCP and UDP",
        [cnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND], "toPorts": ports((53, "ANY"))}]})],
        {E(FRONTEND, IN, TCP, 53): A, E(FRONTEND, IN, UDP, 53): A},
        (True, False),
    ),
    (
        "port 0 means any port of the protocol",
        [cnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND], "toPorts": ports(("0", "UDP"))}]})],
        {E(FRONTEND, IN, UDP, 0): A},
        (True, False),
    ),
    (
        "ANY without port is L3",
        [cnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND], "toPorts": ports((0, "ANY"))}]})],
        {E(FRONTEND, IN, 0, 0): A},
        (True, False),
    ),
    (
        "toPorts without peers: any peer on that port",
        [cnp({"egress": [{"toPorts": ports((443, "TCP"))}]})],
        {E(0, EG, TCP, 443): A},
        (False, True),
    ),
    (
        "identical deny and allow: deny",
        [
            cnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND], "toPorts": ports((80, "TCP"))}]}),
            cnp(
                {"ingressDeny": [{"fromEndpoints": [SEL_FRONTEND], "toPorts": ports((80, "TCP"))}]}
            ),
        ],
        {E(FRONTEND, IN, TCP, 80): D},
        (True, False),
    ),
    (
        "broader L3 deny converts narrower allow",
        [
            cnp(
                {
                    "ingress": [{"fromEndpoints": [SEL_FRONTEND], "toPorts": ports((80, "TCP"))}],
                    "ingressDeny": [{"fromEndpoints": [SEL_FRONTEND]}],
                }
            )
        ],
        {E(FRONTEND, IN, TCP, 80): D, E(FRONTEND, IN, 0, 0): D},
        (True, False),
    ),
    (
        "protocol-wide deny converts same-protocol port allow only",
        [
            cnp(
                {
                    "ingress": [
                        {
                            "fromEndpoints": [SEL_FRONTEND],
                            "toPorts": ports((80, "TCP"), (53, "UDP")),
                        }
                    ],
                    "ingressDeny": [
                        {"fromEndpoints": [SEL_FRONTEND], "toPorts": ports((0, "TCP"))}
                    ],
                }
            )
        ],
        {E(FRONTEND, IN, TCP, 80): D, E(FRONTEND, IN, UDP, 53): A, E(FRONTEND, IN, TCP, 0): D},
        (True, False),
    ),
    (
        "narrower deny under broader allow stays as is",
        [
            cnp(
                {
                    "ingress": [{"fromEndpoints": [SEL_FRONTEND]}],
                    "ingressDeny": [
                        {"fromEndpoints": [SEL_FRONTEND], "toPorts": ports((22, "TCP"))}
                    ],
                }
            )
        ],
        {E(FRONTEND, IN, 0, 0): A, E(FRONTEND, IN, TCP, 22): D},
        (True, False),
    ),
    (
        "deny for all peers vs exact allow is left to the datapath",
        [
            cnp(
                {
                    "ingress": [{"fromEndpoints": [SEL_FRONTEND], "toPorts": ports((80, "TCP"))}],
                    "ingressDeny": [{"fromEntities": ["all"], "toPorts": ports((80, "TCP"))}],
                }
            )
        ],
        {E(FRONTEND, IN, TCP, 80): A, E(0, IN, TCP, 80): D},
        (True, False),
    ),
    (
        "deny on another direction does not convert",
        [
            cnp(
                {
                    "ingress": [{"fromEndpoints": [SEL_FRONTEND]}],
                    "egressDeny": [{"toEndpoints": [SEL_FRONTEND]}],
                }
            )
        ],
        {E(FRONTEND, IN, 0, 0): A, E(FRONTEND, EG, 0, 0): D},
        (True, True),
    ),
    (
        "entity world",
        [cnp({"ingress": [{"fromEntities": ["world"]}]})],
        {E(2, IN, 0, 0): A},
        (True, False),
    ),
    (
        "entity host and remote-node (kube-apiserver is labelled remote-node too)",
        [cnp({"egress": [{"toEntities": ["host", "remote-node"]}]})],
        {E(1, EG, 0, 0): A, E(6, EG, 0, 0): A, E(7, EG, 0, 0): A},
        (False, True),
    ),
    (
        "entity kube-apiserver is identity 7 only",
        [cnp({"egress": [{"toEntities": ["kube-apiserver"], "toPorts": ports((6443, "TCP"))}]})],
        {E(7, EG, TCP, 6443): A},
        (False, True),
    ),
    (
        "entity all is peer 0",
        [cnp({"egress": [{"toEntities": ["all"], "toPorts": ports((53, "UDP"))}]})],
        {E(0, EG, UDP, 53): A},
        (False, True),
    ),
    (
        "entity cluster: every cluster identity plus host, remote-node, kube-apiserver",
        [cnp({"ingress": [{"fromEntities": ["cluster"]}]})],
        {E(i, IN, 0, 0): A for i in (1, 6, 7, FRONTEND, BACKEND, OTHER, DEV_FRONTEND, DB)},
        (True, False),
    ),
    (
        "peer selector restricted to policy namespace",
        [cnp({"ingress": [{"fromEndpoints": [{}]}]})],
        {E(i, IN, 0, 0): A for i in (FRONTEND, BACKEND, OTHER, DB)},
        (True, False),
    ),
    (
        "peer selector naming a namespace crosses namespaces",
        [
            cnp(
                {
                    "ingress": [
                        {
                            "fromEndpoints": [
                                {
                                    "matchLabels": {
                                        "app": "frontend",
                                        "k8s:io.kubernetes.pod.namespace": "dev",
                                    }
                                }
                            ]
                        }
                    ]
                }
            )
        ],
        {E(DEV_FRONTEND, IN, 0, 0): A},
        (True, False),
    ),
    (
        "peer selector with namespace Exists selects all namespaces",
        [
            cnp(
                {
                    "ingress": [
                        {
                            "fromEndpoints": [
                                {
                                    "matchLabels": {"app": "frontend"},
                                    "matchExpressions": [
                                        {"key": "io.kubernetes.pod.namespace", "operator": "Exists"}
                                    ],
                                }
                            ]
                        }
                    ]
                }
            )
        ],
        {E(FRONTEND, IN, 0, 0): A, E(DEV_FRONTEND, IN, 0, 0): A},
        (True, False),
    ),
    (
        "reserved selector is not namespace restricted",
        [cnp({"ingress": [{"fromEndpoints": [{"matchLabels": {"reserved:host": ""}}]}]})],
        {E(1, IN, 0, 0): A},
        (True, False),
    ),
    (
        "matchExpressions In and NotIn and Exists and DoesNotExist",
        [
            cnp(
                {
                    "ingress": [
                        {
                            "fromEndpoints": [
                                {
                                    "matchExpressions": [
                                        {"key": "app", "operator": "In", "values": ["db", "other"]},
                                        {"key": "app", "operator": "NotIn", "values": ["other"]},
                                        {"key": "tier", "operator": "Exists"},
                                    ]
                                },
                                {
                                    "matchExpressions": [
                                        {"key": "tier", "operator": "DoesNotExist"},
                                        {"key": "app", "operator": "In", "values": ["frontend"]},
                                    ]
                                },
                            ]
                        }
                    ]
                }
            )
        ],
        {E(DB, IN, 0, 0): A, E(FRONTEND, IN, 0, 0): A},
        (True, False),
    ),
    (
        "specs: only the selecting rule applies",
        [
            cnp(
                specs=[
                    {"endpointSelector": SEL_FRONTEND, "egress": [{}]},
                    {
                        "endpointSelector": SEL_BACKEND,
                        "ingress": [{"fromEndpoints": [SEL_FRONTEND]}],
                    },
                ]
            )
        ],
        {E(FRONTEND, IN, 0, 0): A},
        (True, False),
    ),
    (
        "endpointSelector with foreign namespace still selects in policy namespace",
        [
            cnp(
                {
                    "endpointSelector": {
                        "matchLabels": {"app": "backend", "k8s:io.kubernetes.pod.namespace": "dev"}
                    },
                    "ingress": [{}],
                }
            )
        ],
        {},
        (True, False),
    ),
    (
        "NetworkPolicy: podSelector peer in namespace, TCP default",
        [
            np_(
                {
                    "podSelector": SEL_BACKEND,
                    "ingress": [
                        {"from": [{"podSelector": SEL_FRONTEND}], "ports": [{"port": 8080}]}
                    ],
                }
            )
        ],
        {E(FRONTEND, IN, TCP, 8080): A},
        (True, False),
    ),
    (
        "NetworkPolicy: rule without from allows every source",
        [np_({"podSelector": {}, "ingress": [{"ports": [{"port": 53, "protocol": "UDP"}]}]})],
        {E(0, IN, UDP, 53): A},
        (True, False),
    ),
    (
        "NetworkPolicy: policyTypes Egress without rules denies egress only",
        [np_({"podSelector": {}, "policyTypes": ["Egress"]})],
        {},
        (False, True),
    ),
    (
        "NetworkPolicy: empty namespaceSelector selects pods of every namespace",
        [
            np_(
                {
                    "podSelector": {},
                    "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": SEL_FRONTEND}]}],
                }
            )
        ],
        {E(FRONTEND, IN, 0, 0): A, E(DEV_FRONTEND, IN, 0, 0): A},
        (True, False),
    ),
    (
        "NetworkPolicy: namespaceSelector by metadata.name",
        [
            np_(
                {
                    "podSelector": {},
                    "ingress": [
                        {
                            "from": [
                                {
                                    "namespaceSelector": {
                                        "matchLabels": {"kubernetes.io/metadata.name": "dev"}
                                    }
                                }
                            ]
                        }
                    ],
                }
            )
        ],
        {E(DEV_FRONTEND, IN, 0, 0): A},
        (True, False),
    ),
]


@pytest.mark.parametrize(
    ("policies", "entries", "enforce"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_compile_endpoint(
    cache: IdentityCache,
    policies: list[CompiledPolicy],
    entries: dict[PolicyEntry, Verdict],
    enforce: tuple[bool, bool],
) -> None:
    result = compile_endpoint(BACKEND_EP, policies, cache)
    assert dict(result.entries) == entries
    assert (result.enforce_ingress, result.enforce_egress) == enforce


def test_selected_by_lists_selecting_policies(cache: IdentityCache) -> None:
    selecting = cnp({"ingress": [{}]})
    other = cnp({"endpointSelector": SEL_FRONTEND, "ingress": [{}]}, ns="dev")
    result = compile_endpoint(BACKEND_EP, [selecting, other], cache)
    assert [str(r) for r in result.selected_by] == ["CiliumNetworkPolicy/prod/p"]


def test_new_identity_appears_in_entries_after_recompile(cache: IdentityCache) -> None:
    policy = cnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND]}]})
    cache.upsert(
        2000, ["k8s:app=frontend", "k8s:version=2", "k8s:io.kubernetes.pod.namespace=prod"]
    )
    result = compile_endpoint(BACKEND_EP, [policy], cache)
    assert set(result.entries) == {E(FRONTEND, IN, 0, 0), E(2000, IN, 0, 0)}


def test_deny_precedence_leaves_other_peers_alone() -> None:
    entries = {E(5, IN, TCP, 80): A, E(6, IN, 0, 0): D, E(5, EG, 0, 0): D}
    assert apply_deny_precedence(entries) == entries


def ccnp(spec: dict[str, Any], **metadata: Any) -> CompiledPolicy:
    policy = parse_policy(
        {
            "apiVersion": "cilium.io/v2",
            "kind": "CiliumClusterwideNetworkPolicy",
            "metadata": {"name": "cw", **metadata},
            "spec": {"endpointSelector": SEL_BACKEND, **spec},
        }
    )
    return compile_policy(policy, policy_namespace(policy))


def test_a_clusterwide_policy_selects_subjects_and_peers_of_every_namespace(
    cache: IdentityCache,
) -> None:
    policy = ccnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND]}]})
    assert str(policy.ref) == "CiliumClusterwideNetworkPolicy//cw"
    # the backend in prod and one in dev are both selected; frontends of both namespaces
    # are admitted (a CNP in prod would admit prod's frontend only)
    for ep in (BACKEND_EP, EndpointSubject.of(["k8s:app=backend"], "dev")):
        result = compile_endpoint(ep, [policy], cache)
        assert dict(result.entries) == {E(FRONTEND, IN, 0, 0): A, E(DEV_FRONTEND, IN, 0, 0): A}
        assert result.enforce_ingress and not result.enforce_egress
    namespaced = cnp({"ingress": [{"fromEndpoints": [SEL_FRONTEND]}]})
    assert set(compile_endpoint(BACKEND_EP, [namespaced], cache).entries) == {E(FRONTEND, IN, 0, 0)}


def test_a_clusterwide_policy_with_default_deny_off_enforces_nothing_it_does_not_say(
    cache: IdentityCache,
) -> None:
    policy = ccnp(
        {
            "ingress": [{"fromEndpoints": [SEL_FRONTEND]}],
            "enableDefaultDeny": {"ingress": False, "egress": False},
        }
    )
    result = compile_endpoint(BACKEND_EP, [policy], cache)
    assert not result.enforce_ingress and not result.enforce_egress


def test_a_clusterwide_policy_with_a_namespace_is_refused() -> None:
    from cilia_common.policy.model import InvalidPolicy

    with pytest.raises(InvalidPolicy, match="no namespace"):
        ccnp({"ingress": [{}]}, namespace="prod")
