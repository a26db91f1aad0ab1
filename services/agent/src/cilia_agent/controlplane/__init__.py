"""The agent's side of ``cilia.controlplane.v1``: one operator channel and what runs on it.

Modules:
    operator  the session (Register, demand, allocations), unary calls and watch streams,
              ResolvePool, the retry queue for best-effort calls, bounded reconnect backoff.
    local     the :class:`ControlPlane` calls the owners make (identity, endpoint records).

Below every domain package (identity, ipcache, policy, endpoint, ipam): it knows messages,
never the agent's owners.
"""

from cilia_agent.controlplane.local import ControlPlane
from cilia_agent.controlplane.operator import (
    Demand,
    NodeNetworks,
    OperatorAPI,
    OperatorClient,
    OperatorConnection,
    OperatorRejected,
    OperatorUnavailable,
    PoolNotResolved,
    PoolResolver,
    RetryQueue,
    backoff_delay,
    operator_channel,
    read_node_networks,
    run_watch,
)

__all__ = [
    "ControlPlane",
    "Demand",
    "NodeNetworks",
    "OperatorAPI",
    "OperatorClient",
    "OperatorConnection",
    "OperatorRejected",
    "OperatorUnavailable",
    "PoolNotResolved",
    "PoolResolver",
    "RetryQueue",
    "backoff_delay",
    "operator_channel",
    "read_node_networks",
    "run_watch",
]
