"""Security identities: label sets, CiliumIdentity records, allocation and garbage collection.

Modules:
    labels     parse/validate ``source:key=value`` label sets; reserved identities.
    records    CiliumIdentity and label-key record shapes (pure).
    allocator  ``IdentityAllocator``: label set -> numeric identity through the Store.
    gc         ``IdentityGC``: deletes identities nothing references past the heartbeat timeout.
"""
