"""cilia-relay: Hubble relay (fans ``observer.Observer`` out to every agent).

This issue ships only the process skeleton: ``serve`` runs the gRPC health
server so deployments and the local stack can probe it (DESIGN.md §2).
"""

__version__ = "0.1.0"
