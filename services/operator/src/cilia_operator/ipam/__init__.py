"""Multi-pool IPAM: pools, the per-node CIDR allocator and its controller."""
