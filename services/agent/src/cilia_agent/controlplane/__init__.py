"""The agent's side of ``cilia.controlplane.v1``: one operator channel and what runs on it.

Modules:
    operator  the session (Register, demand, allocations), unary calls and watch streams,
              ResolvePool, the retry queue for best-effort calls, bounded reconnect backoff.
    local     the :class:`ControlPlane` calls the owners make (identity, endpoint records).
    discovery ``--operator k8s:NAMESPACE/SERVICE``: the operator's addresses from its
              EndpointSlices, a channel that follows them (imported only in that mode).
    kubeapi   where the API server is (kubeconfig, in-cluster env, ``--k8s-api-server``)
              and a small urllib3 GET client.

Below every domain package (identity, ipcache, policy, endpoint, ipam): it knows messages,
never the agent's owners.
"""

from cilia_agent.controlplane.local import ControlPlane
from cilia_agent.controlplane.operator import (
    AGENT_DEVICE_PREFIXES,
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
    reconnect_options,
    run_watch,
)

__all__ = [
    "AGENT_DEVICE_PREFIXES",
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
    "reconnect_options",
    "run_watch",
]
