"""The ipcache listener that keeps the pinned ``cilia_ipcache`` LPM trie in line.

The map's key is ``{prefixlen, IPv4}`` and its value ``{identity, tunnel/host IP}``
(``datapath.layout``); the loader's ``upsert_ipcache``/``delete_ipcache`` write them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from cilia_agent.datapath.layout import ip_from_map
from cilia_agent.ipcache.cache import Entry


class IPCacheMap(Protocol):
    """The loader's ipcache calls (``cilia_agent.datapath.loader.Datapath``)."""

    def upsert_ipcache(self, ip: str, plen: int, identity: int, node_ip: str = "") -> None:
        """Write ``ip/plen → identity, node_ip``."""

    def delete_ipcache(self, ip: str, plen: int) -> None:
        """Remove ``ip/plen``."""


class BPFWriter:
    """:class:`~cilia_agent.ipcache.cache.Listener` writing ``cilia_ipcache``.

    Raises (from its calls): whatever the map write raises (``LibbpfError``).
    """

    def __init__(self, bpf_map: IPCacheMap) -> None:
        self.map = bpf_map

    def upsert(self, prefix: str, entry: Entry) -> None:
        """Write the prefix's entry."""
        ip, _, plen = prefix.partition("/")
        self.map.upsert_ipcache(ip, int(plen), entry.identity, entry.host_ip)

    def delete(self, prefix: str) -> None:
        """Remove the prefix."""
        ip, _, plen = prefix.partition("/")
        self.map.delete_ipcache(ip, int(plen))


def read_prefixes(table: Iterable[tuple[Any, Any]]) -> dict[str, int]:
    """Every ``prefix → identity`` of the pinned map (``table``: ``Datapath.ipcache_map.items()``,
    keys ``IpcacheKey``, values ``IpcacheValue``); used after a restart to adopt the CIDR
    identities of the previous run."""
    return {
        f"{ip_from_map(int(key.ip))}/{int(key.prefixlen)}": int(value.sec_identity)
        for key, value in table
    }
