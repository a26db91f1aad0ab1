"""The previous plugin's CNI result, as used by generic-veth chaining.

Upstream ``plugins/cilium-cni/chaining/generic-veth`` (reference: cilium-upstream.md):
when cilia runs after another plugin that created the veth and configured the
address, the agent adopts the container interface named ``CNI_IFNAME`` and its
IPv4 address from the prevResult, and passes that result through unchanged.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

from cilia_agent.endpoint.errors import InvalidRequest


@dataclass(frozen=True)
class PrevResult:
    """What chaining needs from a CNI result.

    Attributes:
        address: the IPv4 address (with prefix) of the container interface ``ifname``.
        gateway: its gateway ("" when the result names none).
        interfaces: ``[{"name", "mac", "sandbox", "mtu"}]`` as in the result.
        ips: ``[{"address", "gateway", "interface"}]`` (interface = index into interfaces,
            -1 when absent).
        routes: ``[{"dst", "gw"}]``.
    """

    address: ipaddress.IPv4Interface
    gateway: str
    interfaces: list[dict[str, Any]]
    ips: list[dict[str, Any]]
    routes: list[dict[str, str]]


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key, "")
    if not isinstance(value, str):
        raise InvalidRequest("prev_result", f"{where}.{key} must be a string")
    return value


def parse_prev_result(text: str, ifname: str) -> PrevResult:
    """Parse a CNI result (any version 0.3.0..1.1.0) and pick the address of ``ifname``.

    The address is the first IPv4 entry of ``ips`` whose ``interface`` index names an
    interface called ``ifname`` with a non-empty ``sandbox``; when no entry carries an
    interface index, the first IPv4 entry.

    Raises:
        InvalidRequest: (field ``prev_result``) not JSON, wrong shapes, or no IPv4
            address for ``ifname``.
    """
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest("prev_result", f"not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise InvalidRequest("prev_result", "must be a JSON object (a CNI result)")
    raw_ifaces = doc.get("interfaces") or []
    raw_ips = doc.get("ips") or []
    raw_routes = doc.get("routes") or []
    if not all(isinstance(x, list) for x in (raw_ifaces, raw_ips, raw_routes)):
        raise InvalidRequest("prev_result", "interfaces, ips and routes must be lists")
    interfaces: list[dict[str, Any]] = []
    for i, item in enumerate(raw_ifaces):
        if not isinstance(item, dict):
            raise InvalidRequest("prev_result", f"interfaces[{i}] must be an object")
        mtu = item.get("mtu", 0)
        interfaces.append(
            {
                "name": _str(item, "name", f"interfaces[{i}]"),
                "mac": _str(item, "mac", f"interfaces[{i}]"),
                "sandbox": _str(item, "sandbox", f"interfaces[{i}]"),
                "mtu": mtu if isinstance(mtu, int) and mtu >= 0 else 0,
            }
        )
    ips: list[dict[str, Any]] = []
    chosen: tuple[ipaddress.IPv4Interface, str] | None = None
    fallback: tuple[ipaddress.IPv4Interface, str] | None = None
    for i, item in enumerate(raw_ips):
        if not isinstance(item, dict):
            raise InvalidRequest("prev_result", f"ips[{i}] must be an object")
        address = _str(item, "address", f"ips[{i}]")
        gateway = _str(item, "gateway", f"ips[{i}]")
        index = item.get("interface", -1)
        if not isinstance(index, int) or isinstance(index, bool):
            raise InvalidRequest("prev_result", f"ips[{i}].interface must be an integer")
        try:
            parsed = ipaddress.ip_interface(address)
        except ValueError as exc:
            raise InvalidRequest("prev_result", f"ips[{i}].address {address!r}: {exc}") from exc
        ips.append({"address": address, "gateway": gateway, "interface": index})
        if not isinstance(parsed, ipaddress.IPv4Interface):
            continue
        if 0 <= index < len(interfaces):
            iface = interfaces[index]
            if chosen is None and iface["name"] == ifname and iface["sandbox"]:
                chosen = (parsed, gateway)
        elif index < 0 and fallback is None:
            fallback = (parsed, gateway)
    routes: list[dict[str, str]] = []
    for i, item in enumerate(raw_routes):
        if not isinstance(item, dict):
            raise InvalidRequest("prev_result", f"routes[{i}] must be an object")
        routes.append(
            {"dst": _str(item, "dst", f"routes[{i}]"), "gw": _str(item, "gw", f"routes[{i}]")}
        )
    pick = chosen or fallback
    if pick is None:
        raise InvalidRequest(
            "prev_result",
            f"no IPv4 address for interface {ifname!r} (the previous plugin must configure one)",
        )
    return PrevResult(pick[0], pick[1], interfaces, ips, routes)
