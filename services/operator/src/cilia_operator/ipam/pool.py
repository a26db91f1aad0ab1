"""CiliumPodIPPool (cilium.io/v2alpha1): schema, validation and the allocator's view.

Source: upstream ``pkg/k8s/apis/cilium.io/v2alpha1/ippool_types.go`` (reference:
cilium-upstream.md §1): ``spec.ipv4|ipv6.cidrs`` (minItems 1), ``maskSize`` (v4 1..32,
v6 1..128, immutable), ``allowFirstIP``/``allowLastIP`` (default false, immutable),
``podSelector``/``namespaceSelector``. Cilia allocates IPv4 only; ``spec.ipv6`` is
validated and stored but not carved yet.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from ..addresses import special_ranges
from ..errors import FieldError, InvalidResource, from_pydantic

API_VERSION = "cilium.io/v2alpha1"
KIND = "CiliumPodIPPool"

_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)


def _name(value: str) -> str:
    if len(value) > 253 or not _DNS1123_SUBDOMAIN.match(value):
        raise ValueError(
            f"{value!r} is not a valid name: lower-case letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, at most 253 characters"
        )
    return value


def _cidr4(value: str) -> str:
    try:
        return str(ipaddress.IPv4Network(value, strict=True))
    except ValueError as exc:
        raise ValueError(f"{value!r} is not an IPv4 CIDR: {exc}") from None


def _cidr6(value: str) -> str:
    try:
        return str(ipaddress.IPv6Network(value, strict=True))
    except ValueError as exc:
        raise ValueError(f"{value!r} is not an IPv6 CIDR: {exc}") from None


class ObjectMeta(BaseModel):
    """Kubernetes ObjectMeta subset; unknown metadata fields are kept."""

    model_config = ConfigDict(extra="allow")
    name: Annotated[str, AfterValidator(_name)]
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class LabelSelector(BaseModel):
    """Kubernetes LabelSelector."""

    model_config = ConfigDict(extra="forbid")
    matchLabels: dict[str, str] | None = None  # noqa: N815 (Kubernetes field name)
    matchExpressions: list[dict[str, Any]] | None = None  # noqa: N815


class IPv4Spec(BaseModel):
    """``spec.ipv4``: CIDRs carved into per-node blocks of ``maskSize``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    cidrs: list[Annotated[str, AfterValidator(_cidr4)]] = Field(min_length=1)
    maskSize: int = Field(ge=1, le=32)  # noqa: N815


class IPv6Spec(BaseModel):
    """``spec.ipv6`` (validated and stored; not allocated by Cilia yet)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    cidrs: list[Annotated[str, AfterValidator(_cidr6)]] = Field(min_length=1)
    maskSize: int = Field(ge=1, le=128)  # noqa: N815


class PoolSpecModel(BaseModel):
    """``spec`` of a CiliumPodIPPool."""

    model_config = ConfigDict(extra="forbid", strict=True)
    ipv4: IPv4Spec | None = None
    ipv6: IPv6Spec | None = None
    allowFirstIP: bool = False  # noqa: N815
    allowLastIP: bool = False  # noqa: N815
    podSelector: LabelSelector | None = None  # noqa: N815
    namespaceSelector: LabelSelector | None = None  # noqa: N815


class CiliumPodIPPool(BaseModel):
    """A whole CiliumPodIPPool manifest (``status`` is accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")
    apiVersion: Literal["cilium.io/v2alpha1"]  # noqa: N815
    kind: Literal["CiliumPodIPPool"]
    metadata: ObjectMeta
    spec: PoolSpecModel
    status: dict[str, Any] | None = None


@dataclass(frozen=True)
class PoolSpec:
    """What the allocator needs to know about one pool (IPv4).

    Attributes:
        name: pool name.
        cidrs: the pool's CIDRs, in manifest order.
        mask_size: prefix length of each per-node block (1..32, >= every CIDR's prefix).
        allow_first_ip / allow_last_ip: whether a block's first/last address is usable.
        draining: CIDRs removed from the pool while nodes still held blocks in them
            (``status.drainingCIDRs``): nothing new is carved from them; they are
            dropped once no block inside is held.
    """

    name: str
    cidrs: tuple[ipaddress.IPv4Network, ...]
    mask_size: int
    allow_first_ip: bool = False
    allow_last_ip: bool = False
    draining: tuple[ipaddress.IPv4Network, ...] = ()

    def contains(self, block: ipaddress.IPv4Network) -> bool:
        """Whether ``block`` lies inside one of the pool's live CIDRs."""
        return any(block.subnet_of(c) for c in self.cidrs)

    def draining_cidr(self, block: ipaddress.IPv4Network) -> ipaddress.IPv4Network | None:
        """The draining CIDR ``block`` lies in, if any."""
        return next((c for c in self.draining if block.subnet_of(c)), None)

    def blocks_total(self) -> int:
        """Blocks of ``mask_size`` the live CIDRs hold."""
        return sum(1 << (self.mask_size - c.prefixlen) for c in self.cidrs)

    def usable(self, block: ipaddress.IPv4Network) -> int:
        """Usable pod addresses in ``block``: 2^hostbits, minus the first and last address
        unless allowed; /31 and /32 keep every address (upstream rule;
        :func:`usable_per_block`)."""
        return usable_per_block(block.prefixlen, self.allow_first_ip, self.allow_last_ip)


ROUTER_IPS_PER_NODE = 1
"""Addresses the agent keeps out of a node's first block: its router IP (the cilia_host
address and the pods' gateway) is the first usable address of that block
(services/agent app.py ``_choose_router_ip``)."""


def usable_per_block(mask_size: int, allow_first: bool, allow_last: bool) -> int:
    """Usable addresses of one block of ``/mask_size`` (1..32): 2^(32 - mask_size), minus
    the first and last address unless allowed; /31 and /32 keep every address (as upstream
    counts them, reference: cilium-upstream.md §1)."""
    size = 1 << (32 - mask_size)
    if size <= 2:
        return size
    return size - (0 if allow_first else 1) - (0 if allow_last else 1)


def pods_per_node(mask_size: int, allow_first: bool, allow_last: bool) -> int:
    """Pod addresses of a node holding one block of ``/mask_size``: the block's usable
    addresses (:func:`usable_per_block`) minus the agent's router IP
    (:data:`ROUTER_IPS_PER_NODE`); 0 when nothing is left for pods. Used by
    ``cilia-operator ipam plan``, ``apply`` (validation and dry run) and
    ``--cluster-pool-ipv4-mask-size``."""
    return max(0, usable_per_block(mask_size, allow_first, allow_last) - ROUTER_IPS_PER_NODE)


def no_pod_address(mask_size: int, allow_first: bool, allow_last: bool) -> str | None:
    """Why a block of ``/mask_size`` (1..32) with these flags leaves no pod address, or
    None when it leaves at least one (usable addresses >= router IP + 1 pod).

    E.g. ``a /32 block has 1 usable address and the agent takes it as its router IP: no
    pod address left (use a mask of at most 31)``.
    """
    if pods_per_node(mask_size, allow_first, allow_last) >= 1:
        return None
    usable = usable_per_block(mask_size, allow_first, allow_last)
    longest = next(m for m in range(32, 0, -1) if pods_per_node(m, allow_first, allow_last))
    return (
        f"a /{mask_size} block has {usable} usable address{'es' if usable != 1 else ''} "
        "and the agent takes the first as its router IP: no pod address left (use a mask "
        f"of at most {longest})"
    )


DEFAULT_POOL = "default"
"""Upstream's ``ipam-default-ip-pool`` default: the pool the agent takes its router IP
from."""


def validate_pool(
    doc: Mapping[str, Any], *, stored: bool = False, default_pool: str = DEFAULT_POOL
) -> CiliumPodIPPool:
    """Validate a CiliumPodIPPool manifest (schema and semantics). IPv4 CIDRs in the
    "this network" (0/8), loopback, link-local, multicast or reserved (240/4) ranges
    are refused, and so is a new pool without ``spec.ipv4`` (an ``ipv6``-only pool: IPv6
    is validated and stored but not carved yet). For the default pool only, so is an IPv4
    ``maskSize`` whose block
    leaves no pod address once the agent took its router IP (:func:`no_pod_address`; in
    practice /32: a /31 keeps both addresses, a /30 has 2 even without
    allowFirstIP/allowLastIP). Other pools may use ``maskSize: 32``: single-address
    blocks, no network/broadcast exclusion, one per pod (the router IP comes from the
    default pool; upstream made /32 and /128 blocks usable for non-default pools).

    Args:
        doc: the manifest.
        stored: the pool is already in the store (loaded by the controller): the
            no-pod-address check is skipped so a pool accepted before it keeps working.
        default_pool: name of the default pool (``--ipam-default-ip-pool``).

    Raises:
        InvalidResource: every problem found, each with its field path, e.g.
            ``spec.ipv4.maskSize: 8 is shorter than the prefix of 10.0.0.0/16``.
    """
    try:
        pool = CiliumPodIPPool.model_validate(dict(doc))
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    errors: list[FieldError] = []
    for family, spec in (("ipv4", pool.spec.ipv4), ("ipv6", pool.spec.ipv6)):
        if spec is None:
            continue
        nets = [ipaddress.ip_network(c) for c in spec.cidrs]
        for i, net in enumerate(nets):
            hits = special_ranges(net) if isinstance(net, ipaddress.IPv4Network) else []
            for name, special in hits:
                errors.append(
                    FieldError(
                        f"spec.{family}.cidrs[{i}]",
                        f"{net} overlaps the {name} range {special}: not usable for pods",
                    )
                )
            if spec.maskSize < net.prefixlen:
                errors.append(
                    FieldError(
                        f"spec.{family}.maskSize",
                        f"{spec.maskSize} is shorter than the prefix of cidrs[{i}] {net} "
                        f"(must be >= {net.prefixlen})",
                    )
                )
            for j in range(i):
                if nets[j].overlaps(net):
                    errors.append(
                        FieldError(
                            f"spec.{family}.cidrs[{i}]",
                            f"{net} overlaps cidrs[{j}] {nets[j]} of the same pool",
                        )
                    )
    v4 = pool.spec.ipv4
    if v4 is None and not stored:
        errors.append(
            FieldError(
                "spec.ipv4",
                "required: Cilia carves IPv4 blocks only; a pool with only an ipv6 section "
                "(IPv6 pools are not carved yet) would hand out no address"
                if pool.spec.ipv6 is not None
                else "required: the pool has no CIDRs to hand out",
            )
        )
    if v4 is not None and not stored and pool.metadata.name == default_pool:
        why = no_pod_address(v4.maskSize, pool.spec.allowFirstIP, pool.spec.allowLastIP)
        if why:
            errors.append(FieldError("spec.ipv4.maskSize", f"{v4.maskSize}: {why}"))
    if errors:
        raise InvalidResource(errors)
    return pool


def to_pool_spec(pool: CiliumPodIPPool) -> PoolSpec:
    """The allocator's view of a validated pool (IPv4 only; no ipv4 → no CIDRs)."""
    v4 = pool.spec.ipv4
    return PoolSpec(
        name=pool.metadata.name,
        cidrs=tuple(ipaddress.IPv4Network(c) for c in v4.cidrs) if v4 else (),
        mask_size=v4.maskSize if v4 else 32,
        allow_first_ip=pool.spec.allowFirstIP,
        allow_last_ip=pool.spec.allowLastIP,
    )


DRAINING_FIELD = "drainingCIDRs"
"""``status.drainingCIDRs``: CIDRs removed from the pool while in use (Cilia's addition;
upstream forgets them, gh-issue 26966)."""


def draining_cidrs(obj: Mapping[str, Any]) -> tuple[ipaddress.IPv4Network, ...]:
    """``status.drainingCIDRs`` of a stored pool (malformed entries skipped)."""
    out = []
    for cidr in (obj.get("status") or {}).get(DRAINING_FIELD) or []:
        try:
            out.append(ipaddress.IPv4Network(cidr))
        except ValueError:
            continue
    return tuple(out)


def pool_spec_from_resource(obj: Mapping[str, Any]) -> PoolSpec:
    """Validate a stored CiliumPodIPPool and return its allocator view (with its draining
    CIDRs from ``status``).

    Raises:
        InvalidResource: the stored object is invalid.
    """
    doc = {k: v for k, v in obj.items() if k in ("apiVersion", "kind", "metadata", "spec")}
    spec = to_pool_spec(validate_pool(doc, stored=True))
    return dataclasses.replace(spec, draining=draining_cidrs(obj))


def pool_specs(objs: Iterable[Mapping[str, Any]]) -> dict[str, PoolSpec]:
    """The allocator views of stored CiliumPodIPPools by name; invalid ones are skipped."""
    out = {}
    for obj in objs:
        try:
            out[obj["metadata"]["name"]] = pool_spec_from_resource(obj)
        except InvalidResource:
            continue
    return out


def pool_manifest(spec: PoolSpec) -> dict[str, Any]:
    """A CiliumPodIPPool manifest for ``spec`` (used by auto-create)."""
    body: dict[str, Any] = {
        "ipv4": {"cidrs": [str(c) for c in spec.cidrs], "maskSize": spec.mask_size}
    }
    if spec.allow_first_ip:
        body["allowFirstIP"] = True
    if spec.allow_last_ip:
        body["allowLastIP"] = True
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": spec.name}, "spec": body}


def pool_overlaps(
    candidate: str, cidrs: Iterable[ipaddress.IPv4Network], others: Iterable[PoolSpec]
) -> list[FieldError]:
    """Errors for every CIDR of pool ``candidate`` that overlaps a CIDR of another pool.

    Each message names both sides: ``10.0.0.0/24 overlaps pool "default" CIDR 10.0.0.0/16``.
    Pools named ``candidate`` in ``others`` are skipped (an update of itself).
    """
    errors = []
    others = [o for o in others if o.name != candidate]
    for i, net in enumerate(cidrs):
        for other in others:
            for what, theirs in [("CIDR", c) for c in other.cidrs] + [
                ("draining CIDR", c) for c in other.draining
            ]:
                if net.overlaps(theirs):
                    errors.append(
                        FieldError(
                            f"spec.ipv4.cidrs[{i}]",
                            f"{net} overlaps pool {other.name!r} {what} {theirs}",
                        )
                    )
    return errors
