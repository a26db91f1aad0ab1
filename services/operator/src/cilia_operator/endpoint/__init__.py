"""Endpoints: CiliumEndpoint records and the ipcache view derived from them and the nodes.

Modules:
    records  CiliumEndpoint record shape and validation (pure).
    ipcache  ``IPCache``: IP/32 -> identity, node, host IP, owner; incremental and pure.
"""
