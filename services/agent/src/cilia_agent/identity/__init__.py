"""Security identities on the agent side: label model, label filter, identity cache.

Modules:
    labels  ``Label``/``LabelSet`` ("source:key=value"), the upstream default label
            filter, pod labels → identity labels, the reserved identities table.
    cache   id → labels cache fed by ``IdentityService.WatchIdentities``.
    allocator  the identities this node holds, by label set, with their local users:
            the operator is called on the first reference only and released after
            the last (upstream ``pkg/allocator`` local keys).
    watcher  the identity stream into the cache (and the allocator's checks).

Source: upstream ``pkg/labels``, ``pkg/labelsfilter``, ``pkg/identity``
(reference: cilium-upstream.md §4).
"""
