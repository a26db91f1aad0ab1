"""What a policy manifest means to Cilia: enforced as written, enforced fail-closed, or refused.

In standalone mode the operator refuses at apply every manifest :func:`parse_policy`
refuses, so agents only see manifests the parser accepts. In Kubernetes mode the API
server accepts whatever its CRD / NetworkPolicy schema allows, so a manifest using a field
Cilia cannot enforce (a named port, SCTP, ``icmps``, ``toServices``, ...) still reaches the
agents. Skipping it would leave the pods it selects open; :func:`judge_policy` instead
rewrites it so that those pods are **default-deny in the direction of the rule Cilia cannot
enforce** (issue 29 item 4: never fail open):

- an allow rule (``ingress[i]``/``egress[i]``) with an error is replaced by a rule that
  allows nothing, and default-deny of its direction is forced on
  (``enableDefaultDeny.<direction>: true``): what the policy's other rules (and other
  policies) allow stays allowed, what the broken rule would have allowed is not;
- a deny rule (``ingressDeny[i]``/``egressDeny[i]``) with an error becomes a deny of every
  peer in its direction (``fromEntities``/``toEntities: [all]``), since what it denied
  cannot be told apart;
- a NetworkPolicy ``ingress[i]``/``egress[i]`` with an error is removed and its direction
  listed in ``policyTypes`` (default-deny for the selected pods);
- an error outside any rule item (e.g. ``nodeSelector``, a malformed
  ``endpointSelector``, an unknown field of the metadata) makes the endpoints of that rule
  (of every rule, for an error outside the rules) default-deny in both directions; an
  unreadable selector selects every endpoint of the policy's namespace (every endpoint
  for a cluster-wide policy).

A manifest that cannot be identified (no kind Cilia knows, no name) or that still fails
after the rewrite is refused: nothing can be enforced for it (:attr:`Judgement.policy` is
None).

Shared by the operator (it says, in an Event, what the agents enforce) and the agent (it
enforces it), so the two judge every manifest the same way.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from cilia_common.policy.model import (
    CCNP_KIND,
    NP_KIND,
    POLICY_KINDS,
    FieldError,
    InvalidPolicy,
    LabelSelector,
    Policy,
    parse_policy,
)

Verdict = Literal["enforced", "fail-closed", "refused"]

_CNP_ITEM = re.compile(r"^(spec|specs\[(\d+)\])\.(ingress|ingressDeny|egress|egressDeny)\[(\d+)\]")
_CNP_RULE = re.compile(r"^(spec|specs\[(\d+)\])(\.|$)")
_NP_ITEM = re.compile(r"^spec\.(ingress|egress)\[(\d+)\]")
_DIRECTION = {"ingress": "ingress", "ingressDeny": "ingress", "egress": "egress",
              "egressDeny": "egress"}  # fmt: skip


@dataclass(frozen=True)
class Judgement:
    """Outcome of :func:`judge_policy`.

    Attributes:
        policy: the model to enforce: the manifest's own (``enforced``), its fail-closed
            rewrite (``fail-closed``), or None (``refused``).
        errors: every problem of the manifest as written (empty when enforced).
        denied: the directions (``"ingress"``, ``"egress"``) made default-deny because of
            an error (empty when enforced).
        error: the parser's exception (None when enforced).
    """

    policy: Policy | None
    errors: tuple[FieldError, ...] = ()
    denied: frozenset[str] = frozenset()
    error: InvalidPolicy | None = None

    @property
    def verdict(self) -> Verdict:
        """``enforced``, ``fail-closed`` or ``refused`` (see the module docstring)."""
        if self.policy is None:
            return "refused"
        return "fail-closed" if self.errors else "enforced"

    def summary(self) -> str:
        """One line for a log, an Event or ``cilia-agent status``: the verdict, the
        directions denied and the first errors."""
        if not self.errors:
            return self.verdict
        what = "; ".join(str(e) for e in self.errors[:3])
        more = f" (+{len(self.errors) - 3} more)" if len(self.errors) > 3 else ""
        if self.policy is None:
            return f"refused, nothing enforced: {what}{more}"
        return f"{'/'.join(sorted(self.denied))} default-deny (fail closed): {what}{more}"


def judge_policy(manifest: Mapping[str, Any] | str | bytes) -> Judgement:
    """Parse a manifest and, when it has errors, build its fail-closed form.

    Never raises for a bad manifest: the outcome is in the :class:`Judgement`.
    """
    try:
        return Judgement(parse_policy(manifest))
    except InvalidPolicy as exc:
        first = exc
    doc = _as_mapping(manifest)
    if doc is None or first.kind not in POLICY_KINDS or not first.name:
        return Judgement(None, first.errors, error=first)
    rewritten, denied = _fail_closed(doc, first)
    try:
        policy = parse_policy(rewritten)
    except InvalidPolicy:
        return Judgement(None, first.errors, error=first)
    return Judgement(policy, first.errors, frozenset(denied), first)


def _as_mapping(manifest: Mapping[str, Any] | str | bytes) -> dict[str, Any] | None:
    if isinstance(manifest, str | bytes):
        try:
            manifest = json.loads(manifest)
        except ValueError:
            return None
    return copy.deepcopy(dict(manifest)) if isinstance(manifest, Mapping) else None


def _selector(value: Any) -> Any:
    """The selector as written when it parses, else ``{}`` (every endpoint in scope)."""
    try:
        LabelSelector.model_validate(value)
    except Exception:  # any problem: fall back to the widest subject
        return {}
    return value


def _fail_closed(doc: dict[str, Any], error: InvalidPolicy) -> tuple[dict[str, Any], set[str]]:
    if doc.get("kind") == NP_KIND:
        return _np_fail_closed(doc, error)
    return _cnp_fail_closed(doc, error)


def _cnp_fail_closed(doc: dict[str, Any], error: InvalidPolicy) -> tuple[dict[str, Any], set[str]]:
    denied: set[str] = set()
    items: set[tuple[str, str, int]] = set()  # (rule path, field, index)
    whole: set[str] = set()  # rule paths made default-deny both ways
    for e in error.errors:
        if m := _CNP_ITEM.match(e.path):
            items.add((m.group(1), m.group(3), int(m.group(4))))
        elif m := _CNP_RULE.match(e.path):
            whole.add(m.group(1))
        else:  # metadata, kind, ...: every rule
            whole |= {"spec"} | {f"specs[{i}]" for i in range(len(doc.get("specs") or []))}

    def rule_at(path: str) -> dict[str, Any] | None:
        if path == "spec":
            rule = doc.get("spec")
        else:
            specs = doc.get("specs")
            i = int(path[6:-1])
            rule = specs[i] if isinstance(specs, list) and i < len(specs) else None
        return rule if isinstance(rule, dict) else None

    for path, field, index in sorted(items):
        rule = rule_at(path)
        if rule is None or path in whole:
            continue
        entries = rule.get(field)
        if not isinstance(entries, list) or index >= len(entries):
            whole.add(path)
            continue
        direction = _DIRECTION[field]
        peer_field = "fromEntities" if direction == "ingress" else "toEntities"
        entries[index] = {peer_field: ["all"]} if field.endswith("Deny") else {}
        dd = rule.get("enableDefaultDeny")
        dd = dict(dd) if isinstance(dd, dict) else {}
        dd[direction] = True
        rule["enableDefaultDeny"] = dd
        denied.add(direction)
    for path in sorted(whole):
        rule = rule_at(path)
        if rule is None:  # no such rule: nothing selects endpoints through it
            continue
        selector = _selector(rule.get("endpointSelector"))
        new = {"endpointSelector": selector, "ingress": [{}], "egress": [{}]}
        if path == "spec":
            doc["spec"] = new
        elif isinstance(doc.get("specs"), list):
            doc["specs"][int(path[6:-1])] = new
        denied |= {"ingress", "egress"}
    if doc.get("kind") == CCNP_KIND and isinstance(doc.get("metadata"), dict):
        doc["metadata"].pop("namespace", None)
    return doc, denied


def _np_fail_closed(doc: dict[str, Any], error: InvalidPolicy) -> tuple[dict[str, Any], set[str]]:
    spec = doc.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    given = spec.get("policyTypes")
    if isinstance(given, list) and all(t in ("Ingress", "Egress") for t in given):
        types = set(given)
    else:
        types = {"Ingress"} | ({"Egress"} if "egress" in spec else set())
    drop: dict[str, set[int]] = {"ingress": set(), "egress": set()}
    whole = False
    for e in error.errors:
        if m := _NP_ITEM.match(e.path):
            drop[m.group(1)].add(int(m.group(2)))
        else:
            whole = True
    denied: set[str] = set()
    if whole:
        doc["spec"] = {"podSelector": _selector(spec.get("podSelector")),
                       "policyTypes": ["Ingress", "Egress"]}  # fmt: skip
        return doc, {"ingress", "egress"}
    for direction, indexes in drop.items():
        if not indexes:
            continue
        entries = spec.get(direction)
        spec[direction] = [r for i, r in enumerate(entries or []) if i not in indexes]
        types.add(direction.capitalize())
        denied.add(direction)
    spec["policyTypes"] = sorted(types, key=["Ingress", "Egress"].index)
    doc["spec"] = spec
    return doc, denied
