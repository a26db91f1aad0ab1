"""The ADD result in CNI spec 1.0.0/1.1.0 shape, built from the agent's ``AddResponse``.

Kept free of grpc/protobuf imports: it reads the response's attributes only.
"""

from __future__ import annotations

import ipaddress

from cilia_cni.errors import InternalError

# typing is not imported at run time (start-up cost); mypy honours this constant.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

    from cilia.agent.v1 import agent_pb2


def build(cni_version: str, response: agent_pb2.AddResponse) -> dict[str, object]:
    """Return the spec result for ``response`` in ``cni_version``.

    Shape: ``{"cniVersion", "interfaces": [{name, mac?, mtu? (1.1.0 only), sandbox?}],
    "ips": [{address (CIDR), gateway?, interface (index)}], "routes": [{dst, gw?}]}``;
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
        if itf.mtu and cni_version != "1.0.0":
            entry["mtu"] = itf.mtu
        if itf.sandbox:
            entry["sandbox"] = itf.sandbox
        interfaces.append(entry)
    if not interfaces:
        raise InternalError("cilia-agent returned an ADD result without interfaces")
    ips: list[dict[str, object]] = []
    for ip in response.ips:
        _check(ipaddress.ip_interface, ip.address, "ips[].address")
        entry = {"address": ip.address}
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


def _check(parse: Callable[[str], object], value: str, field: str) -> None:
    try:
        parse(value)
    except ValueError:
        raise InternalError(f"cilia-agent returned an invalid {field}: {value!r}") from None
