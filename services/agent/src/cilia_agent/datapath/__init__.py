"""Pod plumbing on the node (host device, veth pairs, addresses, routes, iptables) and
the eBPF datapath (``loader``: object load + tc attach; ``objects``: libbpf objects and ring
buffers; ``layout``: map layouts; ``bpffs``: bpffs mount and pinned-map reads).

Everything here is synchronous and is run by the endpoint layer in worker threads.
"""

from cilia_agent.datapath.errors import (
    DatapathError,
    DefaultRouteExists,
    HostNetns,
    InterfaceExists,
    NetnsNotFound,
)
from cilia_agent.datapath.linux import LinuxDatapath, PlumbRequest, PlumbResult, host_ifname

__all__ = [
    "DatapathError",
    "DefaultRouteExists",
    "HostNetns",
    "InterfaceExists",
    "LinuxDatapath",
    "NetnsNotFound",
    "PlumbRequest",
    "PlumbResult",
    "host_ifname",
]
