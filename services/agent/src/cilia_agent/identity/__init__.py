"""Security identities on the agent side: label model, label filter, identity cache.

Modules:
    labels  ``Label``/``LabelSet`` ("source:key=value"), the upstream default label
            filter, pod labels → identity labels, the reserved identities table.
    cache   id → labels cache fed by ``IdentityService.WatchIdentities``.

Source: upstream ``pkg/labels``, ``pkg/labelsfilter``, ``pkg/identity``
(reference: cilium-upstream.md §4).
"""
