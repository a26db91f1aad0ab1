"""What a Service means for the load balancer: its frontends and their backends (pure).

A ``cilia.controlplane.v1.Service`` gives one :class:`Frontend` per (VIP, port, protocol)
with every address in ``cluster_ips`` and ``alias_ips`` (an alias — a former ClusterIP
kept through a ServiceCIDR migration — is served exactly like a ClusterIP) and every
entry of ``ports``. Backends come from the port's EndpointSlice endpoints:

* ``ready`` → **active**: takes new connections (in a service slot);
* not ready but ``terminating`` → **terminating**: kept in the backends map for the
  connections it has, never chosen for a new one (EndpointSlice conditions, KEP-1672);
* not ready and not terminating (starting, failing its probe) → left out;
* no backend ready at all: the terminating ones that are still ``serving`` take new
  connections (kube-proxy's terminating-endpoints fallback, KEP-1669), so a Service whose
  every pod is being replaced in a rollout does not refuse while they drain.

NodePort (``type`` NodePort or LoadBalancer, ``node_port`` set): one more frontend per port,
``0.0.0.0:<nodePort>`` — upstream's zero-address "surrogate" NodePort frontend, served by
``bpf_host.c`` for any local address of the node (see ``hostlb``).

Traffic policies (upstream semantics; a backend is node-local when its ``node_name`` is this
node's name, ``--node-name``):

* ``externalTrafficPolicy: Local``: the NodePort frontend gets the node-local backends only,
  so a node without one drops NodePort traffic for that Service (the client's address is
  kept: no SNAT is needed for a local backend);
* ``internalTrafficPolicy: Local``: the ClusterIP frontends get the node-local backends only
  (a pod on a node without one gets "connection refused").

The terminating fallback below applies after that filter, among the node-local backends.

IPv6 addresses are left out (the datapath is IPv4 only); a protocol other than TCP/UDP
(SCTP), a port outside 1..65535 or a malformed address makes that one frontend or backend
invalid: it is skipped and named in :attr:`Frontends.problems`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia_agent.loadbalancer.layout import PROTOCOLS


@dataclass(frozen=True, order=True)
class Frontend:
    """One VIP:port/protocol (``proto`` 6 or 17)."""

    address: str
    port: int
    proto: int


@dataclass(frozen=True, order=True)
class Backend:
    """One backend address:port/protocol (``proto`` 6 or 17)."""

    address: str
    port: int
    proto: int


@dataclass(frozen=True)
class FrontendSpec:
    """Desired state of one frontend.

    Attributes:
        frontend: the VIP:port/protocol.
        active: backends taking new connections, in a stable order (sorted).
        terminating: backends kept only for their connections.
        affinity_timeout: ClientIP affinity timeout in seconds; 0 = no affinity.
        service: ``namespace/name`` of the Service (for logs and the CLI).
        service_type: ``ClusterIP``, ``NodePort`` or ``LoadBalancer``.
        node_port: the frontend is the 0.0.0.0:nodePort surrogate.
        local_scope: the backends were limited to node-local ones (a ``Local`` traffic
            policy applies to this frontend).
    """

    frontend: Frontend
    active: tuple[Backend, ...]
    terminating: tuple[Backend, ...]
    affinity_timeout: int
    service: str
    service_type: str = "ClusterIP"
    node_port: bool = False
    local_scope: bool = False


#: The NodePort surrogate frontend's address.
NODE_PORT_ADDRESS = "0.0.0.0"
LOCAL = "Local"


@dataclass(frozen=True)
class _Endpoint:
    backend: Backend
    ready: bool
    serving: bool
    terminating: bool
    local: bool


def _choose(
    endpoints: list[_Endpoint], local_only: bool
) -> tuple[tuple[Backend, ...], tuple[Backend, ...]]:
    """(active, terminating) of ``endpoints`` (node-local ones only when ``local_only``),
    with the terminating-but-serving fallback of the module docstring."""
    active: set[Backend] = set()
    terminating: set[Backend] = set()
    serving: set[Backend] = set()
    for ep in endpoints:
        if local_only and not ep.local:
            continue
        if ep.ready:
            active.add(ep.backend)
        elif ep.terminating:
            terminating.add(ep.backend)
            if ep.serving:
                serving.add(ep.backend)
    terminating -= active
    if not active:
        active, terminating = serving, terminating - serving
    return tuple(sorted(active)), tuple(sorted(terminating))


@dataclass
class Frontends:
    """The frontends of one Service and what was skipped (one line per problem)."""

    specs: list[FrontendSpec] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def service_name(namespace: str, name: str) -> str:
    """``namespace/name``."""
    return f"{namespace}/{name}"


def _ipv4(text: str) -> str | None:
    """``text`` as a canonical IPv4 address, None when IPv6; raises ValueError otherwise."""
    address = ipaddress.ip_address(text)
    return str(address) if address.version == 4 else None


def frontends(svc: cp.Service, node_name: str = "") -> Frontends:
    """The frontends of ``svc`` as node ``node_name`` serves them (see the module
    docstring); never raises."""
    name = service_name(svc.namespace, svc.name)
    out = Frontends()
    affinity = svc.session_affinity_timeout_seconds if svc.session_affinity == "ClientIP" else 0
    if svc.session_affinity == "ClientIP" and affinity == 0:
        affinity = 10800  # Kubernetes' default timeoutSeconds
    service_type = svc.type or "ClusterIP"
    internal_local = svc.internal_traffic_policy == LOCAL
    external_local = svc.external_traffic_policy == LOCAL
    vips: list[str] = []
    for text in [*svc.cluster_ips, *svc.alias_ips]:
        try:
            vip = _ipv4(text)
        except ValueError:
            out.problems.append(f"{name}: {text!r} is not an IP address")
            continue
        if vip is not None and vip not in vips:
            vips.append(vip)
    for port in svc.ports:
        proto = PROTOCOLS.get(port.protocol or "TCP")
        if proto is None:
            out.problems.append(f"{name}: port {port.port}: protocol {port.protocol!r} unsupported")
            continue
        if not 1 <= port.port <= 65535:
            out.problems.append(f"{name}: port {port.port} is outside 1..65535")
            continue
        endpoints: list[_Endpoint] = []
        for be in port.backends:
            try:
                address = _ipv4(be.ip)
            except ValueError:
                out.problems.append(f"{name}: backend {be.ip!r} is not an IP address")
                continue
            if address is None:
                continue
            if not 1 <= be.port <= 65535:
                out.problems.append(f"{name}: backend {be.ip}:{be.port} port outside 1..65535")
                continue
            local = bool(node_name) and be.node_name == node_name
            endpoints.append(
                _Endpoint(Backend(address, be.port, proto), be.ready, be.serving,
                          be.terminating, local)
            )  # fmt: skip
        active, terminating = _choose(endpoints, internal_local)
        for vip in vips:
            out.specs.append(
                FrontendSpec(
                    frontend=Frontend(vip, port.port, proto),
                    active=active,
                    terminating=terminating,
                    affinity_timeout=affinity,
                    service=name,
                    service_type=service_type,
                    local_scope=internal_local,
                )
            )
        if port.node_port and service_type in ("NodePort", "LoadBalancer"):
            if not 1 <= port.node_port <= 65535:
                out.problems.append(f"{name}: nodePort {port.node_port} is outside 1..65535")
                continue
            active, terminating = _choose(endpoints, external_local)
            out.specs.append(
                FrontendSpec(
                    frontend=Frontend(NODE_PORT_ADDRESS, port.node_port, proto),
                    active=active,
                    terminating=terminating,
                    affinity_timeout=affinity,
                    service=name,
                    service_type=service_type,
                    node_port=True,
                    local_scope=external_local,
                )
            )
    return out
