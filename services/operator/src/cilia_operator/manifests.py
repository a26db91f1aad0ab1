"""Parse and validate manifests for ``apply``: all documents before any write.

A manifest is YAML or JSON text holding one or more documents (``---``-separated).
Order of operations:

1. :func:`parse_manifest` reads the text with bounded resources (:class:`ManifestLimits`,
   each a ``serve`` flag): the text's size, the number of documents, the nesting depth,
   the nodes YAML aliases add once expanded (a "billion laughs" bomb of a few hundred
   bytes would expand to gigabytes) and each document's size as stored JSON. A key given
   twice in one mapping is refused, as Kubernetes' strict decoding does (upstream
   sigs.k8s.io/yaml ``UnmarshalStrict``); YAML merge keys (``<<``) may still be
   overridden. A limit exceeded is reported naming its flag, before the text is
   expanded or stored.
2. :func:`validate_documents` validates every document -- schema, immutable fields
   against what is stored, CIDR overlaps with stored pools and with the other documents
   -- and reports every problem with its document index (0-based), field path and
   reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .errors import FieldError, InvalidResource
from .ipam.pool import CiliumPodIPPool, PoolSpec, pool_overlaps, to_pool_spec
from .kinds import POOL, KindInfo, UnknownKind, kind_of


@dataclass(frozen=True)
class ManifestLimits:
    """Bounds on one ``apply`` manifest; each is a ``cilia-operator serve`` flag.

    Attributes:
        max_bytes: UTF-8 size of the manifest text (``--apply-max-manifest-bytes``,
            default 3 MiB, the Kubernetes API server's request body limit).
        max_documents: documents in one manifest (``--apply-max-documents``, 1000).
        max_depth: nesting of mappings/sequences, aliases expanded
            (``--apply-max-depth``, 100; at most 200 so parsing stays within Python's
            recursion limit).
        max_alias_nodes: YAML nodes that aliases add to the whole manifest once
            expanded (``--apply-max-alias-nodes``, 10,000); manifests without aliases
            never reach it.
        max_record_bytes: one document's size as the compact JSON the store keeps
            (``--apply-max-record-bytes``, 1.5 MiB, etcd's default request limit, well
            below the 4 MiB gRPC message agents receive records in).
    """

    max_bytes: int = 3 * 1024 * 1024
    max_documents: int = 1000
    max_depth: int = 100
    max_alias_nodes: int = 10_000
    max_record_bytes: int = 1536 * 1024


class ManifestTooLarge(ValueError):
    """The manifest exceeds one of the :class:`ManifestLimits`; ``flag`` names it."""

    def __init__(self, flag: str, limit: int, what: str, index: int = 0) -> None:
        self.flag, self.limit, self.index = flag, limit, index
        super().__init__(f"{what}: over the limit --{flag}={limit}")


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


_MERGE_TAG = "tag:yaml.org,2002:merge"


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader with the :class:`ManifestLimits` checked while composing
    (before anything is constructed) and duplicate keys refused."""

    def __init__(self, text: str, limits: ManifestLimits) -> None:
        super().__init__(text)
        self.limits = limits
        self.depth = 0
        self.documents = 0
        self.alias_nodes = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self.depth += 1
        try:
            if self.depth > self.limits.max_depth:
                raise ManifestTooLarge(
                    "apply-max-depth", self.limits.max_depth,
                    f"nests deeper than {self.limits.max_depth} levels", self.documents,
                )  # fmt: skip
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def compose_document(self) -> Node | None:
        if self.documents >= self.limits.max_documents:
            raise ManifestTooLarge(
                "apply-max-documents", self.limits.max_documents,
                f"manifest has more than {self.limits.max_documents} documents", self.documents,
            )  # fmt: skip
        node: Node | None = super().compose_document()
        if node is not None:
            self._check_expansion(node)
        self.documents += 1
        return node

    def _check_expansion(self, root: Node) -> None:
        """Count the nodes and depth of ``root`` with aliases expanded, without expanding.

        Raises:
            ManifestTooLarge: aliases add more than ``max_alias_nodes`` nodes to the
                manifest, or nest deeper than ``max_depth``.
            yaml.YAMLError: an alias refers to a node containing it (recursive).
        """
        limits = self.limits
        memo: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, depth)
        open_nodes: set[int] = set()
        distinct: set[int] = set()
        expanded = 0  # nodes visited so far, aliases expanded

        def count(n: int) -> None:
            nonlocal expanded
            expanded += n
            if expanded - len(distinct) + self.alias_nodes > limits.max_alias_nodes:
                raise ManifestTooLarge(
                    "apply-max-alias-nodes", limits.max_alias_nodes,
                    f"YAML aliases expand to more than {limits.max_alias_nodes} extra nodes",
                    self.documents,
                )  # fmt: skip

        def walk(node: Node, level: int) -> tuple[int, int]:
            if level > limits.max_depth:
                raise ManifestTooLarge(
                    "apply-max-depth", limits.max_depth,
                    f"nests deeper than {limits.max_depth} levels (aliases expanded)",
                    self.documents,
                )  # fmt: skip
            key = id(node)
            if key in memo and memo[key][1] + level - 1 <= limits.max_depth:
                count(memo[key][0])
                return memo[key]
            if key in open_nodes:
                raise yaml.YAMLError("an alias refers to a node that contains it (recursive)")
            distinct.add(key)
            count(1)
            children: list[Node] = []
            if isinstance(node, SequenceNode):
                children = list(node.value)
            elif isinstance(node, MappingNode):
                children = [n for pair in node.value for n in pair]
            open_nodes.add(key)
            total, depth = 1, 0
            for child in children:
                n, d = walk(child, level + 1)
                total += n
                depth = max(depth, d)
            open_nodes.discard(key)
            memo[key] = (total, depth + 1)
            return memo[key]

        walk(root, 1)
        self.alias_nodes = expanded - len(distinct) + self.alias_nodes

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[tuple[str, str], Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, ScalarNode):
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key_node.value!r} (first at line "
                    f"{seen[key].line + 1})", key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _refused(problem: str, index: int = 0) -> InvalidManifest:
    return InvalidManifest([DocumentError(index, "", FieldError("", problem))])


def parse_manifest(text: str, limits: ManifestLimits | None = None) -> list[Any]:
    """Split YAML/JSON text into documents (empty documents dropped), within ``limits``.

    CPU-bound for large texts (pure-Python PyYAML): callers on an event loop run it in a
    thread (``asyncio.to_thread``) so other requests keep being served.

    Args:
        text: the manifest.
        limits: the bounds (default: :class:`ManifestLimits` defaults).

    Raises:
        InvalidManifest: the text is not YAML/JSON (names the line and column), has a
            duplicate key, or exceeds a limit (names the flag and its value).
    """
    limits = limits or ManifestLimits()
    # every character is at least one UTF-8 byte: the cheap test first
    if len(text) > limits.max_bytes or len(text.encode("utf-8")) > limits.max_bytes:
        raise _refused(
            str(ManifestTooLarge("apply-max-manifest-bytes", limits.max_bytes,
                                 f"manifest is {len(text.encode('utf-8'))} bytes"))
        )  # fmt: skip
    loader: _BoundedLoader | None = None
    try:
        loader = _BoundedLoader(text, limits)
        docs = []
        while loader.check_data():  # type: ignore[no-untyped-call]
            doc = loader.get_data()
            if doc is not None:
                docs.append(doc)
    except ManifestTooLarge as exc:
        raise _refused(str(exc), exc.index) from None
    except RecursionError:
        raise _refused(
            str(ManifestTooLarge("apply-max-depth", limits.max_depth,
                                 "nests too deep to parse")), loader.documents if loader else 0
        ) from None  # fmt: skip
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise _refused(f"not YAML/JSON: {where}{problem}") from None
    finally:
        if loader is not None:
            loader.dispose()
    if not docs:
        raise _refused("manifest is empty")
    errors = []
    for index, doc in enumerate(docs):
        try:
            size = len(json.dumps(doc, separators=(",", ":"), default=str).encode("utf-8"))
        except (TypeError, ValueError, RecursionError) as exc:
            errors.append(DocumentError(index, "", FieldError("", f"not JSON-shaped: {exc}")))
            continue
        if size > limits.max_record_bytes:
            too = ManifestTooLarge("apply-max-record-bytes", limits.max_record_bytes,
                                   f"document is {size} bytes as JSON")  # fmt: skip
            errors.append(DocumentError(index, "", FieldError("", str(too))))
    if errors:
        raise InvalidManifest(errors)
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


def validate_manifest(
    text: str, stored_pools: Mapping[str, PoolSpec], limits: ManifestLimits | None = None
) -> list[Document]:
    """Parse (:func:`parse_manifest`) and validate (:func:`validate_documents`) ``text``.

    Raises:
        InvalidManifest: see both functions.
    """
    return validate_documents(parse_manifest(text, limits), stored_pools)


def validate_documents(docs: list[Any], stored_pools: Mapping[str, PoolSpec]) -> list[Document]:
    """Validate every parsed document.

    Args:
        docs: the documents from :func:`parse_manifest` (not modified).
        stored_pools: pools in the store now, by name (for overlap and immutability).

    Returns:
        the documents, in order, ready to write.

    Raises:
        InvalidManifest: one or more documents are invalid; all problems are listed.
    """
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
