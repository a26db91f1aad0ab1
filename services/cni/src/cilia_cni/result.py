"""The ADD result in the netconf's CNI spec version, built from the agent's ``AddResponse``.

Shapes (spec "Success" of each version): 0.3.0, 0.3.1 and 0.4.0 carry ``ips[].version``
(``"4"``/``"6"``); 1.0.0 dropped it; ``interfaces[].mtu`` exists from 1.1.0 on.

It reads the response's attributes only (:class:`cilia_cni.wire.AddResponse`).
"""

from __future__ import annotations

from _socket import AF_INET, AF_INET6, inet_pton

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
        version = _check_cidr(ip.address, "ips[].address", network=False)
        entry = {}
        if cni_version.startswith("0."):
            entry["version"] = str(version)
        entry["address"] = ip.address
        if ip.gateway:
            _check_address(ip.gateway, "ips[].gateway")
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
        _check_cidr(route.dst, "routes[].dst", network=True)
        entry = {"dst": route.dst}
        if route.gw:
            _check_address(route.gw, "routes[].gw")
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


# The agent's addresses are checked as ``ipaddress`` would (ip_address, ip_interface, and
# ip_network with strict host bits), but ``ipaddress`` is imported only when the C parser
# ``inet_pton`` refuses a value: its import (with functools and collections) cost ~5 ms CPU
# of every ADD. Every string inet_pton accepts (dotted quad without leading zeros; RFC 4291
# text forms) ipaddress accepts too (fuzzed in services/cni/tests/integration/
# test_cni_lean_imports.py); what it refuses (a scope id, a netmask prefix, a typo) goes to
# ipaddress, which accepts it or raises the error reported.


def _packed(text: str) -> bytes | None:
    try:
        return inet_pton(AF_INET6 if ":" in text else AF_INET, text)
    except (OSError, ValueError):  # ValueError: an embedded NUL
        return None


def _check_address(value: str, field: str) -> None:
    """As ``ipaddress.ip_address(value)``.

    Raises:
        InternalError: ``value`` is not an IPv4 or IPv6 address.
    """
    if _packed(value) is None:
        import ipaddress

        _check(ipaddress.ip_address, value, field)


def _check_cidr(value: str, field: str, network: bool) -> int:
    """As ``ipaddress.ip_interface(value)`` (``network`` False) or ``ip_network(value)``
    (True: the host bits must be zero); returns the IP version, 4 or 6.

    Raises:
        InternalError: ``value`` is not such a CIDR.
    """
    address, slash, prefix = value.partition("/")
    packed = _packed(address)
    if packed is not None:
        bits = 8 * len(packed)
        if not slash:
            length = bits
        elif prefix.isascii() and prefix.isdigit() and int(prefix) <= bits:
            length = int(prefix)
        else:
            length = -1
        host_mask = (1 << (bits - length)) - 1 if length >= 0 else 0
        if length >= 0 and not (network and int.from_bytes(packed, "big") & host_mask):
            return 4 if bits == 32 else 6
    import ipaddress

    parse = ipaddress.ip_network if network else ipaddress.ip_interface
    return int(getattr(_check(parse, value, field), "version", 4))


def _check(parse: Callable[[str], object], value: str, field: str) -> object:
    try:
        return parse(value)
    except ValueError:
        raise InternalError(f"cilia-agent returned an invalid {field}: {value!r}") from None
