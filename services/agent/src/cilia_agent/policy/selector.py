"""Label selectors over identity labels, with upstream Cilium semantics.

- A selector key may name a label source (``k8s:app``, ``reserved:host``, ``$host``);
  a key without a source (``app``) matches a label of that key from any source.
- ``matchLabels {k: v}`` is ``k In [v]``; requirements are ANDed; ``{}`` selects all.
- ``In``: some label with the key has one of the values; ``NotIn``: no label with the
  key has one of the values (an absent key matches); ``Exists``/``DoesNotExist``.
- Namespace restriction (ISSUE3.md): a subject ``endpointSelector`` always selects in
  the policy's namespace; a peer selector is restricted to the policy's namespace unless
  it names ``io.kubernetes.pod.namespace`` (``k8s:`` or no source) or a ``reserved:`` key.

Source: upstream ``pkg/policy/api/selector.go``, ``pkg/labels`` (``any`` source),
``pkg/k8s/apis/cilium.io/utils/utils.go`` (``getEndpointSelector``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from cilia_agent.identity.labels import (
    POD_NAMESPACE_KEY,
    SOURCE_ANY,
    SOURCE_K8S,
    SOURCE_RESERVED,
    Label,
    LabelError,
    LabelSet,
    split_source,
)
from cilia_common.policy.model import LabelSelector

Operator = Literal["In", "NotIn", "Exists", "DoesNotExist"]


@dataclass(frozen=True, order=True)
class Requirement:
    """One requirement: ``source`` (None = any source), ``key``, ``operator``, ``values``."""

    key: str
    operator: Operator
    values: frozenset[str] = frozenset()
    source: str | None = None

    @classmethod
    def parse(cls, key: str, operator: Operator, values: Iterable[str] = ()) -> Requirement:
        """Build from a selector key such as ``k8s:app``, ``app`` or ``any:app``.

        Raises:
            LabelError: the key is empty after its source.
        """
        source, bare = split_source(key)
        if not bare:
            raise LabelError(f"selector key {key!r} is empty")
        if source == SOURCE_ANY or source == "":
            source = None
        return cls(bare, operator, frozenset(values), source)

    def _candidates(self, labels: LabelSet) -> list[Label]:
        return [
            lb for lb in labels.by_key(self.key) if self.source is None or lb.source == self.source
        ]

    def matches(self, labels: LabelSet) -> bool:
        """True when ``labels`` satisfies this requirement."""
        candidates = self._candidates(labels)
        if self.operator == "In":
            return any(lb.value in self.values for lb in candidates)
        if self.operator == "NotIn":
            return not any(lb.value in self.values for lb in candidates)
        if self.operator == "Exists":
            return bool(candidates)
        return not candidates

    def __str__(self) -> str:
        key = f"{self.source or SOURCE_ANY}:{self.key}"
        if self.operator in ("Exists", "DoesNotExist"):
            return f"{key} {self.operator}"
        return f"{key} {self.operator} ({','.join(sorted(self.values))})"


@dataclass(frozen=True)
class Selector:
    """A conjunction of requirements over a ``LabelSet``; no requirements = select all.

    Hashable, so results can be memoised per selector (``IdentityCache.matching``).
    """

    requirements: frozenset[Requirement] = frozenset()

    @classmethod
    def from_model(cls, model: LabelSelector) -> Selector:
        """Convert a parsed ``LabelSelector`` (``matchLabels`` + ``matchExpressions``).

        Raises:
            LabelError: an empty key after its source (``"k8s:"``).
        """
        reqs = [Requirement.parse(k, "In", [v]) for k, v in (model.match_labels or {}).items()]
        reqs += [
            Requirement.parse(e.key, e.operator, e.values or ())
            for e in model.match_expressions or ()
        ]
        return cls(frozenset(reqs))

    @classmethod
    def match_labels(cls, **labels: str) -> Selector:
        """Shorthand: ``Selector.match_labels(app="web")`` (source-less keys)."""
        return cls(frozenset(Requirement.parse(k, "In", [v]) for k, v in labels.items()))

    def matches(self, labels: LabelSet) -> bool:
        """True when every requirement holds for ``labels``."""
        return all(r.matches(labels) for r in self.requirements)

    def with_requirement(self, requirement: Requirement) -> Selector:
        """A new selector with ``requirement`` added."""
        return Selector(self.requirements | {requirement})

    def names_namespace(self) -> bool:
        """True when a requirement is on ``io.kubernetes.pod.namespace`` (k8s or any source)."""
        return any(
            r.key == POD_NAMESPACE_KEY and r.source in (None, SOURCE_K8S) for r in self.requirements
        )

    def names_reserved(self) -> bool:
        """True when a requirement is on a ``reserved:`` label."""
        return any(r.source == SOURCE_RESERVED for r in self.requirements)

    def in_namespace(self, namespace: str) -> Selector:
        """Subject form: force ``k8s:io.kubernetes.pod.namespace=<namespace>``.

        An ``In`` on the same ``k8s:`` key (a user naming another namespace) is replaced,
        as upstream's ``AddMatch`` overwrites it.
        """
        kept = {
            r
            for r in self.requirements
            if not (r.key == POD_NAMESPACE_KEY and r.source == SOURCE_K8S and r.operator == "In")
        }
        return Selector(frozenset(kept | {namespace_requirement(namespace)}))

    def restricted_to(self, namespace: str) -> Selector:
        """Peer form: add the namespace requirement unless the selector names a namespace
        or a reserved label (upstream ``getEndpointSelector``)."""
        if self.names_namespace() or self.names_reserved():
            return self
        return self.with_requirement(namespace_requirement(namespace))

    def __str__(self) -> str:
        return "{" + ", ".join(str(r) for r in sorted(self.requirements)) + "}"


def namespace_requirement(namespace: str) -> Requirement:
    """``k8s:io.kubernetes.pod.namespace In (namespace)``."""
    return Requirement(POD_NAMESPACE_KEY, "In", frozenset({namespace}), SOURCE_K8S)
