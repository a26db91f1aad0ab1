"""What a pool edit does, and whether it is safe: used by ``apply`` (and its dry run)
and by ``cilia-operator ipam plan``.

Rules (Cilia's, stricter than upstream which accepts these edits silently, gh-issue
26966; reference: cilium-upstream.md §1):

- adding CIDRs takes effect at once;
- a removed CIDR becomes *draining* (``status.drainingCIDRs``): no new blocks come from
  it, nodes keep the blocks they hold, the operator drops it once no block inside is
  held; re-adding the same CIDR ends the draining;
- a pool CIDR may not overlap another pool's CIDRs or draining CIDRs, the service
  CIDRs (``--service-cluster-ip-range`` and the ``networking.k8s.io/v1 ServiceCIDR``
  objects, named in the message), or any network attached to any node
  (``status.localNetworks``, reported by the agents) -- the message names the node,
  the interface and the subnet;
- ``maskSize`` and ``allowFirstIP``/``allowLastIP`` are immutable (checked in
  :mod:`cilia_operator.manifests`); deleting a pool some node holds blocks of is refused.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..errors import FieldError
from .pool import ROUTER_IPS_PER_NODE, PoolSpec, pods_per_node, usable_per_block

__all__ = [
    "ROUTER_IPS_PER_NODE",
    "NodeNetworks",
    "Plan",
    "PoolChange",
    "overlap_errors",
    "plan_numbers",
    "plan_pool_change",
    "pods_per_node",
    "usable_per_block",
]

Net = ipaddress.IPv4Network


@dataclass(frozen=True)
class NodeNetworks:
    """One node's attached networks and the blocks it holds (any pool).

    Attributes:
        node: node name; networks: ``(interface, subnet)``; held: blocks the node holds
            (a local network inside one of them is the node's own pod network, not a
            clash).
    """

    node: str
    networks: tuple[tuple[str, Net], ...]
    held: tuple[Net, ...] = ()


@dataclass
class PoolChange:
    """The outcome of editing one pool.

    Attributes:
        errors: reasons the edit is refused (empty: allowed).
        effects: one line per effect, e.g.
            ``node n1: pool blue CIDR 10.1.0.0/24 would start draining (block 10.1.0.0/26
            stays in use, no new blocks)``.
        draining: the pool's ``status.drainingCIDRs`` after the edit.
    """

    errors: list[FieldError] = field(default_factory=list)
    effects: list[str] = field(default_factory=list)
    draining: list[Net] = field(default_factory=list)


def overlap_errors(
    cidrs: Sequence[Net],
    *,
    indexes: Sequence[int] | None = None,
    service_cidrs: Iterable[Net] = (),
    node_networks: Iterable[NodeNetworks] = (),
    named_service_cidrs: Iterable[tuple[str, Net]] = (),
) -> list[FieldError]:
    """Errors for every CIDR of ``cidrs`` overlapping a service CIDR or a node network.

    Args:
        cidrs: the CIDRs to check; indexes: their positions in ``spec.ipv4.cidrs``
            (default 0..n-1) for the field path.
        service_cidrs: ``--service-cluster-ip-range``; named_service_cidrs: ``(name,
            network)`` of the ``networking.k8s.io/v1 ServiceCIDR`` objects beyond it (the
            message names the ServiceCIDR).

    Each node message names the node, interface and subnet: ``192.168.10.0/23 overlaps
    node 'n1' interface eth1 subnet 192.168.10.0/24``.
    """
    errors = []
    idx = list(indexes) if indexes is not None else list(range(len(cidrs)))
    services = list(service_cidrs)
    named = list(named_service_cidrs)
    all_nodes = list(node_networks)
    for i, net in zip(idx, cidrs, strict=True):
        path = f"spec.ipv4.cidrs[{i}]"
        for svc in services:
            if net.overlaps(svc):
                errors.append(
                    FieldError(
                        path, f"{net} overlaps the service CIDR {svc} (--service-cluster-ip-range)"
                    )
                )
        for svc_name, svc in named:
            if net.overlaps(svc):
                errors.append(FieldError(path, f"{net} overlaps ServiceCIDR {svc_name!r} {svc}"))
        for node in all_nodes:
            for iface, subnet in node.networks:
                if not net.overlaps(subnet):
                    continue
                if any(subnet.subnet_of(b) for b in node.held):
                    continue
                errors.append(
                    FieldError(
                        path,
                        f"{net} overlaps node {node.node!r} interface {iface} subnet {subnet} "
                        "(a network attached to the node: its addresses would be answered "
                        "by the pod network)",
                    )
                )
    return errors


def plan_pool_change(
    new: PoolSpec,
    stored: PoolSpec | None,
    holdings: Mapping[str, Sequence[tuple[str, Net]]],
    *,
    service_cidrs: Iterable[Net] = (),
    node_networks: Iterable[NodeNetworks] = (),
    named_service_cidrs: Iterable[tuple[str, Net]] = (),
) -> PoolChange:
    """Check and describe the edit of pool ``new.name`` from ``stored`` (None: created).

    Args:
        new: the pool as the manifest gives it.
        stored: the pool in the store now (with its draining CIDRs).
        holdings: node -> ``(pool, block)`` every node holds now.
        service_cidrs / node_networks / named_service_cidrs: what no new pool CIDR may
            overlap (see :func:`overlap_errors`).

    Returns:
        errors (overlaps with services/node networks/own draining CIDRs), effects per
        node and the pool's draining CIDRs after the edit.
    """
    change = PoolChange()
    name = new.name
    old_cidrs = list(stored.cidrs) if stored else []
    old_draining = list(stored.draining) if stored else []
    fresh = [(i, c) for i, c in enumerate(new.cidrs) if c not in old_cidrs]
    brand_new = [(i, c) for i, c in fresh if c not in old_draining]
    change.errors += overlap_errors(
        [c for _, c in brand_new],
        indexes=[i for i, _ in brand_new],
        service_cidrs=service_cidrs,
        node_networks=node_networks,
        named_service_cidrs=named_service_cidrs,
    )
    for i, cidr in brand_new:
        for d in old_draining:
            if cidr.overlaps(d):
                change.errors.append(
                    FieldError(
                        f"spec.ipv4.cidrs[{i}]",
                        f"{cidr} overlaps draining CIDR {d} of this pool: re-add {d} exactly "
                        "or wait until it is released",
                    )
                )
    usable = usable_per_block(new.mask_size, new.allow_first_ip, new.allow_last_ip)
    pods = pods_per_node(new.mask_size, new.allow_first_ip, new.allow_last_ip)
    if stored is None and pods == 0:
        change.effects.append(
            f"pool {name}: created with {new.blocks_total()} blocks of /{new.mask_size} "
            f"({usable} pod IP each: single-address blocks, one per pod)"
        )
    elif stored is None:
        change.effects.append(
            f"pool {name}: created with {new.blocks_total()} blocks of /{new.mask_size} "
            f"({pods} pod IPs each: {usable} usable, the agent's router IP takes one)"
        )
    for _, cidr in fresh:
        blocks = 1 << max(0, new.mask_size - cidr.prefixlen)
        if cidr in old_draining:
            change.effects.append(f"pool {name}: CIDR {cidr} re-added: stops draining")
        elif stored is not None:
            change.effects.append(
                f"pool {name}: CIDR {cidr} added: {blocks} new /{new.mask_size} blocks "
                "available at once"
            )
    removed = [c for c in old_cidrs if c not in new.cidrs]
    draining = [d for d in old_draining if d not in new.cidrs] + removed
    change.draining = draining
    for cidr in removed:
        users = sorted(
            (node, block)
            for node, held in holdings.items()
            for pool, block in held
            if pool == name and block.subnet_of(cidr)
        )
        if not users:
            change.effects.append(
                f"pool {name}: CIDR {cidr} removed: no node holds a block in it (released at once)"
            )
        for node, block in users:
            change.effects.append(
                f"node {node}: pool {name} CIDR {cidr} would start draining (block {block} "
                "stays in use, no new blocks from it; released when the node hands it back)"
            )
    return change


@dataclass(frozen=True)
class Plan:
    """``cilia-operator ipam plan`` numbers for one pool shape.

    Attributes:
        blocks: node blocks of ``/mask_size`` the CIDRs hold.
        usable_per_block: addresses of one block pods could use (first/last reserved
            unless allowed), as upstream counts them.
        total_usable: ``blocks * usable_per_block``.
        pods_per_node: pod addresses of a node holding one block: ``usable_per_block``
            minus the agent's router IP (:data:`ROUTER_IPS_PER_NODE`).
        pods_total: ``blocks * pods_per_node`` (every block on its own node).
    """

    blocks: int
    usable_per_block: int
    total_usable: int
    pods_per_node: int = 0
    pods_total: int = 0


def plan_numbers(cidrs: Sequence[Net], mask_size: int, allow_first: bool, allow_last: bool) -> Plan:
    """Node blocks the CIDRs give, pod IPs per block and in total.

    Raises:
        ValueError: ``mask_size`` is shorter than a CIDR's prefix or not in 1..32.
    """
    if not 1 <= mask_size <= 32:
        raise ValueError(f"--mask-size: {mask_size} is not in 1..32")
    for cidr in cidrs:
        if mask_size < cidr.prefixlen:
            raise ValueError(
                f"--mask-size: {mask_size} is shorter than the prefix of {cidr} "
                f"(must be >= {cidr.prefixlen})"
            )
    blocks = sum(1 << (mask_size - c.prefixlen) for c in cidrs)
    per = usable_per_block(mask_size, allow_first, allow_last)
    pods = pods_per_node(mask_size, allow_first, allow_last)
    return Plan(blocks, per, blocks * per, pods, blocks * pods)
