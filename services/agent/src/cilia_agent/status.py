"""``cilia-agent status``: collection of the numbers apart from their text.

:class:`StatusCollector` reads each owner once per call (datapath and policy counts, the
identity cache, the ipcache, Hubble's ring, IPAM's pools) into the debug
``StatusResponse`` fields; :func:`status_lines` renders the same fields as the lines of
``message`` (first line: the not-ready reason, "" when ready).
"""

from __future__ import annotations

from dataclasses import dataclass

from cilia.agent.v1 import agent_pb2
from cilia_agent import __version__
from cilia_agent.config import Config
from cilia_agent.controlplane import RetryQueue
from cilia_agent.endpoint import EndpointManager
from cilia_agent.hubble.flowstore import FlowStore
from cilia_agent.ipam import IPAM
from cilia_agent.ipam.node import NodePools
from cilia_agent.ipcache import IPCache
from cilia_agent.node import LocalNode
from cilia_agent.node.manager import NodeManager, RouteSync
from cilia_agent.policy.engine import PolicyEngine


@dataclass(frozen=True)
class Enforced:
    """The owners behind the eBPF datapath's numbers (absent with ``--enable-bpf=false``):
    ``engine`` (policy revision, policies, identity cache, readiness), ``ipcache``
    (entries), ``retry`` (pending operator calls)."""

    engine: PolicyEngine
    ipcache: IPCache
    retry: RetryQueue


class StatusCollector:
    """Builds the debug ``StatusResponse``.

    Args:
        config: the agent's flags (pin dir, policy mode, IPAM mode, Hubble addresses).
        node: the local node (readiness, router IP, default pool).
        ipam: pools and their use.
        pools: CIDRs being handed back.
        endpoints: the endpoint manager (count).
        enforced: the datapath's owners (None: eBPF off).
        hubble: Hubble's flow ring (None: Hubble off).
        nodes: the other nodes (routing status).
        routes: the routes to them (problems).
    """

    def __init__(
        self,
        config: Config,
        node: LocalNode,
        ipam: IPAM,
        pools: NodePools,
        endpoints: EndpointManager,
        enforced: Enforced | None,
        hubble: FlowStore | None,
        nodes: NodeManager,
        routes: RouteSync,
    ) -> None:
        self.nodes = nodes
        self.routes = routes
        self.config = config
        self.node = node
        self.ipam = ipam
        self.pools = pools
        self.endpoints = endpoints
        self.enforced = enforced
        self.hubble = hubble

    def collect(self) -> agent_pb2.StatusResponse:
        """The debug Status response; every count is read once per call.

        ``datapath``/``hubble`` are set only when the eBPF datapath / Hubble runs.
        """
        datapath = None
        if self.enforced is not None:
            engine = self.enforced.engine
            datapath = agent_pb2.DatapathStatus(
                pin_dir=str(self.config.bpf_pin_dir),
                policy_mode=self.config.enable_policy,
                policy_revision=engine.repository.revision,
                policies=len(engine.repository),
                policy_synced=engine.ready,
                identities=len(engine.identities),
                ipcache_entries=len(self.enforced.ipcache),
                pending_operator_calls=self.enforced.retry.pending,
                unenforced_policies=[
                    f"{ref}: {why}" for ref, why in engine.repository.unenforced().items()
                ],
            )
        hubble = None
        if self.hubble is not None:
            hs = self.hubble.status()
            hubble = agent_pb2.HubbleStatus(
                num_flows=hs.num_flows, max_flows=hs.max_flows, seen_flows=hs.seen_flows
            )
        pools = [
            agent_pb2.PoolStatus(
                pool=p.pool,
                cidrs=p.cidrs,
                used=p.used,
                capacity=p.capacity,
                draining_cidrs=p.draining,
            )
            for p in self.ipam.status()
        ]
        lines = status_lines(
            self.config, self.node.default_pool, len(self.pools.released), datapath, hubble, pools
        )
        lines.append(
            f"Routing: {self.config.routing_mode}, {len(self.nodes.nodes)} other nodes"
            + ("" if self.nodes.synced else " (node list not synced yet)")
            + (f", not routed: {'; '.join(self.routes.problems)}" if self.routes.problems else "")
        )
        router = self.node.router_ip
        return agent_pb2.StatusResponse(
            ready=self.node.ready,
            message="\n".join([self.node.not_ready_reason or "", *lines]),
            node_name=self.config.node_name,
            router_ip=str(router) if router else "",
            pools=pools,
            endpoint_count=len(self.endpoints.list()),
            version=__version__,
            datapath=datapath,
            hubble=hubble,
        )


def status_lines(
    cfg: Config,
    default_pool: str,
    handing_back: int,
    datapath: agent_pb2.DatapathStatus | None,
    hubble: agent_pb2.HubbleStatus | None,
    pools: list[agent_pb2.PoolStatus],
) -> list[str]:
    """Datapath, policy, identity, IPAM and Hubble lines of ``cilia-agent status``: the
    text of the Status fields (``None``: the datapath / Hubble does not run;
    ``handing_back``: CIDRs being handed back to the operator)."""
    lines: list[str] = []
    if datapath is not None:
        lines.append(
            f"Datapath: eBPF loaded, pin dir {datapath.pin_dir}, policy mode {datapath.policy_mode}"
        )
        lines.append(
            f"Policy: revision {datapath.policy_revision}, {datapath.policies} policies, "
            f"{'synced' if datapath.policy_synced else 'waiting for identity/policy streams'}"
        )
        lines.append(
            f"Identities: {datapath.identities} known, ipcache {datapath.ipcache_entries} entries"
        )
        lines.append(f"Operator calls pending retry: {datapath.pending_operator_calls}")
        for line in datapath.unenforced_policies:
            lines.append(f"Policy not enforceable as written: {line}")
    else:
        lines.append("Datapath: eBPF disabled (--enable-bpf=false), plumbing only")
    draining = [f"{p.pool} {c}" for p in pools for c in p.draining_cidrs]
    lines.append(
        f"IPAM: {cfg.ipam}, default pool {default_pool}"
        + (f", draining: {', '.join(draining)}" if draining else "")
        + (f", handing back: {handing_back} CIDRs" if handing_back else "")
    )
    if hubble is not None:
        lines.append(
            f"Hubble: {hubble.num_flows}/{hubble.max_flows} flows, {hubble.seen_flows} seen, "
            f"unix:{cfg.hubble_socket_path()}"
            + (f", {cfg.hubble_listen_address}" if cfg.hubble_listen_address else "")
        )
    return lines
