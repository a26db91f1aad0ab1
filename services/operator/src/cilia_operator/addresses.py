"""IPv4 special-purpose ranges: the one list the operator's domains check addresses against.

No pod CIDR (``ipam.pool``: pools, ``--cluster-pool-ipv4-cidr``), no ServiceCIDR, ClusterIP
or migration target (``service.model``, ``service.migration``) may overlap one of them: a
pod address there is unroutable or means something else on every host, and the agents'
socket load balancer would answer for a Service address there for every process on the
node. A leaf module (it imports nothing of the operator), so both domains read it without
reading each other.

Source: RFC 6890 (Special-Purpose IP Address Registries), the IPv4 blocks that are not
globally reachable and not private-use: "this network" 0.0.0.0/8, loopback 127.0.0.0/8,
link-local 169.254.0.0/16, multicast 224.0.0.0/4 (RFC 5771), reserved 240.0.0.0/4.
"""

from __future__ import annotations

import ipaddress

__all__ = ["SPECIAL_RANGES", "special_ranges"]

SPECIAL_RANGES: tuple[tuple[str, ipaddress.IPv4Network], ...] = (
    ('"this network"', ipaddress.IPv4Network("0.0.0.0/8")),
    ("loopback", ipaddress.IPv4Network("127.0.0.0/8")),
    ("link-local", ipaddress.IPv4Network("169.254.0.0/16")),
    ("multicast", ipaddress.IPv4Network("224.0.0.0/4")),
    ("reserved", ipaddress.IPv4Network("240.0.0.0/4")),
)
"""``(name, range)`` of each special-purpose range, in address order."""


def special_ranges(net: ipaddress.IPv4Network) -> list[tuple[str, ipaddress.IPv4Network]]:
    """The special-purpose ranges ``net`` overlaps, as ``(name, range)`` pairs in
    :data:`SPECIAL_RANGES` order (``[]`` when none); e.g. ``127.0.0.0/16`` ->
    ``[("loopback", IPv4Network("127.0.0.0/8"))]``."""
    return [(name, special) for name, special in SPECIAL_RANGES if net.overlaps(special)]
