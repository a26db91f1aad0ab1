"""What kube-apiserver's Service registry does on a write, as one step of ``apply``'s store
transaction: defaults, immutable fields, ClusterIP and NodePort allocation, and the checks
of ServiceCIDR documents.

:func:`prepare` runs inside :meth:`Store.transact` on a snapshot of Services, ServiceCIDRs,
EndpointSlices and pools. With the Redis store the transaction writes only if none of those
kinds changed since the snapshot, so two concurrent applies can never be given the same
ClusterIP or NodePort (the second one is planned again on a fresh snapshot).

ClusterIP allocation (upstream MultiCIDRServiceAllocator, ``pkg/registry/core/service/
ipallocator``): the ranges are the ServiceCIDRs that are not being deleted -- the default
one ``kubernetes`` (``--service-cluster-ip-range``) first, then the others by name; a range
whose usable addresses (all but the network and broadcast addresses) are all held is
skipped, so allocation moves on to the next range. Within a range the search starts at a
random offset. A ``spec.clusterIP`` given in the manifest is honoured when it is inside a
range that is not being deleted, is not the network or broadcast address, and no other
Service holds it (the message names that Service). ``spec.clusterIP`` is immutable.

NodePorts (``--service-node-port-range``, default 30000-32767): a NodePort or LoadBalancer
Service's port without ``nodePort`` gets a free one (random start); a given one must be in
the range and not used by another Service's port of the same protocol; an update keeps the
NodePort a port had.
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import FieldError
from ..store import ListResult, Resource
from . import model

Net = ipaddress.IPv4Network
Addr = ipaddress.IPv4Address

DEFAULT_NODE_PORT_RANGE = (30000, 32767)


@dataclass(frozen=True)
class ServiceSettings:
    """The operator's Service settings.

    Attributes:
        service_cidrs: ``--service-cluster-ip-range``: the default ServiceCIDR
            ``kubernetes`` when no record of that name is stored.
        node_port_range: ``--service-node-port-range`` (first, last), inclusive.
        allocate: standalone (True): defaults and allocation are the operator's; with
            ``--store kubernetes`` (False) the API server does them and this step only
            keeps the stored ClusterIP/NodePorts of an updated Service (the API server
            refuses an update that drops them).
        pod_cidrs: ``--cluster-pool-ipv4-cidr`` (a ServiceCIDR may not overlap them).
    """

    service_cidrs: tuple[Net, ...] = ()
    node_port_range: tuple[int, int] = DEFAULT_NODE_PORT_RANGE
    allocate: bool = True
    pod_cidrs: tuple[Net, ...] = ()


@dataclass(frozen=True)
class ServiceDoc:
    """One Service/ServiceCIDR/EndpointSlice document of a manifest, as :func:`prepare`
    needs it: ``obj`` is changed in place (defaults, allocations)."""

    index: int
    kind: str
    namespace: str
    name: str
    obj: dict[str, Any]


@dataclass(frozen=True)
class PoolRanges:
    """A pod pool's CIDRs (current and draining) for the ServiceCIDR overlap check."""

    name: str
    cidrs: tuple[Net, ...]


@dataclass
class _Ranges:
    """The allocatable ServiceCIDRs and what is held, while one manifest is planned."""

    active: list[tuple[str, Net]]
    terminating: list[tuple[str, Net]]
    holders: dict[Addr, str] = field(default_factory=dict)  # ip -> "ns/name"
    node_ports: dict[tuple[int, str], str] = field(default_factory=dict)


def _items(snapshot: Mapping[str, ListResult], kind: str) -> list[Resource]:
    listed = snapshot.get(kind)
    return list(listed.items) if listed is not None else []


def service_cidr_ranges(
    stored: Iterable[Resource], flag: Sequence[Net]
) -> tuple[list[tuple[str, Net]], list[tuple[str, Net]]]:
    """``(active, terminating)`` ``(ServiceCIDR name, network)`` pairs: the stored
    ServiceCIDRs plus the flag's ranges as ``kubernetes`` when no record of that name is
    stored (and no stored ServiceCIDR says it replaced them: a finished migration,
    :data:`model.MIGRATED_FROM_ANNOTATION`); the default one first, then by name."""
    active: list[tuple[str, Net]] = []
    terminating: list[tuple[str, Net]] = []
    records = {str((r.get("metadata") or {}).get("name") or ""): r for r in stored}
    if model.DEFAULT_CIDR_NAME not in records:
        replaced = model.migrated_from(records.values())
        active += [(model.DEFAULT_CIDR_NAME, n) for n in flag if n not in replaced]
    for name in sorted(records, key=lambda n: (n != model.DEFAULT_CIDR_NAME, n)):
        target = terminating if model.cidr_terminating(records[name]) else active
        target += [(name, n) for n in model.cidr_networks(records[name])]
    return active, terminating


def _usable(net: Net) -> int:
    return max(0, net.num_addresses - 2)


def _free_ip(net: Net, held: Mapping[Addr, str], rng: random.Random) -> Addr | None:
    size = _usable(net)
    if size == 0 or sum(1 for a in held if a in net) >= size:
        return None
    first = int(net.network_address) + 1
    start = rng.randrange(size)
    for step in range(size):
        candidate = Addr(first + (start + step) % size)
        if candidate not in held:
            return candidate
    return None


def _display(key: tuple[str, str]) -> str:
    return f"{key[0]}/{key[1]}"


def prepare(
    docs: Sequence[ServiceDoc],
    snapshot: Mapping[str, ListResult],
    settings: ServiceSettings,
    pools: Sequence[PoolRanges] = (),
    rng: random.Random | None = None,
) -> list[tuple[int, FieldError]]:
    """Check every Service/ServiceCIDR document against the store and the manifest, set the
    Service defaults and allocate ClusterIPs and NodePorts (in place, in ``doc.obj``).

    Args:
        docs: the manifest's Service, ServiceCIDR and EndpointSlice documents, in order.
        snapshot: the transaction's snapshot (kinds ``Service``, ``ServiceCIDR``,
            ``EndpointSlice``; a missing kind reads as empty).
        settings: :class:`ServiceSettings`.
        pools: every pod pool's ranges (stored, and applied in the same manifest).
        rng: random source of the search offsets (tests pass a seeded one).

    Returns:
        ``(document index, error)`` for every problem; empty when all may be written.
    """
    rng = rng or random.Random()
    errors: list[tuple[int, FieldError]] = []
    services = {model.key_of(o): o for o in _items(snapshot, model.SERVICE_KIND)}
    cidr_records = {
        str((o.get("metadata") or {}).get("name") or ""): o
        for o in _items(snapshot, model.CIDR_KIND)
    }
    manifest_keys = {(d.namespace, d.name) for d in docs if d.kind == model.SERVICE_KIND}
    active, terminating = service_cidr_ranges(cidr_records.values(), settings.service_cidrs)
    ranges = _Ranges(active, terminating)
    for key, obj in services.items():
        for ip in model.alias_ips(obj):  # kept across an update (see _keep_immutable)
            ranges.holders[ip] = _display(key)
        if key in manifest_keys:
            continue  # its new state is planned below
        for ip in [*model.service_ips(obj), *model.alias_ips(obj)]:
            ranges.holders[ip] = _display(key)
        for port in _node_ports(obj):
            ranges.node_ports[port] = _display(key)
    sliced = {model.slice_service(o) for o in _items(snapshot, model.SLICE_KIND)}
    sliced |= {model.slice_service(d.obj) for d in docs if d.kind == model.SLICE_KIND}
    for doc in docs:
        if doc.kind == model.CIDR_KIND:
            errors += [(doc.index, e) for e in _check_cidr(doc, cidr_records, settings, pools)]
    for doc in docs:
        if doc.kind != model.SERVICE_KIND:
            continue
        current = services.get((doc.namespace, doc.name))
        problems = _keep_immutable(doc.obj, current)
        if not problems:
            problems = _selectorless(doc, sliced)
        if not problems and settings.allocate:
            _defaults(doc.obj)
            problems = _allocate_ip(doc, current, ranges, rng) + _allocate_node_ports(
                doc, current, ranges, settings.node_port_range, rng
            )
        errors += [(doc.index, e) for e in problems]
    return errors


def _node_ports(obj: Mapping[str, Any]) -> list[tuple[int, str]]:
    out = []
    for port in (obj.get("spec") or {}).get("ports") or []:
        if isinstance(port, Mapping) and port.get("nodePort"):
            out.append((int(port["nodePort"]), str(port.get("protocol") or "TCP")))
    return out


def _keep_immutable(obj: dict[str, Any], current: Resource | None) -> list[FieldError]:
    """Carry the stored ClusterIP into an update that does not give one; refuse a change.
    The aliases a migration gave the Service (:data:`model.ALIAS_ANNOTATION`) are carried
    too: only the migration's release removes them."""
    if current is None:
        return []
    held = (current.get("metadata") or {}).get("annotations") or {}
    if model.ALIAS_ANNOTATION in held:
        annotations = obj.setdefault("metadata", {}).setdefault("annotations", {})
        annotations[model.ALIAS_ANNOTATION] = held[model.ALIAS_ANNOTATION]
    spec = obj.setdefault("spec", {})
    stored = (current.get("spec") or {}).get("clusterIP") or ""
    given = spec.get("clusterIP") or ""
    if given and stored and given != stored and spec.get("type") != "ExternalName":
        return [FieldError("spec.clusterIP", f"field is immutable ({stored} -> {given}): delete "
                           "the Service and apply it again to change its ClusterIP")]  # fmt: skip
    if stored and not given and spec.get("type") != "ExternalName":
        spec["clusterIP"] = stored
        spec["clusterIPs"] = list((current.get("spec") or {}).get("clusterIPs") or [stored])
    return []


def _selectorless(doc: ServiceDoc, sliced: set[tuple[str, str] | None]) -> list[FieldError]:
    """A Service without a selector needs its EndpointSlices: in the same manifest or
    stored, labelled ``kubernetes.io/service-name``."""
    spec = doc.obj.get("spec") or {}
    if spec.get("selector") or spec.get("type") == "ExternalName":
        return []
    if (doc.namespace, doc.name) in sliced:
        return []
    return [FieldError("spec.selector", (
        "a Service without a selector has no endpoints of its own: give spec.selector "
        "(the operator then keeps its EndpointSlices from the pods it selects), or apply "
        "its endpoints in the same manifest as a discovery.k8s.io/v1 EndpointSlice in "
        f"namespace {doc.namespace!r} labelled {model.SERVICE_NAME_LABEL}: {doc.name}"
    ))]  # fmt: skip


def _defaults(obj: dict[str, Any]) -> None:
    """Kubernetes' Service defaulting (``pkg/apis/core/v1/defaults.go``), IPv4 single stack."""
    spec = obj.setdefault("spec", {})
    kind = spec.setdefault("type", "ClusterIP")
    if kind == "ExternalName":
        return
    spec.setdefault("sessionAffinity", "None")
    if spec["sessionAffinity"] == "ClientIP":
        client = spec.setdefault("sessionAffinityConfig", {}).setdefault("clientIP", {})
        client.setdefault("timeoutSeconds", model.DEFAULT_AFFINITY_TIMEOUT)
    spec.setdefault("internalTrafficPolicy", "Cluster")
    if kind in ("NodePort", "LoadBalancer"):
        spec.setdefault("externalTrafficPolicy", "Cluster")
    for port in spec.get("ports") or []:
        port["protocol"] = port.get("protocol") or "TCP"
        if port.get("targetPort") in (None, 0, ""):
            port["targetPort"] = port["port"]
        if kind not in ("NodePort", "LoadBalancer"):
            port.pop("nodePort", None)
    if spec.get("clusterIP") != "None":
        spec["ipFamilies"] = ["IPv4"]
        spec["ipFamilyPolicy"] = "SingleStack"


def _allocate_ip(
    doc: ServiceDoc, current: Resource | None, ranges: _Ranges, rng: random.Random
) -> list[FieldError]:
    spec = doc.obj["spec"]
    me = _display((doc.namespace, doc.name))
    if spec.get("type") == "ExternalName" or spec.get("clusterIP") == "None":
        if spec.get("clusterIP") == "None":
            spec["clusterIPs"] = ["None"]
        return []
    given = spec.get("clusterIP") or ""
    held = ((current or {}).get("spec") or {}).get("clusterIP") or ""
    if given and given == held:
        # an update keeps the address it holds, even in a ServiceCIDR being deleted
        ip = Addr(given)
    elif given:
        ip = Addr(given)
        home = next(((n, net) for n, net in ranges.active if ip in net), None)
        if home is None:
            dying = next((n for n, net in ranges.terminating if ip in net), None)
            if dying is not None:
                reason = f"{ip} is in ServiceCIDR {dying!r}, which is being deleted"
            else:
                listed = ", ".join(f"{n} {net}" for n, net in ranges.active) or "none"
                reason = f"{ip} is outside every ServiceCIDR (ranges: {listed})"
            return [FieldError("spec.clusterIP", reason)]
        net = home[1]
        if ip in (net.network_address, net.broadcast_address) and net.prefixlen < 31:
            return [FieldError("spec.clusterIP", f"{ip} is the network or broadcast address "
                               f"of ServiceCIDR {home[0]!r} {net}")]  # fmt: skip
        holder = ranges.holders.get(ip)
        if holder is not None and holder != me:
            return [FieldError("spec.clusterIP", f"{ip} is already allocated to Service "
                               f"{holder}")]  # fmt: skip
    else:
        found = None
        for _, net in ranges.active:
            found = _free_ip(net, ranges.holders, rng)
            if found is not None:
                break
        if found is None:
            listed = ", ".join(f"{n} {net}" for n, net in ranges.active) or "none"
            return [FieldError("spec.clusterIP", "no address left in any ServiceCIDR "
                               f"({listed}): add a ServiceCIDR or free addresses")]  # fmt: skip
        ip = found
    spec["clusterIP"] = str(ip)
    spec["clusterIPs"] = [str(ip)]
    ranges.holders[ip] = me
    return []


def _allocate_node_ports(
    doc: ServiceDoc,
    current: Resource | None,
    ranges: _Ranges,
    span: tuple[int, int],
    rng: random.Random,
) -> list[FieldError]:
    spec = doc.obj["spec"]
    if spec.get("type") not in ("NodePort", "LoadBalancer"):
        return []
    me = _display((doc.namespace, doc.name))
    had = {
        (p.get("name") or "", p.get("protocol") or "TCP"): p.get("nodePort")
        for p in ((current or {}).get("spec") or {}).get("ports") or []
        if isinstance(p, Mapping) and p.get("nodePort")
    }
    low, high = span
    errors: list[FieldError] = []
    for i, port in enumerate(spec.get("ports") or []):
        protocol = port["protocol"]
        wanted = port.get("nodePort") or had.get((port.get("name") or "", protocol))
        path = f"spec.ports[{i}].nodePort"
        if wanted:
            holder = ranges.node_ports.get((wanted, protocol))
            if not low <= wanted <= high:
                errors.append(FieldError(path, f"{wanted} is outside --service-node-port-range "
                                         f"{low}-{high}"))  # fmt: skip
                continue
            if holder is not None and holder != me:
                errors.append(FieldError(path, f"{wanted}/{protocol} is already allocated to "
                                         f"Service {holder}"))  # fmt: skip
                continue
        else:
            size = high - low + 1
            start = rng.randrange(size)
            wanted = next(
                (low + (start + s) % size for s in range(size)
                 if (low + (start + s) % size, protocol) not in ranges.node_ports),
                None,
            )  # fmt: skip
            if wanted is None:
                errors.append(FieldError(path, f"no {protocol} NodePort left in "
                                         f"--service-node-port-range {low}-{high}"))  # fmt: skip
                continue
        port["nodePort"] = wanted
        ranges.node_ports[(wanted, protocol)] = me
    return errors


def _check_cidr(
    doc: ServiceDoc,
    stored: Mapping[str, Resource],
    settings: ServiceSettings,
    pools: Sequence[PoolRanges],
) -> list[FieldError]:
    current = stored.get(doc.name)
    nets = model.cidr_networks(doc.obj)
    if current is not None:
        if model.cidr_terminating(current):
            return [FieldError("metadata.name", f"ServiceCIDR {doc.name!r} is being deleted "
                               "(it is kept while Services hold addresses in it)")]  # fmt: skip
        if model.cidr_networks(current) != nets:
            return [FieldError("spec.cidrs", "field is immutable: create a new ServiceCIDR "
                               "and delete this one")]  # fmt: skip
    errors = []
    for i, net in enumerate(nets):
        for pool in pools:
            for cidr in pool.cidrs:
                if net.overlaps(cidr):
                    errors.append(FieldError(f"spec.cidrs[{i}]", (
                        f"ServiceCIDR {doc.name!r} {net} overlaps pod pool {pool.name!r} "
                        f"CIDR {cidr} (CiliumPodIPPool)"
                    )))  # fmt: skip
        for cidr in settings.pod_cidrs:
            if net.overlaps(cidr):
                errors.append(FieldError(f"spec.cidrs[{i}]", (
                    f"ServiceCIDR {doc.name!r} {net} overlaps the cluster-pool pod CIDR "
                    f"{cidr} (--cluster-pool-ipv4-cidr)"
                )))  # fmt: skip
    return errors


def named_service_cidrs(stored: Iterable[Resource], flag: Sequence[Net]) -> list[tuple[str, Net]]:
    """Every stored ServiceCIDR's ``(name, network)`` except the ranges already given by
    ``--service-cluster-ip-range`` (those are checked as the flag): for the pool-side
    overlap check."""
    out = []
    for obj in stored:
        name = str((obj.get("metadata") or {}).get("name") or "")
        out += [(name, n) for n in model.cidr_networks(obj) if n not in flag]
    return out


def cidr_holders(
    cidr: Resource, services: Iterable[Resource], others: Iterable[Resource]
) -> list[str]:
    """The Services (``ns/name``) holding an address (a ClusterIP or an alias of a
    migration, :func:`model.alias_ips`) in ServiceCIDR ``cidr`` that no other
    ServiceCIDR of ``others`` (not being deleted) also covers: what keeps a deleted
    ServiceCIDR terminating (upstream servicecidrs controller)."""
    nets = model.cidr_networks(cidr)
    name = (cidr.get("metadata") or {}).get("name")
    cover = [
        n
        for o in others
        if (o.get("metadata") or {}).get("name") != name and not model.cidr_terminating(o)
        for n in model.cidr_networks(o)
    ]
    out = []
    for svc in services:
        for ip in [*model.service_ips(svc), *model.alias_ips(svc)]:
            if any(ip in n for n in nets) and not any(ip in n for n in cover):
                out.append(_display(model.key_of(svc)))
                break
    return sorted(out)
