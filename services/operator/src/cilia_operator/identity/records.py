"""Store records of identities (pure functions on plain dicts).

``CiliumIdentity`` (``cilium.io/v2``, cluster-scoped, short name ``ciliumid``; upstream
``pkg/k8s/apis/cilium.io/v2``, reference: cilium-upstream.md §4)::

    metadata.name                 the numeric identity ("256")
    metadata.labels               the k8s-source labels that are valid Kubernetes labels
    metadata.annotations          cilia.io/node-references: "node-a,node-b" (Allocate/Release)
                                  io.cilium.heartbeat: RFC3339Nano, set by GC when it first
                                  found the identity unreferenced (upstream annotation)
    security-labels               {"k8s:app": "web", ...}: the source of truth

``CiliaIdentityKey`` (``cilia.io/v1alpha1``, internal, cluster-scoped): one per label set,
``metadata.name`` = SHA-256 of the sorted labels, ``spec.id`` = the identity. Created
with create-if-absent, it makes "one label set -> one identity" a store-level invariant
even across operator replicas.
"""

from __future__ import annotations

import copy
import datetime as _dt
import re
from collections.abc import Iterable
from typing import Any

from ..store import Resource
from .labels import InvalidLabels, LabelSet

API_VERSION = "cilium.io/v2"
KIND = "CiliumIdentity"
KEY_API_VERSION = "cilia.io/v1alpha1"
KEY_KIND = "CiliaIdentityKey"
SECURITY_LABELS = "security-labels"
NODE_REFERENCES = "cilia.io/node-references"
HEARTBEAT = "io.cilium.heartbeat"

_K8S_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_K8S_LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_K8S_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")


def _k8s_label_ok(key: str, value: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and (len(prefix) > 253 or not _K8S_LABEL_PREFIX.match(prefix)):
        return False
    return bool(_K8S_LABEL_NAME.match(name)) and bool(_K8S_LABEL_VALUE.match(value))


def identity_record(identity: int, labels: LabelSet, node: str = "") -> Resource:
    """A new CiliumIdentity record for ``identity`` (referenced by ``node`` when given)."""
    meta: dict[str, Any] = {"name": str(identity)}
    k8s = {
        label.key: label.value
        for label in labels.labels
        if label.source == "k8s" and _k8s_label_ok(label.key, label.value)
    }
    if k8s:
        meta["labels"] = k8s
    if node:
        meta["annotations"] = {NODE_REFERENCES: node}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": meta,
        SECURITY_LABELS: labels.security_labels(),
    }


def key_record(labels: LabelSet, identity: int) -> Resource:
    """The CiliaIdentityKey claiming ``labels`` for ``identity``."""
    return {
        "apiVersion": KEY_API_VERSION,
        "kind": KEY_KIND,
        "metadata": {"name": labels.digest()},
        "spec": {"id": str(identity), "labels": labels.strings()},
    }


def identity_id(record: Resource) -> int:
    """The numeric identity of a CiliumIdentity record (0 when the name is not a number)."""
    name = str((record.get("metadata") or {}).get("name") or "")
    return int(name) if name.isdigit() else 0


def key_id(record: Resource) -> int:
    """The identity a CiliaIdentityKey points to (0 when malformed)."""
    value = str((record.get("spec") or {}).get("id") or "")
    return int(value) if value.isdigit() else 0


def record_labels(record: Resource) -> LabelSet | None:
    """The label set of a CiliumIdentity record, or None when it has none/invalid ones."""
    raw = record.get(SECURITY_LABELS)
    if not isinstance(raw, dict):
        return None
    try:
        return LabelSet.from_security_labels({str(k): str(v) for k, v in raw.items()})
    except InvalidLabels:
        return None


def _annotations(record: Resource) -> dict[str, str]:
    return dict((record.get("metadata") or {}).get("annotations") or {})


def node_references(record: Resource) -> set[str]:
    """Nodes that allocated the identity and did not release it."""
    raw = _annotations(record).get(NODE_REFERENCES, "")
    return {n for n in raw.split(",") if n}


def heartbeat(record: Resource) -> _dt.datetime | None:
    """When GC first found the identity unreferenced (None: not marked or unparsable)."""
    raw = _annotations(record).get(HEARTBEAT)
    if not raw:
        return None
    try:
        return _dt.datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None


def _with_annotations(record: Resource, annotations: dict[str, str]) -> Resource:
    out = copy.deepcopy(record)
    meta = out.setdefault("metadata", {})
    if annotations:
        meta["annotations"] = annotations
    else:
        meta.pop("annotations", None)
    return out


def with_references(record: Resource, nodes: Iterable[str]) -> Resource:
    """A copy referenced by exactly ``nodes``; any GC heartbeat mark is cleared when
    ``nodes`` is non-empty (the identity is in use again)."""
    annotations = _annotations(record)
    names = sorted(set(nodes))
    if names:
        annotations[NODE_REFERENCES] = ",".join(names)
        annotations.pop(HEARTBEAT, None)
    else:
        annotations.pop(NODE_REFERENCES, None)
    return _with_annotations(record, annotations)


def with_heartbeat(record: Resource, when: _dt.datetime | None) -> Resource:
    """A copy with the GC mark set to ``when`` (UTC, RFC3339 with fraction) or removed."""
    annotations = _annotations(record)
    if when is None:
        annotations.pop(HEARTBEAT, None)
    else:
        annotations[HEARTBEAT] = when.astimezone(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return _with_annotations(record, annotations)
