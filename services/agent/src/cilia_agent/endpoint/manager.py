"""The endpoint manager: the node's endpoints and their whole lifecycle, in one object.

:class:`EndpointManager` assembles the parts, each in a module of its own: the table of
records, locks and state files (:mod:`.table`), Add (:mod:`.add`, chained Adds
:mod:`.chained`), Del (:mod:`.delete`), Check (:mod:`.check`), restore and GC
(:mod:`.restore`), relabel and gateway moves (:mod:`.update`); the requests and their
validation are in :mod:`.params`, what the parts need of other layers in :mod:`.protocols`.
"""

from __future__ import annotations

from cilia_agent.endpoint.add import EndpointAdds
from cilia_agent.endpoint.check import EndpointChecks
from cilia_agent.endpoint.params import AddParams, CheckParams
from cilia_agent.endpoint.restore import EndpointRestore, RestoreReport
from cilia_agent.endpoint.update import EndpointUpdates

__all__ = ["AddParams", "CheckParams", "EndpointManager", "RestoreReport"]


class EndpointManager(EndpointAdds, EndpointChecks, EndpointRestore, EndpointUpdates):
    """Holds the node's endpoints and drives their lifecycle (Add, Del, Check, GC, restore,
    relabel, gateway moves).

    Args:
        ipam: the node allocator.
        datapath: kernel plumbing.
        store: state files.
        metrics: the agent's metrics.
        executor: pool running blocking netlink/file work.
        mtu: default MTU when a request gives 0.
        node: the local node (readiness, router IP, default pool).
        pools: chooses each new pod's pool and waits for the operator's allocation
            (None: the requested pool or the default pool, no waiting).
        on_change: called after every successful Add/Del (demand recomputation).
        hooks: identity/policy/BPF enforcement run after plumbing (None = plumbing only).
        pods: where an Add's labels come from in Kubernetes mode (None: the CNI call's).
    """
