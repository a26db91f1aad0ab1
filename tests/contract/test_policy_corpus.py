"""One policy parser: the operator and the agent judge every manifest of the corpus alike.

``tests/contract/policies/*.yaml``: CiliumNetworkPolicy, CiliumClusterwideNetworkPolicy
and NetworkPolicy manifests, valid and invalid, each starting with ``# expect: ...``:

- ``enforced``: the operator accepts it at apply (standalone mode); the agent enforces it
  as written; the operator reports nothing in Kubernetes mode.
- ``fail-closed <directions>``: the operator refuses it at apply; an agent handed it anyway
  (Kubernetes mode: the API server accepted it) enforces it fail closed, the endpoints it
  selects default-deny in exactly those directions, listed in the agent's status; the
  operator's Warning Event says so (reason ``PolicyFailClosed``).
- ``refused``: both refuse; nothing is enforced (the agent keeps the stored version).

The agent is driven through its real entry point (``PolicyRepository.apply`` of a
``WatchPoliciesResponse``), the operator through ``validate_policy`` (apply) and
``policy_event`` (the Kubernetes-mode Event).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest
import yaml

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_agent.policy.repository import PolicyRepository
from cilia_operator.errors import InvalidResource
from cilia_operator.policy.reporter import REASON_FAIL_CLOSED, REASON_REFUSED, policy_event
from cilia_operator.policy.validation import validate_policy

CORPUS = pathlib.Path(__file__).parent / "policies"
FILES = sorted(CORPUS.glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (enforced|refused|fail-closed((?: (?:ingress|egress))+))$")


def expectation(path: pathlib.Path) -> tuple[str, frozenset[str]]:
    m = EXPECT.match(path.read_text().splitlines()[0])
    assert m, f"{path.name}: first line must be '# expect: ...'"
    return m.group(1).split()[0], frozenset((m.group(2) or "").split())


def test_corpus_is_large_and_covers_every_kind_and_outcome() -> None:
    assert len(FILES) >= 40
    kinds = {yaml.safe_load(f.read_text()).get("kind") for f in FILES}
    assert {"CiliumNetworkPolicy", "CiliumClusterwideNetworkPolicy", "NetworkPolicy"} <= kinds
    outcomes = {expectation(f)[0] for f in FILES}
    assert outcomes == {"enforced", "fail-closed", "refused"}


def operator_accepts(doc: dict[str, Any]) -> bool:
    try:
        validate_policy(str(doc.get("kind")), doc)
    except (InvalidResource, Exception) as exc:  # an unknown kind has no schema
        assert isinstance(exc, InvalidResource) or "no schema" in str(exc), exc
        return False
    return True


@pytest.mark.parametrize("path", FILES, ids=[f.stem for f in FILES])
def test_operator_and_agent_judge_alike(path: pathlib.Path) -> None:
    outcome, directions = expectation(path)
    doc = yaml.safe_load(path.read_text())
    meta = doc.get("metadata") or {}
    repo = PolicyRepository()
    result = repo.apply(
        pb.WatchPoliciesResponse(
            events=[
                pb.PolicyEvent(
                    type=pb.EVENT_TYPE_UPSERT,
                    kind=str(doc.get("kind")),
                    namespace=str(meta.get("namespace") or ""),
                    name=str(meta.get("name") or ""),
                    json=json.dumps(doc),
                )
            ],
            synced=True,
        )
    )
    agent_enforces_as_written = len(repo) == 1 and not repo.unenforced()
    assert operator_accepts(doc) is agent_enforces_as_written is (outcome == "enforced")
    event = policy_event(doc, "default")

    if outcome == "enforced":
        assert result.errors == [] and result.fail_closed == [] and event is None
    elif outcome == "fail-closed":
        ((ref, judged),) = result.fail_closed
        assert judged.denied == directions
        stored = repo.get(ref)
        assert stored is not None
        for direction in directions:  # some selected endpoints deny that direction
            flag = f"default_deny_{direction}"
            number = 0 if direction == "ingress" else 1
            assert any(
                getattr(s, flag)
                or any(
                    r.deny and r.direction == number and r.peers.entities == {"all"}
                    for r in s.rules
                )
                for s in stored.subjects
            ), direction
        assert event is not None and event["reason"] == REASON_FAIL_CLOSED
        assert event["message"] == judged.summary()
    else:
        assert len(repo) == 0 and len(result.errors) == 1
        assert event is not None and event["reason"] == REASON_REFUSED
