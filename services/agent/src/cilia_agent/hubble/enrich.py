"""Enrichment lookups: who is behind an endpoint id, an IP, an identity, an ifindex.

The parser only talks to the :class:`Resolver` protocol. The agent implements it with
:class:`OwnerResolver` over the owners of node state, read through getters (no copy of
their data is pushed here): the local endpoints (endpoint regeneration), the ipcache
(local pods, this node's addresses, the operator's ``WatchIPCache`` stream) and the
identities (allocator + identity cache). :class:`MemoryResolver` is the fake fed by hand
(tests, replay).

Upstream: Hubble's parser getters (``pkg/hubble/parser/getters``: EndpointGetter,
IdentityGetter, IPGetter, LinkGetter) play the same role.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cilia_common import reserved_identities as reserved

# Reserved identities and the label Hubble shows for each (``reserved:<name>``).
RESERVED_IDENTITY_LABELS: dict[int, tuple[str, ...]] = {
    identity: (f"reserved:{reserved.NAMES[identity]}",) for identity in reserved.LABELLED
}


@dataclass(frozen=True, slots=True)
class EndpointRef:
    """What the agent knows about one side of a flow.

    Attributes:
        id: local endpoint id (0 for anything not on this node).
        identity: security identity (0 = unknown).
        namespace: pod namespace ("" for non-pods).
        pod_name: pod name ("" for non-pods).
        labels: "source:key=value" strings (may be empty; identity labels win).
    """

    id: int = 0
    identity: int = 0
    namespace: str = ""
    pod_name: str = ""
    labels: tuple[str, ...] = ()


class Resolver(Protocol):
    """Lookups the flow parser needs; every method returns ``None`` when unknown.

    Implementations must be cheap (called up to 4 times per flow on the event loop)
    and must not block.
    """

    def endpoint_by_id(self, ep_id: int) -> EndpointRef | None:
        """The local endpoint with this id."""

    def endpoint_by_ip(self, ip: str) -> EndpointRef | None:
        """The endpoint (local, or remote through the ipcache owner "ns/name") owning ``ip``."""

    def identity_labels(self, identity: int) -> Sequence[str] | None:
        """Labels of a security identity ("source:key=value")."""

    def interface_name(self, ifindex: int) -> str | None:
        """Name of a host network interface."""


def kernel_name(ifindex: int) -> str | None:
    """The kernel's name for ``ifindex`` in the agent's network namespace (None: no such
    interface, or ``ifindex`` ≤ 0)."""
    if ifindex <= 0:
        return None
    try:
        return socket.if_indextoname(ifindex)
    except OSError:
        return None


def _owner(owner: str) -> tuple[str, str]:
    namespace, _, name = owner.partition("/")
    return (namespace, name) if name else ("", "")


class MemoryResolver:
    """In-memory :class:`Resolver` the agent feeds with ``set_*``/``remove_*`` calls.

    Not thread-safe: call it from the agent's event loop (the same loop the
    Hubble reader parses on).

    Args:
        kernel_interface_names: when an ifindex was never registered with
            :meth:`set_interface`, ask the kernel (``if_indextoname`` in the agent's
            network namespace); ``False`` = only registered names.
    """

    def __init__(self, *, kernel_interface_names: bool = True) -> None:
        self._kernel_names = kernel_interface_names
        self._endpoints: dict[int, EndpointRef] = {}
        self._endpoint_ips: dict[str, int] = {}
        self._ep_ip_of: dict[int, str] = {}
        # ipcache: one dict per prefix length, longest prefix checked first.
        self._ipcache: dict[int, dict[int, tuple[int, str]]] = {}
        self._identities: dict[int, tuple[str, ...]] = {}
        self._interfaces: dict[int, str] = {}

    # -- feeding -------------------------------------------------------------

    def set_endpoint(
        self,
        ep_id: int,
        *,
        ipv4: str | None,
        identity: int,
        namespace: str,
        pod_name: str,
        labels: Iterable[str] = (),
    ) -> None:
        """Add or replace a local endpoint (and its IPv4 address for by-IP lookups).

        Raises:
            ValueError: ``ipv4`` is not an IPv4 address.
        """
        if ipv4 is not None:
            ipv4 = str(ipaddress.IPv4Address(ipv4))
        self.remove_endpoint(ep_id)
        self._endpoints[ep_id] = EndpointRef(
            id=ep_id,
            identity=identity,
            namespace=namespace,
            pod_name=pod_name,
            labels=tuple(labels),
        )
        if ipv4 is not None:
            self._endpoint_ips[ipv4] = ep_id
            self._ep_ip_of[ep_id] = ipv4

    def remove_endpoint(self, ep_id: int) -> None:
        """Forget a local endpoint; unknown ids are ignored."""
        self._endpoints.pop(ep_id, None)
        ip = self._ep_ip_of.pop(ep_id, None)
        if ip is not None and self._endpoint_ips.get(ip) == ep_id:
            del self._endpoint_ips[ip]

    def set_ipcache(self, cidr: str, identity: int, owner: str = "") -> None:
        """Add or replace an ipcache entry (``IPCacheEntry.cidr/identity/owner``).

        Args:
            cidr: "10.200.0.5/32" (a bare address means /32).
            identity: security identity of the prefix.
            owner: "namespace/name" of the pod, "" for non-pods.

        Raises:
            ValueError: ``cidr`` is not an IPv4 prefix.
        """
        net = ipaddress.IPv4Network(cidr, strict=False)
        self._ipcache.setdefault(net.prefixlen, {})[int(net.network_address)] = (identity, owner)

    def remove_ipcache(self, cidr: str) -> None:
        """Remove an ipcache entry; unknown prefixes are ignored.

        Raises:
            ValueError: ``cidr`` is not an IPv4 prefix.
        """
        net = ipaddress.IPv4Network(cidr, strict=False)
        self._ipcache.get(net.prefixlen, {}).pop(int(net.network_address), None)

    def set_identity(self, identity: int, labels: Iterable[str]) -> None:
        """Record the labels of a security identity."""
        self._identities[identity] = tuple(labels)

    def remove_identity(self, identity: int) -> None:
        """Forget an identity; unknown ones are ignored."""
        self._identities.pop(identity, None)

    def set_interface(self, ifindex: int, name: str) -> None:
        """Record a host interface name (the endpoint's ``lxc…`` veth)."""
        self._interfaces[ifindex] = name

    def remove_interface(self, ifindex: int) -> None:
        """Forget an interface; unknown ones are ignored."""
        self._interfaces.pop(ifindex, None)

    # -- Resolver ------------------------------------------------------------

    def endpoint_by_id(self, ep_id: int) -> EndpointRef | None:
        """See :meth:`Resolver.endpoint_by_id`."""
        return self._endpoints.get(ep_id)

    def endpoint_by_ip(self, ip: str) -> EndpointRef | None:
        """Local endpoints first, then the longest matching ipcache prefix."""
        ep_id = self._endpoint_ips.get(ip)
        if ep_id is not None:
            return self._endpoints.get(ep_id)
        try:
            addr = int(ipaddress.IPv4Address(ip))
        except ValueError:
            return None
        for prefixlen in sorted(self._ipcache, reverse=True):
            mask = (0xFFFFFFFF << (32 - prefixlen)) & 0xFFFFFFFF
            hit = self._ipcache[prefixlen].get(addr & mask)
            if hit is not None:
                identity, owner = hit
                namespace, name = _owner(owner)
                return EndpointRef(identity=identity, namespace=namespace, pod_name=name)
        return None

    def identity_labels(self, identity: int) -> Sequence[str] | None:
        """Fed labels, else the reserved identities' labels."""
        labels = self._identities.get(identity)
        if labels is not None:
            return labels
        return RESERVED_IDENTITY_LABELS.get(identity)

    def interface_name(self, ifindex: int) -> str | None:
        """Registered name, else (optionally) the kernel's name for the index."""
        name = self._interfaces.get(ifindex)
        return name if name is not None or not self._kernel_names else kernel_name(ifindex)


class LocalEndpointLike(Protocol):
    """A local endpoint as the endpoint owner exposes it."""

    @property
    def id(self) -> int: ...

    @property
    def identity(self) -> int: ...

    @property
    def pod_namespace(self) -> str: ...

    @property
    def pod_name(self) -> str: ...

    @property
    def label_strings(self) -> tuple[str, ...]: ...


class EndpointGetter(Protocol):
    """Local endpoints (upstream ``getters.EndpointGetter``)."""

    def endpoint(self, ep_id: int) -> LocalEndpointLike | None:
        """The endpoint with this id."""

    def endpoint_by_ip(self, ip: str) -> LocalEndpointLike | None:
        """The endpoint holding this IP."""

    def interface_name(self, ifindex: int) -> str | None:
        """Host veth name of the endpoint enforced on ``ifindex``."""


class IPEntryLike(Protocol):
    """An ipcache entry: identity and ``namespace/name`` owner ("" for non-pods)."""

    @property
    def identity(self) -> int: ...

    @property
    def owner(self) -> str: ...


class IPGetter(Protocol):
    """The ipcache (upstream ``getters.IPGetter``)."""

    def lookup(self, ip: str) -> IPEntryLike | None:
        """Longest-prefix entry for ``ip``."""


class IdentityGetter(Protocol):
    """Security identities (upstream ``getters.IdentityGetter``)."""

    def labels_of(self, identity: int) -> Sequence[str] | None:
        """Labels of an identity known to the node."""


class OwnerResolver:
    """:class:`Resolver` reading the agent's owners through getters.

    Args:
        endpoints: local endpoints (None: the eBPF datapath is off, no endpoint enforced).
        ipcache: the node's ipcache.
        identities: identity labels (None: only the reserved identities are named).
        kernel_interface_names: an ifindex no endpoint holds is named by the kernel
            (``if_indextoname`` in the agent's network namespace).
    """

    def __init__(
        self,
        *,
        endpoints: EndpointGetter | None,
        ipcache: IPGetter,
        identities: IdentityGetter | None,
        kernel_interface_names: bool = True,
    ) -> None:
        self.endpoints = endpoints
        self.ipcache = ipcache
        self.identities = identities
        self._kernel_names = kernel_interface_names

    @staticmethod
    def _ref(ep: LocalEndpointLike) -> EndpointRef:
        return EndpointRef(
            id=ep.id,
            identity=ep.identity,
            namespace=ep.pod_namespace,
            pod_name=ep.pod_name,
            labels=ep.label_strings,
        )

    def endpoint_by_id(self, ep_id: int) -> EndpointRef | None:
        """See :meth:`Resolver.endpoint_by_id`."""
        ep = self.endpoints.endpoint(ep_id) if self.endpoints is not None else None
        return self._ref(ep) if ep is not None else None

    def endpoint_by_ip(self, ip: str) -> EndpointRef | None:
        """Local endpoints first, then the longest matching ipcache prefix."""
        ep = self.endpoints.endpoint_by_ip(ip) if self.endpoints is not None else None
        if ep is not None:
            return self._ref(ep)
        entry = self.ipcache.lookup(ip)
        if entry is None:
            return None
        namespace, name = _owner(entry.owner)
        return EndpointRef(identity=entry.identity, namespace=namespace, pod_name=name)

    def identity_labels(self, identity: int) -> Sequence[str] | None:
        """The node's labels of the identity, else the reserved identities' labels."""
        labels = self.identities.labels_of(identity) if self.identities is not None else None
        if labels is not None:
            return labels
        return RESERVED_IDENTITY_LABELS.get(identity)

    def interface_name(self, ifindex: int) -> str | None:
        """An endpoint's host veth, else (optionally) the kernel's name for the index."""
        name = self.endpoints.interface_name(ifindex) if self.endpoints is not None else None
        return name if name is not None or not self._kernel_names else kernel_name(ifindex)
