"""CiliumClusterwideNetworkPolicy: served as a cluster-scoped kind with a CNP's rule schema."""

from __future__ import annotations

import pytest

from cilia_operator.controlplane.policy import _key
from cilia_operator.errors import InvalidResource
from cilia_operator.kinds import CCNP, kind_of, resolve_kind

RULE = {"endpointSelector": {"matchLabels": {"app": "backend"}}, "ingress": [{}]}


def _doc(**metadata: object) -> dict[str, object]:
    return {
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumClusterwideNetworkPolicy",
        "metadata": {"name": "cw", **metadata},
        "spec": RULE,
    }


def test_ccnp_is_served_by_its_names_and_stays_without_namespace() -> None:
    assert resolve_kind("ccnp") is CCNP and resolve_kind("ciliumclusterwidenetworkpolicies") is CCNP
    assert kind_of("cilium.io/v2", "CiliumClusterwideNetworkPolicy") is CCNP
    assert not CCNP.namespaced and CCNP.appliable
    stored = CCNP.validate(_doc())
    assert "namespace" not in stored["metadata"]
    assert _key(CCNP.kind, stored) == (CCNP.kind, "", "cw")


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        (_doc(namespace="prod"), "metadata.namespace"),
        ({**_doc(), "spec": {"ingress": [{}]}}, "endpointSelector"),
        ({**_doc(), "spec": {**RULE, "nodeSelector": {}}}, "nodeSelector"),
    ],
)
def test_bad_ccnps_are_refused_with_the_field_named(doc: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidResource, match=needle):
        CCNP.validate(doc)
