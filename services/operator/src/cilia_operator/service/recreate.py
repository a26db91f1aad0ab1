"""A ServiceCIDR migration on a Kubernetes cluster (``cilia-operator servicecidr migrate
--kubernetes``): the pure parts -- which ranges the target may not overlap, the Service
re-created in the new range, the EndpointSlice copies that keep it served meanwhile, and
the plan in words. The steps that write are in :mod:`cilia_operator.cli.servicecidr_k8s`.

Why re-create: a Service's ``spec.clusterIP`` is immutable in Kubernetes (the API server
refuses the update), so a Service moves by being deleted and created again with the same
name, labels, annotations and spec (ports, selector, nodePorts, session affinity, traffic
policies) and ``clusterIP`` set to its new address. kube-controller-manager then writes
its EndpointSlices again. Between the delete and those new slices the agents would find
the old address unserved; two things close that gap (:mod:`cilia_operator.controlplane.
service`, "re-creation hold"):

1. before the delete, each EndpointSlice of the Service is copied (:func:`copy_slices`):
   no ownerReferences (the garbage collector deletes the originals with the Service, not
   the copies), ``endpointslice.kubernetes.io/managed-by: servicecidr-migration.cilia.io``
   (kube-controller-manager leaves slices of other managers alone) and the old ClusterIP
   in ``service.cilia.io/migrating-from``. While a copy exists the operator holds the
   Service's deletion and serves the old address as an alias of the re-created Service;
2. the re-created Service carries the old ClusterIP in ``service.cilia.io/alias-ips``
   (:func:`recreated`), which every agent serves like the ClusterIP until the alias is
   released; then the copies are deleted.

Aliases are released as in standalone mode (:mod:`.aliases`): each node reports the last
use of every alias (CiliaServiceAliasUse records); an alias idle for the grace period is
removed from its Service. The old ServiceCIDRs are deleted at the start (Kubernetes keeps
a terminating ServiceCIDR while a ClusterIP is in it and allocates nothing from it) and
carry :data:`ALIAS_FINALIZER` until their last alias is released.
"""

from __future__ import annotations

import copy
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..store import Resource
from . import migration, model

Net = ipaddress.IPv4Network
Addr = ipaddress.IPv4Address

KUBERNETES_SERVICE = ("default", "kubernetes")
"""The API server's own Service: kube-apiserver re-creates it, with the first address of its
``--service-cluster-ip-range``, when it is deleted."""
ALIAS_FINALIZER = "cilia.io/service-aliases"
"""Finalizer the migration keeps on an old ServiceCIDR until no alias in it is served."""
COPY_SUFFIX = "-cilia-migration"
"""Name suffix of an EndpointSlice copy: ``<slice name>-cilia-migration``."""
RECORD_KIND = migration.KIND
RECORD_NAME = migration.NAME

#: status.phase of a Kubernetes-mode record, in order.
PHASES = ("Moving", "AwaitingAPIServer", "Aliased", "Done")

# Fields of a Service's metadata/spec that belong to the object that is deleted, not to
# the one created in its place.
_META_DROP = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields",
              "selfLink", "deletionTimestamp", "deletionGracePeriodSeconds", "ownerReferences")  # fmt: skip
_LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def node_addresses(nodes: Iterable[Mapping[str, Any]]) -> list[tuple[str, Addr]]:
    """``(node name, address)`` of every IPv4 InternalIP/ExternalIP of the Nodes."""
    out = []
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name") or "")
        for a in (node.get("status") or {}).get("addresses") or []:
            if a.get("type") not in ("InternalIP", "ExternalIP"):
                continue
            try:
                out.append((name, Addr(str(a.get("address")))))
            except ValueError:
                continue
    return out


def pod_ranges(
    nodes: Iterable[Mapping[str, Any]],
    cilium_nodes: Iterable[Mapping[str, Any]],
    pools: Iterable[Mapping[str, Any]],
) -> list[tuple[str, Net]]:
    """Every pod range of the cluster as ``(what, CIDR)``: Nodes' ``spec.podCIDRs``,
    CiliumNodes' ``spec.ipam.podCIDRs`` and the CiliumPodIPPools' CIDRs."""
    out: list[tuple[str, Net]] = []

    def add(what: str, text: object) -> None:
        try:
            net = Net(str(text), strict=False)
        except ValueError:
            return
        if (what, net) not in out:
            out.append((what, net))

    for node in nodes:
        name = (node.get("metadata") or {}).get("name")
        for text in (node.get("spec") or {}).get("podCIDRs") or []:
            add(f"node {name} podCIDR", text)
    for cn in cilium_nodes:
        name = (cn.get("metadata") or {}).get("name")
        for text in ((cn.get("spec") or {}).get("ipam") or {}).get("podCIDRs") or []:
            add(f"CiliumNode {name} podCIDR", text)
    for name, net in migration.pool_ranges(pools):
        add(f"pod pool {name!r}", net)
    return out


def check_target_k8s(
    target: Net,
    pod_nets: Sequence[tuple[str, Net]],
    node_ips: Sequence[tuple[str, Addr]],
    node_networks: Sequence[Net] = (),
) -> None:
    """Refuse a target that overlaps a pod range, holds a node's address or overlaps a
    node network given with ``--node-network``.

    Raises:
        migration.MigrationRefused: naming both.
    """
    migration.check_target(target)
    for what, net in pod_nets:
        if target.overlaps(net):
            raise migration.MigrationRefused(f"target {target} overlaps {what} {net}: pods and "
                                             "Services may not share addresses")  # fmt: skip
    for name, ip in node_ips:
        if ip in target:
            raise migration.MigrationRefused(f"target {target} holds node {name}'s address {ip}: "
                                             "choose a range outside the node network")  # fmt: skip
    for net in node_networks:
        if target.overlaps(net):
            raise migration.MigrationRefused(f"target {target} overlaps the node network {net} "
                                             "(--node-network)")  # fmt: skip


def plan_k8s(
    services: Sequence[Resource],
    cidrs: Sequence[Resource],
    target: Net,
    cidr_name: str,
) -> tuple[migration.Plan, Resource | None]:
    """The moves of every Service but ``default/kubernetes`` (:func:`migration.plan_migration`
    with the target's first address kept for it: the API server gives it that one), and the
    ``kubernetes`` Service (None when absent or already in the target).

    Raises:
        migration.MigrationRefused: as :func:`migration.plan_migration`.
    """
    api = next((s for s in services if model.key_of(s) == KUBERNETES_SERVICE), None)
    others = [s for s in services if model.key_of(s) != KUBERNETES_SERVICE]
    placeholder: Resource = {"metadata": {"namespace": "default", "name": "kubernetes"},
                             "spec": {"clusterIP": str(target[1])}}  # fmt: skip
    plan = migration.plan_migration([*others, placeholder], cidrs, target, cidr_name)
    if api is not None:
        ips = model.service_ips(api)
        if ips and ips[0] in target:
            api = None
    return plan, api


def plan_lines(plan: migration.Plan, api: Resource | None, grace: str, dry_run: bool) -> list[str]:
    """The plan in words (``grace``: ``--alias-grace-period`` as given, "" = 1h)."""
    head = "dry run: nothing was changed" if dry_run else "executing"
    out = [f"ServiceCIDR migration plan, Kubernetes mode ({head})"]
    for name, net, count in plan.sources:
        out.append(f"  from: ServiceCIDR {name} {net} ({count} Service(s) to move)")
    out.append(f"  to:   {plan.target} as new ServiceCIDR {plan.cidr_name}")
    out += [
        "steps:",
        f"  1. create ServiceCIDR {plan.cidr_name} and delete the old ones: Kubernetes keeps "
        "them (terminating, nothing new allocated from them) while a ClusterIP is in them, "
        f"and Cilia (finalizer {ALIAS_FINALIZER}) while an alias in them is served",
        "  2. re-create each Service with the same name and spec in the new range (ClusterIP "
        "is immutable); its EndpointSlices are copied first so every agent keeps serving it, "
        "and its old ClusterIP stays an alias (TCP, UDP, DNS) on every node:",
    ]
    width = max((len(m.service) for m in plan.moves), default=0)
    for move in plan.moves:
        how = "" if move.kept_offset else "  (offset taken or out of range: first free)"
        out.append(f"       {move.service:<{width}}  {move.old} -> {move.new}{how}")
    if api is not None:
        old = model.service_ips(api)
        out += [
            f"  3. default/kubernetes ({old[0] if old else '?'}) belongs to kube-apiserver: "
            f"set --service-cluster-ip-range={plan.target} on every API server (and "
            "kube-controller-manager), add the new address to the API server certificate, "
            "then run this command again with --apiserver-updated: it re-creates the Service "
            f"(the API server gives it {plan.target[1]}) and keeps the old address an alias",
        ]
    out += [
        "  4. an alias is released once no node used it for "
        + (f"{grace} (--alias-grace-period)" if grace else "1h (--alias-grace-period)")
        + "; pods keep their old addresses (KUBERNETES_SERVICE_HOST, resolv.conf) working "
        "until then, without a restart",
        "  5. the old ServiceCIDRs go once their last alias is released",
    ]
    notes = [n for n in plan.notes if "default/kubernetes" not in n]
    if notes:
        out.append("special cases:")
        out += [f"  - {n}" for n in notes]
    return out


def recreated(service: Resource, new: Addr, aliases: Mapping[Addr, str]) -> Resource:
    """The Service to create in place of ``service``: same name, labels, annotations and
    spec, ``clusterIP``/``clusterIPs`` ``new``, ``aliases`` in :data:`model.ALIAS_ANNOTATION`
    (merged with the ones it had). nodePorts and healthCheckNodePort are kept (the old
    Service's are free again once it is deleted)."""
    out: Resource = copy.deepcopy(dict(service))
    meta = out.setdefault("metadata", {})
    for key in _META_DROP:
        meta.pop(key, None)
    (meta.get("annotations") or {}).pop(_LAST_APPLIED, None)
    (meta.get("annotations") or {}).pop(model.MIGRATING_TO_ANNOTATION, None)
    out.pop("status", None)
    out["apiVersion"], out["kind"] = "v1", "Service"
    spec = out.setdefault("spec", {})
    spec["clusterIP"] = str(new)
    spec["clusterIPs"] = [str(new)]
    return model.with_aliases(out, {**model.alias_ips(service), **aliases})


def copy_slices(slices: Iterable[Resource], old: Addr) -> list[Resource]:
    """The migration copies of a Service's EndpointSlices (module docstring, 1.): same
    namespace, addressType, ports and endpoints; name ``<name>`` + :data:`COPY_SUFFIX`;
    labels ``kubernetes.io/service-name`` and the migration's managed-by; no owners."""
    out = []
    for obj in slices:
        if model.migration_slice(obj):
            continue
        meta = obj.get("metadata") or {}
        out.append({
            "apiVersion": model.SLICE_API_VERSION, "kind": model.SLICE_KIND,
            "metadata": {
                "name": f"{meta.get('name')}{COPY_SUFFIX}"[:253],
                "namespace": meta.get("namespace"),
                "labels": {model.SERVICE_NAME_LABEL: model.labels_of(obj)[model.SERVICE_NAME_LABEL],
                           model.MANAGED_BY_LABEL: model.MIGRATION_MANAGED_BY},
                "annotations": {model.MIGRATING_FROM_ANNOTATION: str(old)},
            },
            "addressType": obj.get("addressType") or "IPv4",
            "ports": copy.deepcopy(obj.get("ports") or []),
            "endpoints": copy.deepcopy(obj.get("endpoints") or []),
        })  # fmt: skip
    return out


def ready_endpoints(slices: Iterable[Resource]) -> set[str]:
    """Addresses of the ready endpoints of ``slices`` (``ready`` absent means true)."""
    out: set[str] = set()
    for obj in slices:
        for ep in obj.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready", True) is not False:
                out.update(str(a) for a in ep.get("addresses") or [])
    return out
