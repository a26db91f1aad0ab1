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
    """

    frontend: Frontend
    active: tuple[Backend, ...]
    terminating: tuple[Backend, ...]
    affinity_timeout: int
    service: str
    service_type: str = "ClusterIP"


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


def frontends(svc: cp.Service) -> Frontends:
    """The frontends of ``svc`` (see the module docstring); never raises."""
    name = service_name(svc.namespace, svc.name)
    out = Frontends()
    affinity = svc.session_affinity_timeout_seconds if svc.session_affinity == "ClientIP" else 0
    if svc.session_affinity == "ClientIP" and affinity == 0:
        affinity = 10800  # Kubernetes' default timeoutSeconds
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
        active: set[Backend] = set()
        terminating: set[Backend] = set()
        serving: set[Backend] = set()
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
            backend = Backend(address, be.port, proto)
            if be.ready:
                active.add(backend)
            elif be.terminating:
                terminating.add(backend)
                if be.serving:
                    serving.add(backend)
        terminating -= active
        if not active:
            active, terminating = serving, terminating - serving
        for vip in vips:
            out.specs.append(
                FrontendSpec(
                    frontend=Frontend(vip, port.port, proto),
                    active=tuple(sorted(active)),
                    terminating=tuple(sorted(terminating)),
                    affinity_timeout=affinity,
                    service=name,
                    service_type=svc.type or "ClusterIP",
                )
            )
    return out
