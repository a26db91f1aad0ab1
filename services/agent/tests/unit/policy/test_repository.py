"""PolicyRepository fed by WatchPolicies messages, and the endpoints it says to recompile."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_agent.identity.cache import IdentityCache
from cilia_agent.policy.compiler import EndpointSubject
from cilia_agent.policy.repository import PolicyRepository
from cilia_agent.policy.rules import PolicyRef

UPSERT, DELETE = pb.EVENT_TYPE_UPSERT, pb.EVENT_TYPE_DELETE
CNP = "CiliumNetworkPolicy"


def manifest(name: str, app: str, spec: dict[str, Any], ns: str | None = "prod") -> str:
    meta: dict[str, Any] = {"name": name}
    if ns:
        meta["namespace"] = ns
    return json.dumps(
        {
            "apiVersion": "cilium.io/v2",
            "kind": CNP,
            "metadata": meta,
            "spec": {"endpointSelector": {"matchLabels": {"app": app}}, **spec},
        }
    )


def upsert(name: str, app: str, spec: dict[str, Any], ns: str = "prod") -> pb.PolicyEvent:
    return pb.PolicyEvent(
        type=UPSERT, kind=CNP, namespace=ns, name=name, json=manifest(name, app, spec, ns=None)
    )


def delete(name: str, ns: str = "prod") -> pb.PolicyEvent:
    return pb.PolicyEvent(type=DELETE, kind=CNP, namespace=ns, name=name)


def msg(*events: pb.PolicyEvent, synced: bool = False) -> pb.WatchPoliciesResponse:
    return pb.WatchPoliciesResponse(events=list(events), synced=synced)


FROM_FRONTEND = {"ingress": [{"fromEndpoints": [{"matchLabels": {"app": "frontend"}}]}]}
ENDPOINTS = {
    10: EndpointSubject.of(["k8s:app=backend"], "prod"),
    11: EndpointSubject.of(["k8s:app=frontend"], "prod"),
    12: EndpointSubject.of(["k8s:app=db"], "prod"),
    13: EndpointSubject.of(["k8s:app=backend"], "dev"),
}


def test_upsert_event_stores_policy_in_event_namespace_and_bumps_revision() -> None:
    repo = PolicyRepository()
    result = repo.apply(msg(upsert("allow", "backend", FROM_FRONTEND), synced=True))

    assert [u.ref for u in result.updates] == [PolicyRef(CNP, "prod", "allow")]
    assert result.revision == repo.revision == 1
    assert repo.synced


def test_identical_upsert_changes_nothing() -> None:
    repo = PolicyRepository()
    repo.apply(msg(upsert("allow", "backend", FROM_FRONTEND)))
    result = repo.apply(msg(upsert("allow", "backend", FROM_FRONTEND)))
    assert result.updates == [] and repo.revision == 1


def test_invalid_manifest_is_stored_fail_closed_and_reported() -> None:
    repo = PolicyRepository()
    repo.apply(msg(upsert("allow", "backend", FROM_FRONTEND)))
    bad = upsert("allow", "backend", {"ingress": [{"fromEndpoint": []}]})
    result = repo.apply(msg(bad))

    ref = PolicyRef(CNP, "prod", "allow")
    assert [u.ref for u in result.updates] == [ref] and result.errors == []
    ((failed, judged),) = result.fail_closed
    assert failed == ref and judged.verdict == "fail-closed" and judged.denied == {"ingress"}
    stored = repo.get(ref)
    assert stored is not None
    (subject,) = stored.subjects
    assert subject.default_deny_ingress and not any(not r.deny and r.peers.selectors
                                                    for r in subject.rules)  # fmt: skip
    assert "spec.ingress[0].fromEndpoint: unknown field" in repo.unenforced()[ref]

    repo.apply(msg(upsert("allow", "backend", FROM_FRONTEND)))
    assert repo.unenforced() == {}, "a fixed manifest is enforced as written again"


def test_unidentifiable_manifest_is_reported_and_previous_version_stays() -> None:
    repo = PolicyRepository()
    repo.apply(msg(upsert("allow", "backend", FROM_FRONTEND)))
    event = pb.PolicyEvent(type=UPSERT, kind=CNP, namespace="prod", name="allow", json="{not json")
    result = repo.apply(msg(event))

    assert result.updates == []
    (error,) = result.errors
    assert "not valid JSON" in str(error)
    assert repo.get(PolicyRef(CNP, "prod", "allow")) is not None
    assert repo.revision == 1


def test_manifest_naming_another_namespace_than_event_is_refused() -> None:
    repo = PolicyRepository()
    event = pb.PolicyEvent(
        type=UPSERT, kind=CNP, namespace="prod", name="x", json=manifest("x", "a", {}, ns="dev")
    )
    result = repo.apply(msg(event))
    assert "metadata.namespace" in str(result.errors[0]) and len(repo) == 0


def test_delete_event_removes_policy() -> None:
    repo = PolicyRepository()
    repo.apply(msg(upsert("allow", "backend", FROM_FRONTEND)))
    result = repo.apply(msg(delete("allow"), delete("never-existed")))
    assert [u.new for u in result.updates] == [None] and len(repo) == 0


def test_resync_drops_policies_missing_from_new_listing() -> None:
    repo = PolicyRepository()
    repo.apply(msg(upsert("a", "backend", {}), upsert("b", "db", {}), synced=True))
    repo.begin_resync()
    result = repo.apply(msg(upsert("a", "backend", {}), synced=True))
    assert [(u.ref.name, u.new) for u in result.updates] == [("b", None)]


@pytest.mark.parametrize(
    ("events", "affected"),
    [
        ([upsert("p", "backend", FROM_FRONTEND)], {10}),  # dev backend (13) not selected
        ([upsert("p", "backend", FROM_FRONTEND, ns="dev")], {13}),
        ([upsert("p", "nobody", FROM_FRONTEND)], set()),
    ],
)
def test_policy_change_recompiles_only_selected_endpoints(
    events: list[pb.PolicyEvent], affected: set[int]
) -> None:
    repo = PolicyRepository()
    result = repo.apply(msg(*events))
    assert repo.affected_by_policies(result.updates, ENDPOINTS) == affected


def test_policy_moving_to_other_pods_recompiles_old_and_new_subjects() -> None:
    repo = PolicyRepository()
    repo.apply(msg(upsert("p", "backend", FROM_FRONTEND)))
    result = repo.apply(msg(upsert("p", "db", FROM_FRONTEND)))
    assert repo.affected_by_policies(result.updates, ENDPOINTS) == {10, 12}


def test_identity_change_recompiles_only_endpoints_whose_peers_match() -> None:
    repo = PolicyRepository()
    repo.apply(
        msg(
            upsert("p", "backend", FROM_FRONTEND),
            upsert("q", "db", {"ingress": [{"fromEntities": ["cluster"]}]}),
            upsert("r", "frontend", {"egress": [{"toEntities": ["world"]}]}),
        )
    )
    cache = IdentityCache()
    new_frontend = cache.upsert(300, ["k8s:app=frontend", "k8s:io.kubernetes.pod.namespace=prod"])
    dev_frontend = cache.upsert(301, ["k8s:app=frontend", "k8s:io.kubernetes.pod.namespace=dev"])
    assert new_frontend is not None and dev_frontend is not None

    # 10 selects frontend/prod peers; 12 uses the cluster entity; 11 only talks to world.
    assert repo.affected_by_identities([new_frontend], ENDPOINTS) == {10, 12}
    assert repo.affected_by_identities([dev_frontend], ENDPOINTS) == {12}
    assert repo.affected_by_identities([], ENDPOINTS) == set()
