"""Parse ``--auto-create-cilium-pod-ip-pools`` in upstream syntax.

Syntax (upstream operator multipool cell, reference: cilium-upstream.md §1)::

    <pool>=ipv4-cidrs:<cidr>[,<cidr>...];ipv4-mask-size:<n>[;allow-first-ip:<bool>][;allow-last-ip:<bool>]

Several pools are separated by whitespace (as upstream map flags allow) and/or given by
repeating the flag.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvalidResource
from .pool import PoolSpec, pool_manifest, pool_overlaps, to_pool_spec, validate_pool

FLAG = "--auto-create-cilium-pod-ip-pools"
_BOOLS = {"true": True, "false": False}


class PoolFlagError(ValueError):
    """The flag value is malformed; the message names the pool and the offending part."""


def _parse_bool(pool: str, part: str, value: str) -> bool:
    try:
        return _BOOLS[value.lower()]
    except KeyError:
        raise PoolFlagError(
            f"{FLAG}: pool {pool!r}: part {part!r}: {value!r} is not a boolean (true|false)"
        ) from None


def parse_pool(entry: str) -> PoolSpec:
    """Parse one ``<pool>=<spec>`` entry.

    Raises:
        PoolFlagError: bad syntax or an invalid pool, naming the part at fault.
    """
    name, sep, body = entry.partition("=")
    if not sep or not name:
        raise PoolFlagError(f"{FLAG}: entry {entry!r}: expected <pool>=ipv4-cidrs:...")
    cidrs: list[str] | None = None
    mask: int | None = None
    first = last = False
    seen: set[str] = set()
    for part in body.split(";"):
        key, sep, value = part.partition(":")
        if not sep or not value:
            raise PoolFlagError(f"{FLAG}: pool {name!r}: part {part!r}: expected <key>:<value>")
        if key in seen:
            raise PoolFlagError(f"{FLAG}: pool {name!r}: part {part!r}: {key} given twice")
        seen.add(key)
        if key == "ipv4-cidrs":
            cidrs = value.split(",")
            if any(not c for c in cidrs):
                raise PoolFlagError(f"{FLAG}: pool {name!r}: part {part!r}: empty CIDR in list")
        elif key == "ipv4-mask-size":
            try:
                mask = int(value)
            except ValueError:
                raise PoolFlagError(
                    f"{FLAG}: pool {name!r}: part {part!r}: {value!r} is not an integer"
                ) from None
        elif key == "allow-first-ip":
            first = _parse_bool(name, part, value)
        elif key == "allow-last-ip":
            last = _parse_bool(name, part, value)
        elif key in ("ipv6-cidrs", "ipv6-mask-size"):
            raise PoolFlagError(
                f"{FLAG}: pool {name!r}: part {part!r}: IPv6 pools are not supported yet"
            )
        else:
            raise PoolFlagError(
                f"{FLAG}: pool {name!r}: part {part!r}: unknown key {key!r} (expected "
                "ipv4-cidrs, ipv4-mask-size, allow-first-ip, allow-last-ip)"
            )
    if cidrs is None or mask is None:
        missing = "ipv4-cidrs" if cidrs is None else "ipv4-mask-size"
        raise PoolFlagError(f"{FLAG}: pool {name!r}: missing {missing}")
    manifest = pool_manifest(PoolSpec(name, (), mask, first, last))
    manifest["spec"]["ipv4"]["cidrs"] = cidrs
    try:
        return to_pool_spec(validate_pool(manifest))
    except InvalidResource as exc:
        raise PoolFlagError(f"{FLAG}: pool {name!r}: {exc}") from None


def parse_auto_create_pools(values: Iterable[str]) -> dict[str, PoolSpec]:
    """Parse every flag value (each may hold several whitespace-separated pools).

    Returns pools by name, in the order given.

    Raises:
        PoolFlagError: bad syntax, an invalid pool, a pool named twice or two pools
            whose CIDRs overlap.
    """
    pools: dict[str, PoolSpec] = {}
    for value in values:
        for entry in value.split():
            spec = parse_pool(entry)
            if spec.name in pools:
                raise PoolFlagError(f"{FLAG}: pool {spec.name!r} given twice")
            pools[spec.name] = spec
    for spec in pools.values():
        overlaps = pool_overlaps(spec.name, spec.cidrs, pools.values())
        if overlaps:
            raise PoolFlagError(f"{FLAG}: pool {spec.name!r}: {overlaps[0].reason}")
    return pools
