"""Pydantic models of CiliumNetworkPolicy (cilium.io/v2) and NetworkPolicy (networking.k8s.io/v1).

The one policy parser of Cilia: the operator refuses at apply what it refuses, the agent
compiles what it accepts (``cilia_common.policy.judge`` says what the agent enforces
instead when a manifest reaches it anyway, in Kubernetes mode).

Only the subset Cilia enforces is modelled; every other field is rejected with its
path (``spec.ingress[0].toPorts[0].ports[0].endPort: not supported by Cilia``) so a
manifest never silently means less than it says. This module depends on pydantic and
the standard library only.

Entry point: ``parse_policy(manifest) -> CiliumNetworkPolicy |
CiliumClusterwideNetworkPolicy | NetworkPolicy``, raising
``InvalidPolicy`` with every field error.

Source: upstream ``pkg/k8s/apis/cilium.io/v2`` (CNP), ``pkg/policy/api`` (rule fields),
Kubernetes ``networking.k8s.io/v1``; reference: cilium-upstream.md §5.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails, PydanticCustomError

CNP_API_VERSION = "cilium.io/v2"
CNP_KIND = "CiliumNetworkPolicy"
CCNP_KIND = "CiliumClusterwideNetworkPolicy"
NP_API_VERSION = "networking.k8s.io/v1"
NP_KIND = "NetworkPolicy"
DEFAULT_NAMESPACE = "default"

Entity = Literal[
    "all",
    "world",
    "cluster",
    "host",
    "remote-node",
    "kube-apiserver",
    "health",
    "init",
    "ingress",
    "unmanaged",
]
"""Upstream entity names (``fromEntities``/``toEntities``)."""


@dataclass(frozen=True)
class FieldError:
    """One problem in a manifest: dotted path (``spec.ingress[0].toPorts``) and message."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class InvalidPolicy(ValueError):
    """A policy manifest is malformed or uses a field Cilia does not support.

    Attributes: ``kind``, ``namespace``, ``name`` (as far as they could be read; may be
    empty) and ``errors`` (every ``FieldError``).
    """

    def __init__(self, kind: str, namespace: str, name: str, errors: Sequence[FieldError]):
        self.kind = kind
        self.namespace = namespace
        self.name = name
        self.errors = tuple(errors)
        what = f"{kind or 'policy'} {namespace}/{name}" if name else (kind or "policy")
        super().__init__(f"{what} is invalid: " + "; ".join(str(e) for e in self.errors))


def _format_loc(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_MESSAGES = {"extra_forbidden": "unknown field"}
_UNSUPPORTED = "cilia_unsupported"
_ITEM = "cilia_item"
"""Error type of a list item's problem found by the list's validator (``ctx.index``)."""


class _Model(BaseModel):
    """Strict base: unknown fields rejected, camelCase names as in the manifests."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )
    _unsupported: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            present = [name for name in cls._unsupported if name in data]
            if present:
                raise PydanticCustomError(
                    _UNSUPPORTED,
                    "{fields} not supported by Cilia",
                    {"fields": ",".join(present)},
                )
        return data


# ----------------------------------------------------------------------------- selectors


class LabelSelectorRequirement(_Model):
    """``{key, operator: In|NotIn|Exists|DoesNotExist, values}``."""

    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs a non-empty values list")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self


class LabelSelector(_Model):
    """Kubernetes label selector; keys may carry a label source (``k8s:app``)."""

    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None

    @field_validator("match_labels")
    @classmethod
    def _keys_not_empty(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        for key in value or {}:
            if not key or key.endswith(":"):
                raise ValueError(f"empty label key {key!r}")
        return value


# ----------------------------------------------------------------------------- ports


_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
"""A named port (Kubernetes IANA_SVC_NAME): 1-15 lower-case letters, digits and '-', at
least one letter, no '-' at either end."""


def _port_number(value: Any) -> Any:
    """``"8080"``/``8080`` → 8080; ``None``/``""`` → 0 (any); names are refused."""
    if value is None or value == "":
        return 0
    if isinstance(value, bool):
        raise ValueError("port must be a number or a numeric string")
    if isinstance(value, str):
        if not value.isdigit():
            raise ValueError(f"named port {value!r} not supported by Cilia (use a number)")
        return int(value)
    return value


def _port_or_name(value: Any) -> Any:
    """Like ``_port_number``, but a Kubernetes port name (``"http"``) stays a string."""
    if isinstance(value, str) and value and not value.isdigit():
        if len(value) > 15 or not _PORT_NAME.match(value):
            raise ValueError(
                f"{value!r} is neither a port number nor a port name (1-15 lower-case "
                "letters, digits and '-', with a letter)"
            )
        return value
    number = _port_number(value)
    if isinstance(number, int) and not 0 <= number <= 65535:
        raise ValueError("port must be 0..65535")
    return number


Port = Annotated[int, BeforeValidator(_port_number), Field(ge=0, le=65535)]
PortOrName = Annotated[int | str, BeforeValidator(_port_or_name)]
"""A port number (0 = any) or a named port, resolved on each selected pod from its
container ports (upstream; ingress only here: an egress named port needs every peer pod's
ports)."""


class PortProtocol(_Model):
    """``{port: "8080"|8080 (0/absent = any), endPort (range end, inclusive), protocol:
    TCP|UDP|SCTP|ANY (default ANY)}``. ``endPort`` needs a port and is ≥ it (upstream
    ``api.PortProtocol``)."""

    port: PortOrName = 0
    end_port: int | None = Field(default=None, ge=0, le=65535)
    protocol: Literal["TCP", "UDP", "SCTP", "ANY"] = "ANY"

    @model_validator(mode="after")
    def _range(self) -> Self:
        _check_range(self.port, self.end_port)
        return self


def _check_range(port: int | str, end_port: int | None) -> None:
    if end_port is None or end_port == 0:
        return
    if isinstance(port, str):
        raise ValueError("endPort needs a numeric port, not the named port " + repr(port))
    if port == 0:
        raise ValueError("endPort needs a port (the start of the range)")
    if end_port < port:
        raise ValueError(f"endPort {end_port} is below port {port}")


class PortRule(_Model):
    """``toPorts[]`` item: ``{ports: [...]}`` (L7 ``rules`` are not supported)."""

    _unsupported = ("rules", "serverNames", "listener", "originatingTLS", "terminatingTLS")
    ports: list[PortProtocol] | None = None


ICMP_TYPE_NAMES: Mapping[str, int] = {
    "EchoReply": 0,
    "DestinationUnreachable": 3,
    "Redirect": 5,
    "Echo": 8,
    "EchoRequest": 8,
    "RouterAdvertisement": 9,
    "RouterSelection": 10,
    "TimeExceeded": 11,
    "ParameterProblem": 12,
    "Timestamp": 13,
    "TimestampReply": 14,
    "Photuris": 40,
    "ExtendedEchoRequest": 42,
    "ExtendedEchoReply": 43,
}
"""Upstream's IPv4 ICMP type names (``api.ICMPField.Type`` accepts a number or a name)."""


def _icmp_type(value: Any) -> Any:
    if isinstance(value, str) and not value.isdigit():
        if value not in ICMP_TYPE_NAMES:
            raise ValueError(f"unknown ICMP type name {value!r} (known: {sorted(ICMP_TYPE_NAMES)})")
        return ICMP_TYPE_NAMES[value]
    if isinstance(value, bool):
        raise ValueError("ICMP type must be a number 0..255 or a type name")
    return int(value) if isinstance(value, str) else value


class ICMPField(_Model):
    """``icmps[].fields[]`` item: ``{family: IPv4 (IPv6 is not supported: the datapath is
    IPv4-only), type: 0..255 or an upstream type name}``."""

    family: Literal["IPv4"] = "IPv4"
    type: Annotated[int, BeforeValidator(_icmp_type), Field(ge=0, le=255)]


class ICMPRule(_Model):
    """``icmps[]`` item: ``{fields: [...]}``."""

    fields: list[ICMPField] = Field(min_length=1)


# ----------------------------------------------------------------------------- CIDRs


def _ipv4_cidr(value: Any) -> Any:
    """``"10.1.2.3/8"`` → ``"10.0.0.0/8"`` (host bits cleared, as upstream masks the
    prefix); a bare address is a ``/32``. IPv6 and anything else are refused (a
    ``ValueError``: pydantic reports it with the field's path)."""
    if not isinstance(value, str):
        raise ValueError("CIDR must be a string such as 10.0.0.0/8")
    try:
        net = ipaddress.ip_network(value.strip(), strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not a valid CIDR (expected a.b.c.d/n)") from None
    if net.version != 4:
        raise ValueError(f"IPv6 CIDR {value!r} not supported by Cilia: the datapath is IPv4-only")
    return str(net)


CIDR = Annotated[str, BeforeValidator(_ipv4_cidr)]
"""An IPv4 prefix in canonical ``a.b.c.d/n`` form (see ``_ipv4_cidr``)."""


class _CIDRBlock(_Model):
    """``cidr`` plus ``except`` prefixes that must each lie strictly inside ``cidr`` (upstream
    ``api.CIDRRule``: "these CIDR prefixes should be contained within Cidr"; Kubernetes
    refuses an ``ipBlock.except`` that is not a strict subset of its ``cidr``: one equal to
    it would select nothing)."""

    cidr: CIDR
    except_: list[CIDR] | None = Field(default=None, alias="except")

    @field_validator("except_")
    @classmethod
    def _inside_cidr(cls, value: list[str] | None, info: ValidationInfo) -> list[str] | None:
        outer = info.data.get("cidr")
        if outer is None or not value:
            return value
        net = ipaddress.IPv4Network(outer)
        for i, inner in enumerate(value):
            sub = ipaddress.IPv4Network(inner)
            if not sub.subnet_of(net) or sub == net:
                raise PydanticCustomError(
                    _ITEM,
                    "{message}",
                    {"index": i, "message": f"{inner} is not strictly inside cidr {outer}"},
                )
        return value

    @property
    def excepts(self) -> tuple[str, ...]:
        """The ``except`` prefixes (canonical, in manifest order)."""
        return tuple(self.except_ or ())


class CIDRRule(_CIDRBlock):
    """``toCIDRSet[]``/``fromCIDRSet[]`` item: ``{cidr, except: [...]}``; CIDR groups
    (``cidrGroupRef``, ``cidrGroupSelector``) are not supported."""

    _unsupported = ("cidrGroupRef", "cidrGroupSelector")


class IPBlock(_CIDRBlock):
    """NetworkPolicy ``ipBlock``: ``{cidr, except: [...]}``."""


# ----------------------------------------------------------------------------- CNP


class IngressRule(_Model):
    """``ingress[]``/``ingressDeny[]`` item: peers (``fromEndpoints``, ``fromEntities``,
    ``fromCIDR``, ``fromCIDRSet``) and ports.

    No peer field but ``toPorts`` = any peer on those ports; neither = allows nothing
    (still turns on default-deny for the direction). Peer fields add up (union).
    """

    _unsupported = (
        "fromNodes",
        "fromRequires",
        "fromGroups",
        "authentication",
    )
    from_endpoints: list[LabelSelector] | None = None
    from_entities: list[Entity] | None = None
    from_cidr: list[CIDR] | None = Field(default=None, alias="fromCIDR")
    from_cidr_set: list[CIDRRule] | None = Field(default=None, alias="fromCIDRSet")
    to_ports: list[PortRule] | None = None
    icmps: list[ICMPRule] | None = None

    @model_validator(mode="after")
    def _ports_or_icmps(self) -> Self:
        _one_l4(self.to_ports, self.icmps)
        return self


class EgressRule(_Model):
    """``egress[]``/``egressDeny[]`` item: peers (``toEndpoints``, ``toEntities``,
    ``toCIDR``, ``toCIDRSet``) and ports."""

    _unsupported = (
        "toFQDNs",
        "toServices",
        "toNodes",
        "toRequires",
        "toGroups",
        "authentication",
    )
    to_endpoints: list[LabelSelector] | None = None
    to_entities: list[Entity] | None = None
    to_cidr: list[CIDR] | None = Field(default=None, alias="toCIDR")
    to_cidr_set: list[CIDRRule] | None = Field(default=None, alias="toCIDRSet")
    to_ports: list[PortRule] | None = None
    icmps: list[ICMPRule] | None = None

    @model_validator(mode="after")
    def _ports_or_icmps(self) -> Self:
        _one_l4(self.to_ports, self.icmps)
        _no_named_ports([p for r in self.to_ports or () for p in r.ports or ()])
        return self


def _one_l4(to_ports: Sequence[PortRule] | None, icmps: Sequence[ICMPRule] | None) -> None:
    """Upstream refuses a rule with both ``toPorts`` and ``icmps``."""
    if to_ports and icmps:
        raise ValueError("toPorts and icmps cannot be used in the same rule")


_EGRESS_NAMED = (
    "named port {name!r} in an egress rule not supported by Cilia (it would need the "
    "container ports of every peer pod; use a number)"
)


def _no_named_ports(ports: Sequence[PortProtocol | NetworkPolicyPort]) -> None:
    for p in ports:
        if isinstance(p.port, str):
            raise ValueError(_EGRESS_NAMED.format(name=p.port))


class DefaultDeny(_Model):
    """``enableDefaultDeny{ingress, egress}``; absent = true for directions with rules."""

    ingress: bool | None = None
    egress: bool | None = None


class RuleLabel(_Model):
    """Informational rule label (``labels[]`` of a rule)."""

    key: str
    value: str = ""
    source: str = ""


class Rule(_Model):
    """One CNP rule: ``endpointSelector`` plus per-direction allow/deny rules."""

    _unsupported = ("nodeSelector",)
    endpoint_selector: LabelSelector
    ingress: list[IngressRule] | None = None
    ingress_deny: list[IngressRule] | None = None
    egress: list[EgressRule] | None = None
    egress_deny: list[EgressRule] | None = None
    enable_default_deny: DefaultDeny | None = None
    description: str | None = None
    labels: list[RuleLabel] | None = None


class ObjectMeta(BaseModel):
    """Kubernetes metadata: ``name`` required, ``namespace`` optional; other fields kept."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(min_length=1)
    namespace: str | None = None


class _CiliumPolicy(_Model):
    """What CiliumNetworkPolicy and CiliumClusterwideNetworkPolicy share (upstream: the
    same Rule type): ``metadata``, ``spec`` and/or ``specs[]``, ``status``."""

    api_version: Literal["cilium.io/v2"]
    metadata: ObjectMeta
    spec: Rule | None = None
    specs: list[Rule] | None = None
    status: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _has_rules(self) -> Self:
        if self.spec is None and not self.specs:
            raise ValueError("spec or specs must be set")
        return self

    @property
    def rules(self) -> list[Rule]:
        """``spec`` followed by ``specs[]``."""
        return ([self.spec] if self.spec is not None else []) + list(self.specs or [])


class CiliumNetworkPolicy(_CiliumPolicy):
    """CiliumNetworkPolicy ``cilium.io/v2`` (namespaced): ``spec`` and/or ``specs[]``."""

    kind: Literal["CiliumNetworkPolicy"]


class CiliumClusterwideNetworkPolicy(_CiliumPolicy):
    """CiliumClusterwideNetworkPolicy ``cilium.io/v2`` (cluster-scoped): a CNP's rules,
    selecting endpoints (and peers) of every namespace. Upstream's host-policy
    ``nodeSelector`` is not supported (refused as an unknown field)."""

    kind: Literal["CiliumClusterwideNetworkPolicy"]

    @model_validator(mode="after")
    def _no_namespace(self) -> Self:
        if self.metadata.namespace:
            raise ValueError("a CiliumClusterwideNetworkPolicy has no namespace")
        return self


# ----------------------------------------------------------------------------- k8s NP


class NetworkPolicyPort(_Model):
    """``ports[]``: ``{protocol: TCP|UDP|SCTP (default TCP), port (absent = all), endPort
    (range end, inclusive; needs a numeric port ≤ it)}``."""

    protocol: Literal["TCP", "UDP", "SCTP"] = "TCP"
    port: PortOrName = 0
    end_port: int | None = Field(default=None, ge=0, le=65535)

    @model_validator(mode="after")
    def _range(self) -> Self:
        _check_range(self.port, self.end_port)
        return self


class NetworkPolicyPeer(_Model):
    """``from[]``/``to[]``: ``podSelector`` and/or ``namespaceSelector``, or ``ipBlock``
    alone (Kubernetes refuses ``ipBlock`` next to a selector)."""

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None

    @model_validator(mode="after")
    def _one_selector(self) -> NetworkPolicyPeer:
        selectors = self.pod_selector is not None or self.namespace_selector is not None
        if self.ip_block is not None and selectors:
            raise ValueError("ipBlock cannot be combined with podSelector or namespaceSelector")
        if self.ip_block is None and not selectors:
            raise ValueError("a peer needs podSelector and/or namespaceSelector, or ipBlock")
        return self


class NetworkPolicyIngressRule(_Model):
    """``ingress[]``: absent/empty ``from`` = every source; absent/empty ``ports`` = every port."""

    from_: list[NetworkPolicyPeer] | None = Field(default=None, alias="from")
    ports: list[NetworkPolicyPort] | None = None


class NetworkPolicyEgressRule(_Model):
    """``egress[]``: absent/empty ``to`` = every destination; named ports are refused."""

    to: list[NetworkPolicyPeer] | None = None
    ports: list[NetworkPolicyPort] | None = None

    @model_validator(mode="after")
    def _numbers_only(self) -> Self:
        _no_named_ports(self.ports or [])
        return self


class NetworkPolicySpec(_Model):
    """``spec``: ``podSelector``, ``policyTypes``, ``ingress``, ``egress``."""

    pod_selector: LabelSelector
    policy_types: list[Literal["Ingress", "Egress"]] | None = None
    ingress: list[NetworkPolicyIngressRule] | None = None
    egress: list[NetworkPolicyEgressRule] | None = None

    @property
    def effective_policy_types(self) -> frozenset[str]:
        """``policyTypes``, or Kubernetes' default: Ingress, plus Egress when ``egress`` is set."""
        if self.policy_types is not None:
            return frozenset(self.policy_types)
        return frozenset({"Ingress"} | ({"Egress"} if self.egress is not None else set()))


class NetworkPolicy(_Model):
    """Kubernetes NetworkPolicy ``networking.k8s.io/v1``."""

    api_version: Literal["networking.k8s.io/v1"]
    kind: Literal["NetworkPolicy"]
    metadata: ObjectMeta
    spec: NetworkPolicySpec
    status: dict[str, Any] | None = None


Policy = CiliumNetworkPolicy | CiliumClusterwideNetworkPolicy | NetworkPolicy
POLICY_KINDS: Mapping[
    str,
    type[CiliumNetworkPolicy] | type[CiliumClusterwideNetworkPolicy] | type[NetworkPolicy],
] = {
    CNP_KIND: CiliumNetworkPolicy,
    CCNP_KIND: CiliumClusterwideNetworkPolicy,
    NP_KIND: NetworkPolicy,
}


def policy_namespace(policy: Policy) -> str:
    """The policy's namespace (``default`` when the manifest names none; "" for a
    cluster-wide policy)."""
    if isinstance(policy, CiliumClusterwideNetworkPolicy):
        return ""
    return policy.metadata.namespace or DEFAULT_NAMESPACE


def parse_policy(manifest: Mapping[str, Any] | str | bytes) -> Policy:
    """Validate a manifest (a mapping, or its JSON text) into a policy model.

    The kind picks the model: ``CiliumNetworkPolicy``, ``CiliumClusterwideNetworkPolicy``
    or ``NetworkPolicy``.

    Raises:
        InvalidPolicy: not JSON / not an object, unknown kind, or any field error; every
            error carries its path, e.g. ``spec.ingress[0].fromEndpoints[0].matchLabel:
            unknown field``.
    """
    if isinstance(manifest, str | bytes):
        try:
            manifest = json.loads(manifest)
        except ValueError as exc:
            raise InvalidPolicy("", "", "", [FieldError("", f"not valid JSON: {exc}")]) from exc
    if not isinstance(manifest, Mapping):
        raise InvalidPolicy("", "", "", [FieldError("", "manifest must be a JSON object")])
    kind = manifest.get("kind")
    meta = manifest.get("metadata")
    name = str(meta.get("name", "")) if isinstance(meta, Mapping) else ""
    namespace = str(meta.get("namespace") or DEFAULT_NAMESPACE) if isinstance(meta, Mapping) else ""
    model = POLICY_KINDS.get(kind) if isinstance(kind, str) else None
    if model is None or not isinstance(kind, str):
        raise InvalidPolicy(
            str(kind or ""),
            namespace,
            name,
            [FieldError("kind", f"must be one of {sorted(POLICY_KINDS)}, got {kind!r}")],
        )
    try:
        return model.model_validate(manifest)
    except ValidationError as exc:
        errors = [e for err in exc.errors() for e in _field_errors(err)]
        raise InvalidPolicy(kind, namespace, name, errors) from exc


def _field_errors(err: ErrorDetails) -> list[FieldError]:
    loc = list(err["loc"])
    if err["type"] == _UNSUPPORTED:
        fields = str((err.get("ctx") or {}).get("fields", "")).split(",")
        return [FieldError(_format_loc([*loc, f]), "not supported by Cilia") for f in fields]
    if err["type"] == _ITEM:
        ctx = err.get("ctx") or {}
        return [FieldError(_format_loc([*loc, int(ctx["index"])]), str(ctx["message"]))]
    message = _MESSAGES.get(err["type"], err["msg"].removeprefix("Value error, "))
    return [FieldError(_format_loc(loc), message)]
