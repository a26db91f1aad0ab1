"""Validate policy manifests against their OpenAPI v3 schemas (one schema source).

The CiliumNetworkPolicy schema is the ``openAPIV3Schema`` of version ``v2`` of the CRD in
``crds/ciliumnetworkpolicies.yaml`` -- the same file Kubernetes would be given -- so
cilia-operator and a Kubernetes API server accept the same manifests. The NetworkPolicy
schema lives in ``schemas/networkpolicies.yaml``.

Kubernetes semantics applied to the schemas before use with ``jsonschema``:

- an object schema that lists ``properties`` and sets neither ``additionalProperties`` nor
  ``x-kubernetes-preserve-unknown-fields`` is closed (strict field validation: unknown
  fields are errors);
- ``x-kubernetes-*`` keywords are otherwise ignored (jsonschema ignores unknown keywords).

Checks a structural schema cannot express run afterwards: ``metadata.name`` is a DNS-1123
subdomain, ``metadata.namespace`` a DNS-1123 label, a CiliumNetworkPolicy has ``spec`` or
``specs`` (a CEL rule in the CRD), and selector ``matchExpressions`` carry ``values`` exactly
for ``In``/``NotIn``, ``except`` prefixes lie inside their ``cidr`` and an ``ipBlock`` peer
has no selector beside it.

Last, a manifest the schema accepts is judged by the one policy parser the agents use
(``cilia_common.policy.model.parse_policy``): what the agents could not enforce as written
is refused at apply too, so the operator and the agents never disagree about a manifest
(the corpus in ``tests/contract/policies`` checks it).

Every problem is reported as a ``FieldError`` with a path like
``spec.ingress[0].toPorts[0].ports[0].protocol``.
"""

from __future__ import annotations

import copy
import functools
import importlib.resources
import ipaddress
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jsonschema  # type: ignore[import-untyped, unused-ignore]
import yaml

from cilia_common.policy.model import InvalidPolicy, parse_policy

from ..errors import FieldError, InvalidResource, field_path

CNP_API_VERSION = "cilium.io/v2"
CNP_KIND = "CiliumNetworkPolicy"
CCNP_KIND = "CiliumClusterwideNetworkPolicy"
NP_API_VERSION = "networking.k8s.io/v1"
NP_KIND = "NetworkPolicy"
DEFAULT_NAMESPACE = "default"

CRD_RESOURCE = "crds/ciliumnetworkpolicies.yaml"
NP_SCHEMA_RESOURCE = "schemas/networkpolicies.yaml"

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


class SchemaError(RuntimeError):
    """A packaged schema file is missing or malformed (an installation problem)."""


def resource_text(name: str) -> str:
    """Text of a schema file shipped in this package (``crds/...``, ``schemas/...``).

    Raises:
        SchemaError: the file is not installed.
    """
    try:
        return importlib.resources.files(__package__).joinpath(name).read_text("utf-8")
    except OSError as exc:
        raise SchemaError(f"policy schema {name} is not installed: {exc}") from None


def _closed(schema: Any) -> Any:
    """Copy of ``schema`` with Kubernetes' strict-field semantics made explicit."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_schema(crd: Mapping[str, Any], version: str) -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version`` in a CRD document.

    Raises:
        SchemaError: the CRD has no such version or schema.
    """
    for entry in (crd.get("spec") or {}).get("versions") or []:
        if entry.get("name") == version:
            schema = (entry.get("schema") or {}).get("openAPIV3Schema")
            if isinstance(schema, dict):
                return copy.deepcopy(schema)
    raise SchemaError(f"CRD {crd.get('metadata', {}).get('name')} has no schema for {version}")


@functools.cache
def _validator(kind: str) -> Any:
    if kind in (CNP_KIND, CCNP_KIND):
        # a CCNP's rules are a CNP's (upstream: the same Rule type; scope Cluster)
        schema = crd_schema(yaml.safe_load(resource_text(CRD_RESOURCE)), "v2")
    elif kind == NP_KIND:
        schema = yaml.safe_load(resource_text(NP_SCHEMA_RESOURCE))
    else:
        raise SchemaError(f"no schema for kind {kind!r}")
    schema = _closed(schema)
    cls = jsonschema.Draft202012Validator
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise SchemaError(f"schema of {kind} is invalid: {exc.message}") from None
    return cls(schema)


_CIDR_FIELD = re.compile(r"(CIDR\[\d+\]|\.cidr|\.except\[\d+\])$")
"""Paths of prefix fields: ``fromCIDR[0]``, ``toCIDRSet[0].cidr``, ``ipBlock.except[1]``."""


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(error: Any) -> Iterator[FieldError]:
    path = field_path(list(error.absolute_path))
    validator = error.validator
    if validator == "additionalProperties" and isinstance(error.instance, dict):
        known = sorted((error.schema.get("properties") or {}).keys())
        for key in sorted(set(error.instance) - set(known)):
            yield FieldError(
                _join(path, str(key)),
                f"unknown field (not supported by Cilia or misspelt; known: {', '.join(known)})",
            )
        return
    if validator == "required" and isinstance(error.instance, dict):
        for key in error.validator_value:
            if key not in error.instance:
                yield FieldError(_join(path, str(key)), "required field is missing")
        return
    if validator == "anyOf":
        branches = error.validator_value
        if all(set(b) == {"required"} for b in branches):
            names = [n for b in branches for n in b["required"]]
            yield FieldError(path, f"one of {', '.join(names)} is required")
            return
        ints = [b for b in branches if b.get("type") == "integer"]
        if path.endswith("port") and ints:
            low, high = ints[0].get("minimum", 0), ints[0].get("maximum", 65535)
            yield FieldError(
                path,
                f"{error.instance!r} is not a port: use a number {low}..{high} or that "
                "number as a string (named ports are not supported by Cilia)",
            )
            return
        reasons = "; or ".join(sorted({e.message for e in error.context}))
        yield FieldError(path, f"{error.instance!r} matches no allowed form: {reasons}")
        return
    if validator in ("minimum", "maximum", "pattern") and path.endswith("port"):
        # the port schema is int-or-string: its range and pattern sit beside the type anyOf
        low, high = error.schema.get("minimum", 0), error.schema.get("maximum", 65535)
        yield FieldError(
            path,
            f"{error.instance!r} is not a port: use a number {low}..{high} or that "
            "number as a string (named ports are not supported by Cilia)",
        )
        return
    if validator == "pattern" and _CIDR_FIELD.search(path):
        if isinstance(error.instance, str) and ":" in error.instance:
            reason = "IPv6 is not supported by Cilia: the datapath is IPv4-only"
        else:
            reason = "use an IPv4 prefix a.b.c.d/n (0..32) or a bare address"
        yield FieldError(path, f"{error.instance!r} is not an IPv4 CIDR: {reason}")
        return
    if validator == "minProperties" and error.instance == {}:
        yield FieldError(path, "must not be empty")
        return
    yield FieldError(path, error.message)


def _selectors(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        if isinstance(node.get("matchExpressions"), list):
            yield path, node
        for key, value in node.items():
            yield from _selectors(value, _join(path, str(key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _selectors(value, f"{path}[{i}]")


def _metadata(doc: Mapping[str, Any]) -> list[FieldError]:
    errors = []
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        return []  # reported by the schema
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        errors.append(FieldError("metadata.name", "required field is missing"))
    elif len(name) > 253 or not _DNS1123_SUBDOMAIN.match(name):
        errors.append(FieldError("metadata.name", f"{name!r} is not a valid name: lower-case "
                                 "letters, digits, '-' and '.', at most 253 characters"))  # fmt: skip
    namespace = meta.get("namespace")
    if namespace is not None and (
        not isinstance(namespace, str) or len(namespace) > 63 or not _DNS1123_LABEL.match(namespace)
    ):
        errors.append(FieldError("metadata.namespace", f"{namespace!r} is not a valid namespace: "
                                 "lower-case letters, digits and '-', at most 63 characters"))  # fmt: skip
    return errors


def _spec_or_specs(kind: str, doc: Mapping[str, Any]) -> list[FieldError]:
    """A CiliumNetworkPolicy (or clusterwide one) has ``spec`` or ``specs``: the CRD states it as a CEL rule
    (``x-kubernetes-validations``; an anyOf at its root is refused by the API server because
    the CRD has a status subresource), which jsonschema does not evaluate."""
    if kind in (CNP_KIND, CCNP_KIND) and "spec" not in doc and "specs" not in doc:
        return [FieldError("", "one of spec, specs is required")]
    return []


def _selector_values(doc: Mapping[str, Any]) -> list[FieldError]:
    errors = []
    for root in ("spec", "specs"):
        for path, selector in _selectors(doc.get(root), root):
            for i, expr in enumerate(selector["matchExpressions"]):
                where = f"{path}.matchExpressions[{i}].values"
                op, values = expr.get("operator"), expr.get("values")
                if op in ("In", "NotIn") and not values:
                    errors.append(FieldError(where, f"operator {op} needs a non-empty values list"))
                if op in ("Exists", "DoesNotExist") and values:
                    errors.append(FieldError(where, f"operator {op} takes no values"))
    return errors


def _cidr_blocks(kind: str, doc: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every ``{cidr, except}`` block of a schema-valid policy with its path:
    ``fromCIDRSet``/``toCIDRSet`` items of a CNP/CCNP, ``ipBlock`` of NetworkPolicy peers."""
    if kind == NP_KIND:
        spec = doc.get("spec") or {}
        for direction, peers in (("ingress", "from"), ("egress", "to")):
            for i, rule in enumerate(spec.get(direction) or ()):
                for j, peer in enumerate(rule.get(peers) or ()):
                    if "ipBlock" in peer:
                        yield f"spec.{direction}[{i}].{peers}[{j}].ipBlock", peer
        return
    rules = [("spec", doc["spec"])] if doc.get("spec") else []
    rules += [(f"specs[{k}]", r) for k, r in enumerate(doc.get("specs") or ())]
    for root, rule in rules:
        for direction, field in (("ingress", "fromCIDRSet"), ("ingressDeny", "fromCIDRSet"),
                                 ("egress", "toCIDRSet"), ("egressDeny", "toCIDRSet")):  # fmt: skip
            for i, item in enumerate(rule.get(direction) or ()):
                for j, block in enumerate(item.get(field) or ()):
                    yield f"{root}.{direction}[{i}].{field}[{j}]", block


def _cidr_rules(kind: str, doc: Mapping[str, Any]) -> list[FieldError]:
    """What the schema's patterns cannot say about prefixes: each ``except`` lies strictly
    inside its ``cidr`` (Kubernetes' NetworkPolicy validation: "a strict subset"; an except
    equal to its cidr would select nothing),
    and an ``ipBlock`` peer sets no selector (Kubernetes: "may not be combined")."""
    errors = []
    for path, block in _cidr_blocks(kind, doc):
        if kind == NP_KIND:
            peer, block = block, block["ipBlock"]
            if "podSelector" in peer or "namespaceSelector" in peer:
                errors.append(FieldError(path, "ipBlock may not be combined with podSelector "
                                               "or namespaceSelector"))  # fmt: skip
        outer = ipaddress.IPv4Network(block["cidr"], strict=False)
        for i, inner in enumerate(block.get("except") or ()):
            net = ipaddress.IPv4Network(inner, strict=False)
            if not net.subnet_of(outer) or net == outer:
                errors.append(FieldError(f"{path}.except[{i}]",
                                         f"{inner} is not strictly inside cidr {block['cidr']}"))  # fmt: skip
    return errors


def validate_policy(kind: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a ``CiliumNetworkPolicy`` or ``NetworkPolicy`` manifest.

    Args:
        kind: ``CiliumNetworkPolicy``, ``CiliumClusterwideNetworkPolicy`` or
            ``NetworkPolicy`` (apiVersion checked by the caller).
        doc: the manifest.

    Returns:
        the manifest (a copy) with ``metadata.namespace`` defaulted to ``default`` (a
        CiliumClusterwideNetworkPolicy has none: one given is an error).

    Raises:
        InvalidResource: every problem, each with its field path and reason.
        SchemaError: the packaged schema is missing or broken.
    """
    validator = _validator(kind)
    errors: list[FieldError] = []
    for error in sorted(validator.iter_errors(dict(doc)), key=lambda e: list(e.absolute_path)):
        errors.extend(_describe(error))
    errors = _metadata(doc) + errors + _spec_or_specs(kind, doc)
    meta = doc.get("metadata")
    if kind == CCNP_KIND and isinstance(meta, dict) and meta.get("namespace"):
        errors.append(FieldError("metadata.namespace", f"{kind} is cluster-scoped: no namespace"))
    if not errors:
        errors = _selector_values(doc) + _cidr_rules(kind, doc)
    if not errors:
        errors = _parser_errors(doc)
    if errors:
        raise InvalidResource(_dedupe(errors))
    out = copy.deepcopy(dict(doc))
    out.setdefault("metadata", {})
    if kind == CCNP_KIND:
        out["metadata"].pop("namespace", None)
    else:
        out["metadata"]["namespace"] = out["metadata"].get("namespace") or DEFAULT_NAMESPACE
    return out


def _parser_errors(doc: Mapping[str, Any]) -> list[FieldError]:
    """What the agents' parser refuses in a schema-valid manifest (each with its path)."""
    try:
        parse_policy(dict(doc))
    except InvalidPolicy as exc:
        return [FieldError(e.path, e.message) for e in exc.errors]
    return []


def _dedupe(errors: Sequence[FieldError]) -> list[FieldError]:
    seen = set()
    out = []
    for error in errors:
        if error not in seen:
            seen.add(error)
            out.append(error)
    return out


def validate_cnp(doc: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`validate_policy` for CiliumNetworkPolicy."""
    return validate_policy(CNP_KIND, doc)


def validate_ccnp(doc: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`validate_policy` for CiliumClusterwideNetworkPolicy (no namespace)."""
    return validate_policy(CCNP_KIND, doc)


def validate_np(doc: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`validate_policy` for NetworkPolicy."""
    return validate_policy(NP_KIND, doc)
