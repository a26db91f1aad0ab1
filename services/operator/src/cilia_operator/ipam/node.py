"""CiliumNode (cilium.io/v2) records: the fields the operator reads and writes.

Shape (upstream ``pkg/ipam/types/types.go``, reference: cilium-upstream.md §1 and the
team brief)::

    spec.addresses[{type: InternalIP, ip}]
    spec.ipam.pools.requested[{pool, needed: {ipv4-addrs}}]     (agent-owned)
    spec.ipam.pools.allocated[{pool, cidrs}]                    (operator adds, agent removes)
    status.ipam.operator-status.error
    status.localNetworks[{interface, cidr}]                      (Cilia extension)

Functions here are pure: they read or return copies of plain dicts.
"""

from __future__ import annotations

import copy
import ipaddress
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from ..errors import from_pydantic
from .pool import ObjectMeta, _cidr4

API_VERSION = "cilium.io/v2"
KIND = "CiliumNode"

log = logging.getLogger(__name__)


def _ip(value: str) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ValueError(f"{value!r} is not an IP address") from None


def _cidr(value: str) -> str:
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        raise ValueError(f"{value!r} is not a CIDR") from None


class _NodeAddress(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    ip: Annotated[str, AfterValidator(_ip)]


class _Needed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    ipv4_addrs: int = Field(default=0, ge=0, alias="ipv4-addrs")
    ipv6_addrs: int = Field(default=0, ge=0, alias="ipv6-addrs")


class _Requested(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pool: str
    needed: _Needed


class _Allocated(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pool: str
    cidrs: list[Annotated[str, AfterValidator(_cidr4)]]


class _Pools(BaseModel):
    model_config = ConfigDict(extra="allow")
    requested: list[_Requested] | None = None
    allocated: list[_Allocated] | None = None


class _IPAM(BaseModel):
    model_config = ConfigDict(extra="allow")
    pools: _Pools | None = None
    podCIDRs: list[Annotated[str, AfterValidator(_cidr4)]] | None = None  # noqa: N815


class _Spec(BaseModel):
    model_config = ConfigDict(extra="allow")
    addresses: list[_NodeAddress] | None = None
    ipam: _IPAM | None = None


class _LocalNetwork(BaseModel):
    model_config = ConfigDict(extra="forbid")
    interface: str
    cidr: Annotated[str, AfterValidator(_cidr)]


class _Status(BaseModel):
    model_config = ConfigDict(extra="allow")
    localNetworks: list[_LocalNetwork] | None = None  # noqa: N815


class CiliumNodeModel(BaseModel):
    """Schema of the CiliumNode fields Cilia uses (others are kept as given)."""

    model_config = ConfigDict(extra="forbid")
    apiVersion: Literal["cilium.io/v2"]  # noqa: N815
    kind: Literal["CiliumNode"]
    metadata: ObjectMeta
    spec: _Spec = _Spec()
    status: _Status | None = None


def validate_node(doc: Mapping[str, Any]) -> CiliumNodeModel:
    """Validate a CiliumNode manifest.

    Raises:
        InvalidResource: with field paths (``spec.ipam.pools.allocated[0].cidrs[1]: ...``).
    """
    try:
        return CiliumNodeModel.model_validate(dict(doc))
    except ValidationError as exc:
        raise from_pydantic(exc) from None


def new_node(name: str) -> dict[str, Any]:
    """An empty CiliumNode record named ``name``."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": {"addresses": [], "ipam": {"pools": {}}},
        "status": {},
    }


def _pools(node: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((node.get("spec") or {}).get("ipam") or {}).get("pools") or {}


def requested(node: Mapping[str, Any]) -> dict[str, int]:
    """``spec.ipam.pools.requested`` as ``{pool: ipv4 addresses needed}``."""
    out: dict[str, int] = {}
    for entry in _pools(node).get("requested") or []:
        needed = (entry.get("needed") or {}).get("ipv4-addrs") or 0
        out[str(entry.get("pool"))] = int(needed)
    return out


def allocated(node: Mapping[str, Any]) -> dict[str, list[ipaddress.IPv4Network]]:
    """``spec.ipam.pools.allocated`` as ``{pool: [IPv4 blocks]}``; IPv6 and malformed
    entries are skipped (and logged)."""
    out: dict[str, list[ipaddress.IPv4Network]] = {}
    for entry in _pools(node).get("allocated") or []:
        pool = str(entry.get("pool"))
        for cidr in entry.get("cidrs") or []:
            try:
                net = ipaddress.ip_network(cidr, strict=True)
            except ValueError:
                log.warning("ignoring malformed CIDR in node record", extra={"cidr": cidr})
                continue
            if isinstance(net, ipaddress.IPv4Network):
                out.setdefault(pool, []).append(net)
    return out


def allocated_json(alloc: Mapping[str, Sequence[ipaddress.IPv4Network]]) -> list[dict[str, Any]]:
    """Render an allocation as ``spec.ipam.pools.allocated`` (sorted by pool, then CIDR)."""
    return [
        {"pool": pool, "cidrs": [str(b) for b in sorted(blocks)]}
        for pool, blocks in sorted(alloc.items())
        if blocks
    ]


def operator_error(node: Mapping[str, Any]) -> str:
    """``status.ipam.operator-status.error`` ("" when none)."""
    status = ((node.get("status") or {}).get("ipam") or {}).get("operator-status") or {}
    return str(status.get("error") or "")


def with_allocation(
    node: Mapping[str, Any],
    alloc: Mapping[str, Sequence[ipaddress.IPv4Network]],
    error: str,
) -> dict[str, Any]:
    """A copy of ``node`` with ``spec.ipam.pools.allocated`` and the operator error set."""
    out = copy.deepcopy(dict(node))
    pools = out.setdefault("spec", {}).setdefault("ipam", {}).setdefault("pools", {})
    pools["allocated"] = allocated_json(alloc)
    status = out.setdefault("status", {})
    if error:
        status.setdefault("ipam", {})["operator-status"] = {"error": error}
    elif "operator-status" in status.get("ipam", {}):
        del status["ipam"]["operator-status"]
    return out


def with_demand(
    node: Mapping[str, Any],
    demands: Mapping[str, int],
    released: Iterable[tuple[str, ipaddress.IPv4Network]],
) -> dict[str, Any]:
    """A copy of ``node`` with ``requested`` replaced and ``released`` blocks removed from
    ``allocated`` (the agent removes what it gives back)."""
    out = copy.deepcopy(dict(node))
    pools = out.setdefault("spec", {}).setdefault("ipam", {}).setdefault("pools", {})
    pools["requested"] = [
        {"pool": pool, "needed": {"ipv4-addrs": n}} for pool, n in sorted(demands.items())
    ]
    gone = set(released)
    current = allocated(out)
    kept = {pool: [b for b in blocks if (pool, b) not in gone] for pool, blocks in current.items()}
    pools["allocated"] = allocated_json(kept)
    return out


def pools_in_use(nodes: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """``{pool: [node names]}`` for every pool some node holds CIDRs of."""
    out: dict[str, list[str]] = {}
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name"))
        for pool, blocks in allocated(node).items():
            if blocks:
                out.setdefault(pool, []).append(name)
    return out


def pod_cidrs(node: Mapping[str, Any]) -> list[ipaddress.IPv4Network]:
    """``spec.ipam.podCIDRs`` (cluster-pool mode) as IPv4 blocks; others skipped."""
    out = []
    for cidr in ((node.get("spec") or {}).get("ipam") or {}).get("podCIDRs") or []:
        try:
            net = ipaddress.ip_network(cidr, strict=True)
        except ValueError:
            log.warning("ignoring malformed podCIDR in node record", extra={"cidr": cidr})
            continue
        if isinstance(net, ipaddress.IPv4Network):
            out.append(net)
    return out


def with_pod_cidrs(
    node: Mapping[str, Any], cidrs: Sequence[ipaddress.IPv4Network], error: str
) -> dict[str, Any]:
    """A copy of ``node`` with ``spec.ipam.podCIDRs`` and the operator error set."""
    out = with_allocation(node, allocated(node), error)
    ipam = out["spec"]["ipam"]
    if cidrs:
        ipam["podCIDRs"] = [str(c) for c in sorted(cidrs)]
    else:
        ipam.pop("podCIDRs", None)
    return out


def migrated(node: Mapping[str, Any], pool: str) -> dict[str, Any]:
    """A copy of ``node`` with its podCIDRs moved into ``pools.allocated`` under ``pool``
    (cluster-pool -> multi-pool migration; upstream job ``from-cluster-pool-migration``)."""
    alloc = allocated(node)
    blocks = alloc.setdefault(pool, [])
    blocks.extend(b for b in pod_cidrs(node) if b not in blocks)
    out = with_allocation(node, alloc, operator_error(node))
    out["spec"]["ipam"].pop("podCIDRs", None)
    return out


def local_networks(node: Mapping[str, Any]) -> list[tuple[str, ipaddress.IPv4Network]]:
    """``status.localNetworks`` as ``(interface, subnet)`` (IPv4 only)."""
    out = []
    for entry in (node.get("status") or {}).get("localNetworks") or []:
        try:
            net = ipaddress.ip_network(str(entry.get("cidr")), strict=False)
        except ValueError:
            continue
        if isinstance(net, ipaddress.IPv4Network):
            out.append((str(entry.get("interface") or ""), net))
    return out


def node_name(node: Mapping[str, Any]) -> str:
    """``metadata.name``."""
    return str((node.get("metadata") or {}).get("name") or "")
