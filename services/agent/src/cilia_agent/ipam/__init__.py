"""Node-local IP address management inside the CIDRs the operator gave the node.

Source: upstream multi-pool IPAM agent side (``pkg/ipam/multipool*.go``,
reference: cilium-upstream.md §1).
"""

from cilia_agent.ipam.allocator import (
    IPAM,
    AddressInUse,
    AllocationError,
    PoolExhausted,
    PoolPending,
    PoolStatus,
)
from cilia_agent.ipam.ceil import needed_ip_ceil

__all__ = [
    "IPAM",
    "AddressInUse",
    "AllocationError",
    "PoolExhausted",
    "PoolPending",
    "PoolStatus",
    "needed_ip_ceil",
]
