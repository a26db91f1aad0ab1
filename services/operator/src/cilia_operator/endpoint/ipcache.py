"""``IPCache``: the cluster's IP -> identity map, derived from endpoints and nodes.

Entries (``cidr`` -> ``Entry``):

- every endpoint's IPv4/32 -> its identity, its node's name, that node's first InternalIP
  (``host_ip``, "" until the node registers) and owner ``namespace/name``;
- every node InternalIP (IPv4/32 or IPv6/128) -> identity 6 (``remote-node``), the node's
  name, host IP = that address, owner "";
- every address of the API server -> identity 7 (``kube-apiserver``, upstream's reserved
  identity, which also carries the ``reserved:remote-node`` label): the addresses of the
  ready endpoints (``conditions.ready`` absent means true) of the EndpointSlices labelled
  ``kubernetes.io/service-name: kubernetes`` in namespace ``default`` -- the slices
  kube-apiserver keeps for its own ``default/kubernetes`` Service, also when it runs
  outside the cluster. When the address is also a node's InternalIP (an API server on
  the host network of a node) the entry keeps that node's name and host IP and its
  identity becomes 7, as upstream gives an address labelled both remote-node and
  kube-apiserver the kube-apiserver identity; on that node itself the agent keeps its
  own addresses as ``host`` (1), as upstream keeps the host identity there. Otherwise
  node name and host IP are "" (an off-cluster address: no tunnel). Owner "".

When several sources claim one address (a pod IP reused while the old record is not yet
deleted, or a pod IP equal to a node address) the endpoint claim written last (highest
resourceVersion) wins; endpoint claims beat API server claims, which beat node claims.
Deleting the winner brings the next claim back. Every mutation returns the cidrs whose effective entry may have changed,
so a stream sends only those. Upstream: ``pkg/ipcache`` (source priorities) -- simplified.

Pure and not thread-safe: one instance per stream, fed from one task.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from cilia_common.reserved_identities import KUBE_APISERVER

from ..identity.labels import REMOTE_NODE_IDENTITY
from ..store import Resource, resource_version
from .records import Endpoint, owner_of, parse_endpoint


@dataclass(frozen=True)
class Entry:
    """One effective ipcache entry (the fields of ``IPCacheEntry``)."""

    cidr: str
    identity: int
    node_name: str
    host_ip: str
    owner: str


def _host_cidr(address: str) -> str:
    ip = ipaddress.ip_address(address)
    return f"{ip}/{ip.max_prefixlen}"


def node_addresses(record: Resource) -> list[str]:
    """InternalIP addresses of a CiliumNode record, in order; invalid ones skipped."""
    out = []
    for entry in (record.get("spec") or {}).get("addresses") or []:
        if isinstance(entry, dict) and entry.get("type") == "InternalIP":
            try:
                out.append(str(ipaddress.ip_address(str(entry.get("ip")))))
            except ValueError:
                continue
    return out


def host_ip(addresses: list[str]) -> str:
    """The address pods of a node are reached through: its first IPv4 InternalIP, else its
    first InternalIP, else ""."""
    for address in addresses:
        if ipaddress.ip_address(address).version == 4:
            return address
    return addresses[0] if addresses else ""


APISERVER_NAMESPACE = "default"
APISERVER_SERVICE = "kubernetes"
"""The Service kube-apiserver keeps for itself (``default/kubernetes``); the ready
addresses of its EndpointSlices are the API server's addresses."""
_SERVICE_NAME_LABEL = "kubernetes.io/service-name"

# claim priority: (endpoint=2 / API server=1 / node=0, resourceVersion)
_Claim = tuple[int, int]
_ENDPOINT, _APISERVER, _NODE = 2, 1, 0


def apiserver_addresses(record: Resource) -> list[str]:
    """The API server's addresses an EndpointSlice lists: its ready endpoints' addresses,
    in order, when it is a slice of ``default/kubernetes`` (else []); addresses that are
    not IPs (``addressType: FQDN``) are skipped."""
    meta = record.get("metadata") or {}
    labels = meta.get("labels") or {}
    if (meta.get("namespace") or "default") != APISERVER_NAMESPACE or labels.get(
        _SERVICE_NAME_LABEL
    ) != APISERVER_SERVICE:
        return []
    out = []
    for endpoint in record.get("endpoints") or []:
        if not isinstance(endpoint, dict):
            continue
        if (endpoint.get("conditions") or {}).get("ready") is False:
            continue
        for address in endpoint.get("addresses") or []:
            try:
                out.append(str(ipaddress.ip_address(str(address))))
            except ValueError:
                continue
    return out


class IPCache:
    """Incremental ipcache; see the module docstring."""

    def __init__(self) -> None:
        self.nodes: dict[str, list[str]] = {}
        self.endpoints: dict[str, tuple[Endpoint, int]] = {}  # owner -> (endpoint, rv)
        self._by_node: dict[str, set[str]] = {}
        self._claims: dict[str, dict[str, _Claim]] = {}  # cidr -> claimant -> priority
        self.slices: dict[str, list[str]] = {}  # namespace/name -> API server addresses
        self._node_of: dict[str, str] = {}  # node address cidr -> node name

    # -- claims -------------------------------------------------------------------------

    def _claim(self, cidr: str, claimant: str, claim: _Claim) -> None:
        self._claims.setdefault(cidr, {})[claimant] = claim

    def _unclaim(self, cidr: str, claimant: str) -> None:
        claims = self._claims.get(cidr)
        if claims is not None:
            claims.pop(claimant, None)
            if not claims:
                del self._claims[cidr]

    def entry(self, cidr: str) -> Entry | None:
        """The effective entry of ``cidr`` (None when nothing claims it)."""
        claims = self._claims.get(cidr)
        if not claims:
            return None
        claimant = max(claims, key=lambda c: (claims[c], c))
        kind, _, name = claimant.partition(":")
        if kind == "ep":
            endpoint, _ = self.endpoints[name]
            return Entry(
                cidr=cidr,
                identity=endpoint.identity,
                node_name=endpoint.node_name,
                host_ip=host_ip(self.nodes.get(endpoint.node_name, [])),
                owner=endpoint.owner,
            )
        if kind == "api":
            node = self._node_of.get(cidr, "")
            return Entry(cidr, KUBE_APISERVER, node, cidr.partition("/")[0] if node else "", "")
        return Entry(cidr, REMOTE_NODE_IDENTITY, name, cidr.partition("/")[0], "")

    def entries(self) -> dict[str, Entry]:
        """Every effective entry by cidr."""
        out = {}
        for cidr in self._claims:
            entry = self.entry(cidr)
            if entry is not None:
                out[cidr] = entry
        return out

    # -- nodes --------------------------------------------------------------------------

    def set_node(self, record: Resource) -> set[str]:
        """Add or update a CiliumNode; returns the cidrs that may have changed."""
        name = record["metadata"]["name"]
        dirty = self.delete_node(name)
        addresses = node_addresses(record)
        rv = int(resource_version(record) or 0)
        self.nodes[name] = addresses
        for address in addresses:
            cidr = _host_cidr(address)
            self._claim(cidr, f"node:{name}", (_NODE, rv))
            self._node_of[cidr] = name
            dirty.add(cidr)
        return dirty

    def delete_node(self, name: str) -> set[str]:
        """Remove a node; returns the cidrs that may have changed (its addresses and, as
        their host IP changes, its endpoints' addresses). Its endpoints stay."""
        dirty = set()
        for address in self.nodes.pop(name, []):
            cidr = _host_cidr(address)
            self._unclaim(cidr, f"node:{name}")
            if self._node_of.get(cidr) == name:
                del self._node_of[cidr]
            dirty.add(cidr)
        for owner in self._by_node.get(name, set()):
            dirty.add(_host_cidr(self.endpoints[owner][0].ipv4))
        return dirty

    def replace_nodes(self, records: Iterable[Resource]) -> set[str]:
        """Replace every node (after a relist); returns the cidrs that may have changed."""
        dirty: set[str] = set()
        listed = {r["metadata"]["name"]: r for r in records}
        for name in list(self.nodes):
            if name not in listed:
                dirty |= self.delete_node(name)
        for record in listed.values():
            dirty |= self.set_node(record)
        return dirty

    # -- endpoints ----------------------------------------------------------------------

    def set_endpoint(self, record: Resource) -> set[str]:
        """Add or update a CiliumEndpoint; returns the cidrs that may have changed."""
        endpoint = parse_endpoint(record)
        owner = owner_of(record)
        dirty = self.delete_endpoint(owner)
        if endpoint is None:
            return dirty
        rv = int(resource_version(record) or 0)
        self.endpoints[owner] = (endpoint, rv)
        self._by_node.setdefault(endpoint.node_name, set()).add(owner)
        cidr = _host_cidr(endpoint.ipv4)
        self._claim(cidr, f"ep:{owner}", (_ENDPOINT, rv))
        dirty.add(cidr)
        return dirty

    def delete_endpoint(self, owner: str) -> set[str]:
        """Remove the endpoint ``namespace/name``; returns the cidrs that may have changed."""
        old = self.endpoints.pop(owner, None)
        if old is None:
            return set()
        endpoint = old[0]
        members = self._by_node.get(endpoint.node_name)
        if members is not None:
            members.discard(owner)
            if not members:
                del self._by_node[endpoint.node_name]
        cidr = _host_cidr(endpoint.ipv4)
        self._unclaim(cidr, f"ep:{owner}")
        return {cidr}

    def replace_endpoints(self, records: Iterable[Resource]) -> set[str]:
        """Replace every endpoint (after a relist); returns the cidrs that may have changed."""
        dirty: set[str] = set()
        listed = {owner_of(record): record for record in records}
        for owner in list(self.endpoints):
            if owner not in listed:
                dirty |= self.delete_endpoint(owner)
        for record in listed.values():
            dirty |= self.set_endpoint(record)
        return dirty

    # -- API server (EndpointSlices of default/kubernetes) --------------------------------

    def set_slice(self, record: Resource) -> set[str]:
        """Add or update an EndpointSlice (any; only ``default/kubernetes``'s count);
        returns the cidrs that may have changed."""
        key = owner_of(record)
        dirty = self.delete_slice(key)
        addresses = apiserver_addresses(record)
        if not addresses:
            return dirty
        rv = int(resource_version(record) or 0)
        self.slices[key] = addresses
        for address in addresses:
            cidr = _host_cidr(address)
            self._claim(cidr, f"api:{key}", (_APISERVER, rv))
            dirty.add(cidr)
        return dirty

    def delete_slice(self, key: str) -> set[str]:
        """Remove the EndpointSlice ``namespace/name``; returns the cidrs that may have
        changed."""
        dirty = set()
        for address in self.slices.pop(key, []):
            cidr = _host_cidr(address)
            self._unclaim(cidr, f"api:{key}")
            dirty.add(cidr)
        return dirty

    def replace_slices(self, records: Iterable[Resource]) -> set[str]:
        """Replace every EndpointSlice (after a relist); returns the cidrs that may have
        changed."""
        dirty: set[str] = set()
        listed = {owner_of(record): record for record in records}
        for key in list(self.slices):
            if key not in listed:
                dirty |= self.delete_slice(key)
        for record in listed.values():
            dirty |= self.set_slice(record)
        return dirty
