"""Policy repository: the current policies, a revision counter, and change impact.

Fed by ``PolicyService.WatchPolicies`` (``proto/cilia/controlplane/v1/controlplane.proto``):
a ``WatchPoliciesResponse`` carries ``events`` (``PolicyEvent{type: UPSERT=1 | DELETE=2,
kind, namespace, name, json, resource_version}``) and ``synced``. ``apply`` judges each
manifest with the parser the operator uses too (``cilia_common.policy.judge_policy``) and
stores its ``CompiledPolicy``. A manifest with a rule Cilia cannot enforce (a named port,
SCTP, ``icmps``, ... which the API server accepts in Kubernetes mode) is stored **fail
closed**: the endpoints it selects become default-deny in that rule's direction, and the
policy is listed by :meth:`PolicyRepository.unenforced` (agent ``status``, the
``cilia_policy_unenforceable`` gauge). A manifest that cannot even be identified is
reported and leaves the stored version of that policy untouched.

Impact: after a policy change only endpoints selected by the old or the new version need
recompiling (``affected_by_policies``); after identity changes only endpoints selected by
a rule whose peer selectors match the old or new labels of a changed identity, or that
use the ``cluster`` entity while a cluster identity changed, or the ``world`` entity while a
CIDR identity changed (``affected_by_identities``).

Not thread-safe: feed it from the agent's event loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from cilia_agent.identity.cache import IdentityCache, IdentityChange
from cilia_agent.identity.cidr import is_local_identity
from cilia_agent.identity.labels import LabelError, LabelSet, is_cluster_identity
from cilia_agent.policy.compiler import EndpointPolicy, EndpointSubject, compile_endpoint
from cilia_agent.policy.rules import CompiledPolicy, PolicyRef, compile_policy
from cilia_common.policy.judge import Judgement, judge_policy
from cilia_common.policy.model import (
    CCNP_KIND,
    DEFAULT_NAMESPACE,
    POLICY_KINDS,
    FieldError,
    InvalidPolicy,
)

log = logging.getLogger(__name__)

EVENT_TYPE_UPSERT = 1
EVENT_TYPE_DELETE = 2

K = TypeVar("K")


class PolicyEventLike(Protocol):
    """Shape of ``controlplane_pb2.PolicyEvent``."""

    @property
    def type(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def json(self) -> str: ...


class WatchPoliciesResponseLike(Protocol):
    """Shape of ``controlplane_pb2.WatchPoliciesResponse``."""

    @property
    def events(self) -> Sequence[PolicyEventLike]: ...
    @property
    def synced(self) -> bool: ...


@dataclass(frozen=True)
class PolicyUpdate:
    """One effective change of a policy: ``old``/``new`` (None = absent before/after)."""

    ref: PolicyRef
    old: CompiledPolicy | None
    new: CompiledPolicy | None


@dataclass
class BatchResult:
    """Outcome of ``PolicyRepository.apply``: effective updates, rejected manifests, and
    manifests stored fail-closed (with their judgement)."""

    updates: list[PolicyUpdate] = field(default_factory=list)
    errors: list[InvalidPolicy] = field(default_factory=list)
    fail_closed: list[tuple[PolicyRef, Judgement]] = field(default_factory=list)
    revision: int = 0


class PolicyRepository:
    """Current policies by ``PolicyRef``.

    Attributes:
        revision: incremented on every effective policy change (upstream policy revision).
        synced: True once the initial listing of the current stream was applied.
    """

    def __init__(self) -> None:
        self._policies: dict[PolicyRef, CompiledPolicy] = {}
        self._unenforced: dict[PolicyRef, Judgement] = {}
        self._seen: set[PolicyRef] | None = None
        self.revision = 0
        self.synced = False

    # ------------------------------------------------------------------ reads

    def policies(self) -> tuple[CompiledPolicy, ...]:
        """Every stored policy, ordered by reference."""
        return tuple(self._policies[r] for r in sorted(self._policies))

    def get(self, ref: PolicyRef) -> CompiledPolicy | None:
        """The stored policy, None when absent."""
        return self._policies.get(ref)

    def __len__(self) -> int:
        return len(self._policies)

    def unenforced(self) -> dict[PolicyRef, str]:
        """Policies stored fail-closed: reference → one-line reason (the directions made
        default-deny and the fields Cilia cannot enforce)."""
        return {ref: self._unenforced[ref].summary() for ref in sorted(self._unenforced)}

    def compile(self, endpoint: EndpointSubject, identities: IdentityCache) -> EndpointPolicy:
        """``compile_endpoint`` over every stored policy."""
        return compile_endpoint(endpoint, self._policies.values(), identities)

    # ------------------------------------------------------------------ writes

    def upsert(
        self, manifest: Mapping[str, Any] | str | bytes, namespace: str | None = None
    ) -> PolicyUpdate | None:
        """Store a policy manifest; returns the update, None when nothing changed.

        ``namespace``: the namespace the event names; used when the manifest has none. A
        manifest with rules Cilia cannot enforce is stored in its fail-closed form
        (``judge_policy``) and listed by :meth:`unenforced`.

        Raises:
            InvalidPolicy: the manifest cannot be identified or still fails after its
                fail-closed rewrite, or names another namespace than ``namespace``
                (nothing is changed).
        """
        judgement = judge_policy(manifest)
        if judgement.policy is None:
            assert judgement.error is not None
            raise judgement.error
        policy = judgement.policy
        own = policy.metadata.namespace
        if own and namespace and own != namespace:
            raise InvalidPolicy(
                policy.kind,
                own,
                policy.metadata.name,
                [FieldError("metadata.namespace", f"{own!r} differs from event's {namespace!r}")],
            )
        ns = "" if policy.kind == CCNP_KIND else own or namespace or DEFAULT_NAMESPACE
        try:
            compiled = compile_policy(policy, ns)
        except LabelError as exc:
            raise InvalidPolicy(
                policy.kind, ns, policy.metadata.name, [FieldError("spec", str(exc))]
            ) from exc
        if self._seen is not None:
            self._seen.add(compiled.ref)
        if judgement.errors:
            self._unenforced[compiled.ref] = judgement
        else:
            self._unenforced.pop(compiled.ref, None)
        old = self._policies.get(compiled.ref)
        if old is not None and old == compiled:
            return None
        self._policies[compiled.ref] = compiled
        self.revision += 1
        return PolicyUpdate(compiled.ref, old, compiled)

    def delete(self, kind: str, namespace: str, name: str) -> PolicyUpdate | None:
        """Remove a policy; returns the update, None when it was absent."""
        ref = PolicyRef(kind, "" if kind == CCNP_KIND else namespace or DEFAULT_NAMESPACE, name)
        old = self._policies.pop(ref, None)
        self._unenforced.pop(ref, None)
        if old is None:
            return None
        self.revision += 1
        return PolicyUpdate(ref, old, None)

    def begin_resync(self) -> None:
        """A new stream starts: policies it does not list before ``synced`` get removed."""
        self._seen = set()
        self.synced = False

    def apply(self, response: WatchPoliciesResponseLike) -> BatchResult:
        """Apply one ``WatchPoliciesResponse``.

        Invalid manifests are logged and returned in ``errors``; the previous version of
        such a policy stays in force. On ``synced`` after ``begin_resync()``, policies the
        stream did not list are removed.
        """
        result = BatchResult()
        for event in response.events:
            try:
                update = self._apply_event(event)
            except InvalidPolicy as exc:
                log.warning("ignoring policy event: %s", exc)
                result.errors.append(exc)
                continue
            if update is not None:
                result.updates.append(update)
                judged = self._unenforced.get(update.ref)
                if judged is not None:
                    log.warning("policy %s enforced fail closed: %s", update.ref, judged.summary())
                    result.fail_closed.append((update.ref, judged))
        if response.synced:
            if self._seen is not None:
                for ref in [r for r in self._policies if r not in self._seen]:
                    update = self.delete(ref.kind, ref.namespace, ref.name)
                    if update is not None:
                        result.updates.append(update)
                self._seen = None
            self.synced = True
        result.revision = self.revision
        return result

    def _apply_event(self, event: PolicyEventLike) -> PolicyUpdate | None:
        if event.kind not in POLICY_KINDS:
            raise InvalidPolicy(
                event.kind,
                event.namespace,
                event.name,
                [FieldError("kind", f"must be one of {sorted(POLICY_KINDS)}")],
            )
        if event.type == EVENT_TYPE_DELETE:
            return self.delete(event.kind, event.namespace, event.name)
        if event.type != EVENT_TYPE_UPSERT:
            raise InvalidPolicy(
                event.kind,
                event.namespace,
                event.name,
                [FieldError("", f"unknown event type {event.type}")],
            )
        update = self.upsert(event.json, namespace=event.namespace or None)
        if update is not None and (update.ref.kind, update.ref.name) != (event.kind, event.name):
            log.warning(
                "policy event %s/%s carried manifest %s", event.kind, event.name, update.ref
            )
        return update

    # ------------------------------------------------------------------ impact

    @staticmethod
    def affected_by_policies(
        updates: Iterable[PolicyUpdate], endpoints: Mapping[K, EndpointSubject]
    ) -> set[K]:
        """Endpoints (keys of ``endpoints``) selected by the old or new version of an update."""
        versions = [p for u in updates for p in (u.old, u.new) if p is not None]
        return {
            key for key, ep in endpoints.items() if any(p.selecting(ep.labels) for p in versions)
        }

    def affected_by_identities(
        self, changes: Iterable[IdentityChange], endpoints: Mapping[K, EndpointSubject]
    ) -> set[K]:
        """Endpoints whose compiled entries may change after ``changes`` to the identity cache."""
        changed = list(changes)
        if not changed:
            return set()
        label_sets: list[LabelSet] = [
            ls for c in changed for ls in (c.old, c.new) if ls is not None
        ]
        cluster_changed = any(is_cluster_identity(c.id) for c in changed)
        local_changed = any(is_local_identity(c.id) for c in changed)
        affected: set[K] = set()
        for key, ep in endpoints.items():
            for policy in self._policies.values():
                if _peers_touch(policy, ep.labels, label_sets, cluster_changed, local_changed):
                    affected.add(key)
                    break
        return affected


def _peers_touch(
    policy: CompiledPolicy,
    labels: LabelSet,
    changed: list[LabelSet],
    cluster_changed: bool,
    local_changed: bool,
) -> bool:
    for subject in policy.selecting(labels):
        for rule in subject.rules:
            if cluster_changed and "cluster" in rule.peers.entities:
                return True
            if local_changed and "world" in rule.peers.entities:
                return True
            if any(rule.peers.matches_labels(ls) for ls in changed):
                return True
    return False
