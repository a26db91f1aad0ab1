"""``python -m bench [NAME] [ARGS]``: run the benchmarks.

NAME: ``cni_latency``, ``agent_add``, ``agent_memory``, ``datapath``, ``flows``, ``hubble_agent``,
``conntrack_gc``, ``ipam``, ``cluster``, ``k8s_operator``, ``services``, ``operator_busy``
(``python -m bench NAME --help``). Without
NAME every benchmark runs with its defaults, in that order; ARGS without NAME go to
``bench.cni_latency``.
"""

from __future__ import annotations

import sys

from bench import (
    agent_add,
    agent_memory,
    cluster,
    cni_latency,
    conntrack_gc,
    datapath,
    flows,
    hubble_agent,
    ipam,
    k8s_operator,
    operator_busy,
    services,
)

BENCHES = {
    "cni_latency": cni_latency.main,
    "agent_add": agent_add.main,
    "agent_memory": agent_memory.main,
    "datapath": datapath.main,
    "flows": flows.main,
    "hubble_agent": hubble_agent.main,
    "conntrack_gc": conntrack_gc.main,
    "ipam": ipam.main,
    "cluster": cluster.main,
    "k8s_operator": k8s_operator.main,
    "services": services.main,
    "operator_busy": operator_busy.main,
}

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] in BENCHES:
        sys.exit(BENCHES[argv[0]](argv[1:]))
    if argv:
        sys.exit(cni_latency.main(argv))
    sys.exit(max([bench([]) for bench in BENCHES.values()]))
