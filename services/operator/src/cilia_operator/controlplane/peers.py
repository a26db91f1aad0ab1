"""Who is on the other end of an RPC."""

from __future__ import annotations

import ipaddress
from typing import Any


def peer_ip(context: Any) -> str:
    """The caller's IP address from gRPC's peer string (``ipv4:198.18.0.11:54321``,
    ``ipv6:[fd00::1]:54321``); "" for unix sockets, a context without a peer (in-process
    callers) or anything unparsable."""
    read = getattr(context, "peer", None)
    peer = str(read() or "") if callable(read) else ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]")
    else:
        return ""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return ""
