"""Which pool a pod allocates from (``IPAMService.ResolvePool``).

Precedence (upstream ``Documentation/network/concepts/ipam/multi-pool.rst`` and
``pkg/ipam/metadata/manager.go``; reference: cilium-upstream.md §1):

1. the pod's annotation ``ipam.cilium.io/ipv4-pool``, then ``ipam.cilium.io/ip-pool``;
   then the same keys on its Namespace;
2. the one pool whose ``podSelector``/``namespaceSelector`` matches (both must match
   when both are set; an unset or empty namespaceSelector means any namespace). The
   pod's labels gain the synthetic ``io.kubernetes.pod.namespace`` and
   ``io.kubernetes.pod.name``. More than one match is an error;
3. the default pool (``--ipam-default-ip-pool``).

A named pool that does not exist falls back to the default pool unless
``ipam.cilium.io/require-pool-match: "true"`` is set (pod or namespace); the same
annotation also forbids the default-pool fallback when no selector matches.

Namespace objects (``v1 Namespace`` with labels/annotations) are applied with
``cilia-operator apply``; a namespace that has none counts as having no labels and
no annotations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import from_pydantic
from .pool import ObjectMeta

IPV4_POOL = "ipam.cilium.io/ipv4-pool"
IP_POOL = "ipam.cilium.io/ip-pool"
REQUIRE_MATCH = "ipam.cilium.io/require-pool-match"
POD_NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
POD_NAME_LABEL = "io.kubernetes.pod.name"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"

NAMESPACE_KIND = "Namespace"
NAMESPACE_API_VERSION = "v1"


class NoPoolMatch(Exception):
    """No pool can be chosen (several selectors match, or require-pool-match refused
    the fallback). The message names the pod, the pools and the reason."""


class NamespaceModel(BaseModel):
    """A Kubernetes v1 Namespace (only metadata matters; spec/status are kept)."""

    model_config = ConfigDict(extra="forbid")
    apiVersion: str  # noqa: N815
    kind: str
    metadata: ObjectMeta
    spec: dict[str, Any] | None = None
    status: dict[str, Any] | None = None


def validate_namespace(doc: Mapping[str, Any]) -> NamespaceModel:
    """Validate a Namespace manifest.

    Raises:
        InvalidResource: with field paths.
    """
    try:
        return NamespaceModel.model_validate(dict(doc))
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes LabelSelector semantics: matchLabels all equal, and every
    matchExpressions entry (In, NotIn, Exists, DoesNotExist) holds. An empty selector
    matches everything."""
    if not selector:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op = expr.get("key"), expr.get("operator")
        values = expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


@dataclass(frozen=True)
class Resolution:
    """The chosen pool and why (e.g. ``pod annotation ipam.cilium.io/ip-pool``)."""

    pool: str
    reason: str


def resolve_pool(
    *,
    namespace: str,
    name: str,
    pod_labels: Mapping[str, str],
    pod_annotations: Mapping[str, str],
    namespace_obj: Mapping[str, Any] | None,
    pools: Iterable[Mapping[str, Any]],
    default_pool: str,
) -> Resolution:
    """Pick the pool for pod ``namespace/name`` (see the module docstring).

    Args:
        namespace_obj: the stored Namespace (None when not applied).
        pools: stored CiliumPodIPPool objects.
        default_pool: ``--ipam-default-ip-pool``.

    Raises:
        NoPoolMatch: several pools' selectors match, or require-pool-match forbids the
            fallback to the default pool.
    """
    meta = (namespace_obj or {}).get("metadata") or {}
    ns_annotations: Mapping[str, str] = meta.get("annotations") or {}
    ns_labels = {NAMESPACE_NAME_LABEL: namespace, **(meta.get("labels") or {})}
    pools = list(pools)
    names = {str(p["metadata"]["name"]) for p in pools}
    require = "true" in (
        str(pod_annotations.get(REQUIRE_MATCH, "")).lower(),
        str(ns_annotations.get(REQUIRE_MATCH, "")).lower(),
    )
    who = f"pod {namespace}/{name}"
    for where, notes in (("pod", pod_annotations), ("namespace", ns_annotations)):
        for key in (IPV4_POOL, IP_POOL):
            wanted = notes.get(key)
            if not wanted:
                continue
            if wanted in names:
                return Resolution(wanted, f"{where} annotation {key}")
            if require:
                raise NoPoolMatch(
                    f"{who}: {where} annotation {key} names pool {wanted!r}, which does not "
                    f"exist, and {REQUIRE_MATCH} is true"
                )
            return Resolution(
                default_pool,
                f"{where} annotation {key} names unknown pool {wanted!r}: default pool",
            )
    labels = {**pod_labels, POD_NAMESPACE_LABEL: namespace, POD_NAME_LABEL: name}
    matched = []
    for pool in pools:
        spec = pool.get("spec") or {}
        pod_sel, ns_sel = spec.get("podSelector"), spec.get("namespaceSelector")
        if pod_sel is None and ns_sel is None:
            continue
        if selector_matches(pod_sel, labels) and selector_matches(ns_sel, ns_labels):
            matched.append(str(pool["metadata"]["name"]))
    if len(matched) > 1:
        raise NoPoolMatch(
            f"{who}: the selectors of several pools match ({', '.join(sorted(matched))}); "
            "exactly one may match"
        )
    if matched:
        return Resolution(matched[0], "podSelector/namespaceSelector match")
    if require:
        raise NoPoolMatch(
            f"{who}: no pool annotation and no pool selector matches, and {REQUIRE_MATCH} "
            "is true (the default pool is not used)"
        )
    return Resolution(default_pool, "default pool (ipam-default-ip-pool)")
