"""The node's ipcache: IP prefix → security identity, tunnel/host IP and owner.

Modules:
    cache    :class:`IPCache`, the one owner of the entries, from three sources: local
             endpoints (``/32``), this node's own addresses (identity 1, host) and the
             operator's ``WatchIPCache`` stream (every other node's pods); listeners
             (the BPF map writer) see every change of the effective entry of a prefix.
    bpf      the listener that writes the pinned ``cilia_ipcache`` LPM trie.
    watcher  follows one ``WatchIPCache`` stream into the cache (resync on reconnect).

Source: upstream ``pkg/ipcache`` (metadata from several sources, listeners such as the
BPF map writer; reference: cilium-upstream.md §4).
"""

from cilia_agent.ipcache.cache import Entry, IPCache, Listener

__all__ = ["Entry", "IPCache", "Listener"]
