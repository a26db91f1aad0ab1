"""The ADD result in the netconf's CNI spec version, built from the agent's ``AddResponse``.

Shapes (spec "Success" of each version): 0.3.0, 0.3.1 and 0.4.0 carry ``ips[].version``
(``"4"``/``"6"``); 1.0.0 dropped it; ``interfaces[].mtu`` exists from 1.1.0 on.

It reads the response's attributes only (:class:`cilia_cni.wire.AddResponse`).
"""

from __future__ import annotations

import ipaddress

from cilia_cni.errors import InternalError

# typing is not imported at run time (start-up cost); mypy honours this constant.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from cilia_cni.wire import AddResponse


def build(cni_version: str, response: AddResponse) -> dict[str, object]:
    """Return the spec result for ``response`` in ``cni_version``.

    Shape: ``{"cniVersion", "interfaces": [{name, mac?, mtu? (1.1.0 only), sandbox?}],
    "ips": [{version ("4"/"6", before 1.0.0 only), address (CIDR), gateway?, interface
    (index)}], "routes": [{dst, gw?}]}``;
    the agent lists the host veth first and the container interface (with ``sandbox``)
    second. Empty optional fields are omitted.

    Raises:
        InternalError: the response breaks the contract (no interfaces, an address or
            route that is not an IP/CIDR, an interface index out of range).
    """
    interfaces: list[dict[str, object]] = []
    for i, itf in enumerate(response.interfaces):
        if not itf.name:
            raise InternalError(f"cilia-agent returned interface #{i} without a name")
        entry: dict[str, object] = {"name": itf.name}
        if itf.mac:
            entry["mac"] = itf.mac
        if itf.mtu and cni_version == "1.1.0":
            entry["mtu"] = itf.mtu
        if itf.sandbox:
            entry["sandbox"] = itf.sandbox
        interfaces.append(entry)
    if not interfaces:
        raise InternalError("cilia-agent returned an ADD result without interfaces")
    ips: list[dict[str, object]] = []
    for ip in response.ips:
        parsed = _check(ipaddress.ip_interface, ip.address, "ips[].address")
        entry = {}
        if cni_version.startswith("0."):
            entry["version"] = str(getattr(parsed, "version", 4))
        entry["address"] = ip.address
        if ip.gateway:
            _check(ipaddress.ip_address, ip.gateway, "ips[].gateway")
            entry["gateway"] = ip.gateway
        if ip.interface >= len(interfaces):
            raise InternalError(
                f"cilia-agent returned ips[].interface {ip.interface} for "
                f"{len(interfaces)} interfaces"
            )
        entry["interface"] = ip.interface
        ips.append(entry)
    routes: list[dict[str, object]] = []
    for route in response.routes:
        _check(ipaddress.ip_network, route.dst, "routes[].dst")
        entry = {"dst": route.dst}
        if route.gw:
            _check(ipaddress.ip_address, route.gw, "routes[].gw")
            entry["gw"] = route.gw
        routes.append(entry)
    return {"cniVersion": cni_version, "interfaces": interfaces, "ips": ips, "routes": routes}


def convert(cni_version: str, prev: Mapping[str, object]) -> dict[str, object]:
    """Return an already validated result object (a ``prevResult``) in ``cni_version``.

    A chained plugin passes its ``prevResult`` on (spec "Chaining"): the keys are kept,
    ``cniVersion`` is set, ``ips[].version`` is added before 1.0.0 and dropped from 1.0.0
    on, ``interfaces[].mtu`` is dropped before 1.1.0.
    """
    out: dict[str, object] = dict(prev)
    out["cniVersion"] = cni_version
    old = cni_version.startswith("0.")
    ips: list[dict[str, object]] = []
    for ip in _objects(prev.get("ips")):
        entry = dict(ip)
        if old:
            address = str(entry.get("address", ""))
            entry = {"version": "6" if ":" in address else "4", **entry}
        else:
            entry.pop("version", None)
        ips.append(entry)
    interfaces: list[dict[str, object]] = []
    for itf in _objects(prev.get("interfaces")):
        entry = dict(itf)
        if cni_version != "1.1.0":
            for key in ("mtu", "socketPath", "pciID"):
                entry.pop(key, None)
        interfaces.append(entry)
    out["interfaces"] = interfaces
    out["ips"] = ips
    out["routes"] = [dict(r) for r in _objects(prev.get("routes"))]
    return out


def _objects(value: object) -> list[Mapping[str, object]]:
    return [x for x in value if isinstance(x, dict)] if isinstance(value, list) else []


def _check(parse: Callable[[str], object], value: str, field: str) -> object:
    try:
        return parse(value)
    except ValueError:
        raise InternalError(f"cilia-agent returned an invalid {field}: {value!r}") from None
