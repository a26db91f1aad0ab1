"""Service load balancing without kube-proxy (upstream's kube-proxy replacement), IPv4.

Modules, one concern each:
    model    Service message -> frontends (VIP, port, protocol) and their backends (pure).
    layout   ctypes mirrors of ``bpf/lib/lb.h`` (upstream's ``cilium_lb4_*`` maps).
    maps     the map writer: backend ids and rev-NAT indexes, restored from the pins
             (through ``datapath.libbpf``: pinned maps by path, cgroup BPF links).
    socklb   ``bpf_sock.o`` loaded and its programs linked to the cgroup2 root.
    hostlb   ``bpf_host.o`` loaded and its NodePort programs attached to the devices.
    watcher  ``ServiceService.WatchServices`` -> the writer (resync, metrics).
    manager  the component the agent starts (flags -> all of the above).

Between the domain packages and the controlplane in the agent's layers: it reads the
operator's messages and writes the datapath, and nothing below imports it.
"""

from cilia_agent.loadbalancer.manager import LoadBalancer, start, watches

__all__ = ["LoadBalancer", "start", "watches"]
