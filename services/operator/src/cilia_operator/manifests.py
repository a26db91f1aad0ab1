"""Parse and validate manifests for ``apply``: all documents before any write.

A manifest is YAML or JSON text holding one or more documents (``---``-separated).
Every document is validated -- schema, immutable fields against what is stored, CIDR
overlaps with stored pools and with the other documents -- and every problem is reported
with its document index (0-based), field path and reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from .errors import FieldError, InvalidResource
from .ipam.pool import CiliumPodIPPool, PoolSpec, pool_overlaps, to_pool_spec
from .kinds import POOL, KindInfo, UnknownKind, kind_of


@dataclass(frozen=True)
class DocumentError:
    """One problem in one document of a manifest."""

    index: int
    resource: str  # "CiliumPodIPPool blue" or "" when unknown
    error: FieldError

    def __str__(self) -> str:
        what = f" ({self.resource})" if self.resource else ""
        return f"document {self.index}{what}: {self.error}"


class InvalidManifest(ValueError):
    """The manifest cannot be applied; ``errors`` lists every problem. Nothing was written."""

    def __init__(self, errors: list[DocumentError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


@dataclass(frozen=True)
class Document:
    """A validated document: its index, kind, key and the object to store.

    ``namespace`` is "" for cluster-scoped kinds and defaults to ``default`` otherwise.
    """

    index: int
    info: KindInfo
    name: str
    obj: dict[str, Any]
    namespace: str = ""


def parse_manifest(text: str) -> list[Any]:
    """Split YAML/JSON text into documents (empty documents dropped).

    Raises:
        InvalidManifest: the text is not YAML/JSON (names the line and column).
    """
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidManifest(
            [DocumentError(0, "", FieldError("", f"not YAML/JSON: {where}{problem}"))]
        ) from None
    if not docs:
        raise InvalidManifest([DocumentError(0, "", FieldError("", "manifest is empty"))])
    return docs


def _immutable(doc_spec: PoolSpec, stored: PoolSpec) -> list[FieldError]:
    errors = []
    if doc_spec.cidrs and stored.cidrs and doc_spec.mask_size != stored.mask_size:
        errors.append(
            FieldError(
                "spec.ipv4.maskSize",
                "cannot change IPv4 mask size in existing pool "
                f"({stored.mask_size} -> {doc_spec.mask_size})",
            )
        )
    if doc_spec.allow_first_ip != stored.allow_first_ip:
        errors.append(FieldError("spec.allowFirstIP", "field is immutable"))
    if doc_spec.allow_last_ip != stored.allow_last_ip:
        errors.append(FieldError("spec.allowLastIP", "field is immutable"))
    return errors


def validate_manifest(text: str, stored_pools: Mapping[str, PoolSpec]) -> list[Document]:
    """Validate every document of ``text``.

    Args:
        text: the manifest.
        stored_pools: pools in the store now, by name (for overlap and immutability).

    Returns:
        the documents, in order, ready to write.

    Raises:
        InvalidManifest: one or more documents are invalid; all problems are listed.
    """
    docs = parse_manifest(text)
    errors: list[DocumentError] = []
    out: list[Document] = []
    seen: dict[tuple[str, str, str], int] = {}
    manifest_pools: dict[str, PoolSpec] = {}
    for index, doc in enumerate(docs):
        if not isinstance(doc, dict):
            errors.append(DocumentError(index, "", FieldError("", "document is not a mapping")))
            continue
        try:
            info = kind_of(str(doc.get("apiVersion") or ""), str(doc.get("kind") or ""))
        except UnknownKind as exc:
            errors.append(DocumentError(index, "", FieldError("kind", str(exc))))
            continue
        raw_meta = doc.get("metadata")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        name = str(meta.get("name") or "")
        namespace = str(meta.get("namespace") or "default") if info.namespaced else ""
        label = f"{info.kind} {namespace + '/' if namespace else ''}{name}".strip()
        try:
            model = info.validate(doc)
        except InvalidResource as exc:
            errors.extend(DocumentError(index, label, e) for e in exc.errors)
            continue
        if (info.kind, namespace, name) in seen:
            errors.append(
                DocumentError(
                    index,
                    label,
                    FieldError(
                        "metadata.name", f"same as document {seen[info.kind, namespace, name]}"
                    ),
                )
            )
            continue
        seen[info.kind, namespace, name] = index
        if info is POOL and isinstance(model, CiliumPodIPPool):
            spec = to_pool_spec(model)
            problems = []
            if name in stored_pools:
                problems += _immutable(spec, stored_pools[name])
            others = {**stored_pools, **manifest_pools}
            problems += pool_overlaps(name, spec.cidrs, others.values())
            errors.extend(DocumentError(index, label, p) for p in problems)
            manifest_pools[name] = spec
        obj = {k: v for k, v in doc.items() if k != "status"}
        obj["metadata"] = {k: v for k, v in meta.items() if k in _KEPT_METADATA}
        if namespace:
            obj["metadata"]["namespace"] = namespace
        out.append(Document(index, info, name, obj, namespace))
    if errors:
        raise InvalidManifest(errors)
    return out


_KEPT_METADATA = ("name", "labels", "annotations")
