"""What the agent learns from Kubernetes objects, through the operator (Kubernetes mode).

Modules:
    pods     :class:`PodCache`: this node's Pods from ``PodService.WatchPods``; an Add's
             endpoint labels come from its Pod (waiting a bounded time for it), and a
             label change on a running Pod re-computes its endpoint's identity.

Source: upstream ``pkg/k8s/watchers`` (the agent's Pod and Namespace watchers).
"""

from cilia_agent.k8s.pods import PodCache, PodInfo, PodRequired, PodUnknown

__all__ = ["PodCache", "PodInfo", "PodRequired", "PodUnknown"]
