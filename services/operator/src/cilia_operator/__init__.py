"""cilia-operator: the cluster-wide control plane (Store, multi-pool IPAM, manifests)."""

__version__ = "0.1.0"
