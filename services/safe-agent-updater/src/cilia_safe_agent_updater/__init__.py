"""cilia-safe-agent-updater: rolls agent upgrades one node at a time.

This issue ships only the process skeleton: ``serve`` runs the gRPC health
server on ``--health-listen-address`` so a DaemonSet or compose probe can see it.
The upgrade logic (prepull, hash compare, replace, wait Ready) comes later.
"""

__version__ = "0.1.0"
