"""PolicyEngine (compute-only, no map writer): what gets recompiled, and when."""

from __future__ import annotations

import json
from typing import Any

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_agent.policy.compiler import EndpointPolicy, PolicyEntry, Verdict
from cilia_agent.policy.engine import PolicyEngine

UPSERT = pb.EVENT_TYPE_UPSERT
NS = "k8s:io.kubernetes.pod.namespace=prod"
FROM_FRONTEND = {"ingress": [{"fromEndpoints": [{"matchLabels": {"app": "frontend"}}]}]}


def policies(*named: tuple[str, str, dict[str, Any]], synced: bool = False) -> Any:
    events = [
        pb.PolicyEvent(
            type=UPSERT,
            kind="CiliumNetworkPolicy",
            namespace="prod",
            name=name,
            json=json.dumps(
                {
                    "apiVersion": "cilium.io/v2",
                    "kind": "CiliumNetworkPolicy",
                    "metadata": {"name": name, "namespace": "prod"},
                    "spec": {"endpointSelector": {"matchLabels": {"app": app}}, **spec},
                }
            ),
        )
        for name, app, spec in named
    ]
    return pb.WatchPoliciesResponse(events=events, synced=synced)


def identities(*ids: tuple[int, str], synced: bool = False) -> Any:
    return pb.WatchIdentitiesResponse(
        events=[
            pb.IdentityEvent(type=UPSERT, identity=pb.Identity(id=i, labels=[f"k8s:app={app}", NS]))
            for i, app in ids
        ],
        synced=synced,
    )


class Recorder:
    def __init__(self) -> None:
        self.calls: dict[int, EndpointPolicy] = {}

    def __call__(self, ep_id: int, policy: EndpointPolicy) -> None:
        self.calls[ep_id] = policy


def ready_engine() -> tuple[PolicyEngine, Recorder]:
    rec = Recorder()
    engine = PolicyEngine(on_enforce=rec)
    engine.on_identities(identities(synced=True))
    engine.on_policies(policies(synced=True))
    for ep_id, app in ((10, "backend"), (11, "frontend"), (12, "db")):
        engine.set_endpoint(ep_id, [f"k8s:app={app}", NS], "prod")
    rec.calls.clear()
    return engine, rec


def test_nothing_is_compiled_before_both_streams_synced() -> None:
    rec = Recorder()
    engine = PolicyEngine(on_enforce=rec)
    assert engine.set_endpoint(10, ["k8s:app=backend", NS], "prod") is None

    _, affected = engine.on_policies(policies(("p", "backend", FROM_FRONTEND), synced=True))
    assert affected == set() and rec.calls == {}

    assert engine.on_identities(identities((400, "frontend"), synced=True)) == {10}
    assert rec.calls[10].enforce_ingress
    assert rec.calls[10].entries == {PolicyEntry(400, 0, 0, 0): Verdict.ALLOW}


def test_policy_change_recompiles_only_selected_endpoint() -> None:
    engine, rec = ready_engine()
    _, affected = engine.on_policies(policies(("p", "backend", FROM_FRONTEND)))
    assert affected == {10} and set(rec.calls) == {10}
    assert (rec.calls[10].enforce_ingress, rec.calls[10].enforce_egress) == (True, False)


def test_identity_change_recompiles_only_endpoints_selecting_it() -> None:
    engine, rec = ready_engine()
    engine.on_policies(policies(("p", "backend", FROM_FRONTEND)))
    rec.calls.clear()

    assert engine.on_identities(identities((401, "db"))) == set()
    assert engine.on_identities(identities((400, "frontend"))) == {10}
    assert engine.compiled[10].entries == {PolicyEntry(400, 0, 0, 0): Verdict.ALLOW}


def test_removing_endpoint_yields_deletes_of_its_entries() -> None:
    engine, _ = ready_engine()
    engine.on_identities(identities((400, "frontend")))
    engine.on_policies(policies(("p", "backend", FROM_FRONTEND)))

    change = engine.remove_endpoint(10)
    assert dict(change.deletes) == {PolicyEntry(400, 0, 0, 0): Verdict.ALLOW}
    assert 10 not in engine.compiled
    assert engine.on_identities(identities((402, "frontend"))) == set()
