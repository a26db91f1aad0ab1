"""The local node: router IP, default pool, addresses, readiness, persisted node state.

Modules:
    state  ``NodeState``, the node's record kept across restarts (``node.json``).
    local  :class:`LocalNode`, the owner of that state while the agent runs, with
           observers for readiness (the CNI config is written then).

Source: upstream ``pkg/node`` (the local node store and its observers).
"""

from cilia_agent.node.local import LocalNode, NodeStore
from cilia_agent.node.state import NodeState

__all__ = ["LocalNode", "NodeState", "NodeStore"]
