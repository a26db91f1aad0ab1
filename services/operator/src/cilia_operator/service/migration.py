"""The plan of a ServiceCIDR migration (``cilia-operator servicecidr migrate --to CIDR
--dry-run``; issue 13 item 4). Only the plan is built: nothing here writes.

The migration it describes moves every Service to an address in a new range while the old
address keeps working: each Service gets its new ClusterIP and keeps the old one as an
alias (``Service.alias_ips`` of the WatchServices contract), which the agents serve like the
ClusterIP until connection tracking shows no use of it for a grace period; then the alias
is dropped and the old ServiceCIDRs, marked terminating at the start, are released.

New addresses keep the offset in the range where they can (``10.96.0.10`` in
``10.96.0.0/12`` becomes ``10.100.0.10`` in ``10.100.0.0/16``), so the cluster DNS address
stays recognisable; a Service whose offset does not fit or is taken gets the first free
address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..store import Resource
from . import model

Net = ipaddress.IPv4Network
Addr = ipaddress.IPv4Address

DNS_SERVICES = (("kube-system", "kube-dns"), ("kube-system", "coredns"))
"""Names the cluster DNS Service goes by (kubeadm's ``kube-dns``, Deckhouse's and others'
``coredns``); a Service labelled ``k8s-app: kube-dns`` counts too."""


class MigrationRefused(ValueError):
    """The target range cannot take the Services (the message says why)."""


@dataclass(frozen=True)
class Move:
    """One Service's move: ``service`` ``ns/name``, ``old`` and ``new`` ClusterIP."""

    service: str
    old: Addr
    new: Addr
    kept_offset: bool


@dataclass
class Plan:
    """A migration plan: the ranges, every move, and the special cases in words."""

    target: Net
    cidr_name: str
    sources: list[tuple[str, Net, int]]  # (ServiceCIDR, range, Services in it)
    moves: list[Move] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self, grace: str) -> list[str]:
        """The plan as text lines; ``grace``: the alias grace period as the flag gives it."""
        out = ["ServiceCIDR migration plan (dry run: nothing was changed)"]
        for name, net, count in self.sources:
            out.append(f"  from: ServiceCIDR {name} {net} ({count} Service(s))")
        out.append(f"  to:   {self.target} as new ServiceCIDR {self.cidr_name} "
                   f"({max(0, self.target.num_addresses - 2)} addresses, "
                   f"{len(self.moves)} needed)")  # fmt: skip
        out += [
            "steps:",
            f"  1. create ServiceCIDR {self.cidr_name} (spec.cidrs [{self.target}]) and mark "
            "the old ServiceCIDRs terminating: new Services get addresses from the new range",
            "  2. give every Service its new ClusterIP; the old one stays an alias "
            "(WatchServices alias_ips) that every agent keeps serving:",
        ]
        width = max((len(m.service) for m in self.moves), default=0)
        for move in self.moves:
            how = "" if move.kept_offset else "  (offset taken or out of range: first free)"
            out.append(f"       {move.service:<{width}}  {move.old} -> {move.new}{how}")
        out += [
            f"  3. an alias is dropped once connection tracking shows no use of it for {grace}"
            " (--alias-grace-period); pods that still hold an old address in their "
            "configuration keep working until then, without a restart",
            "  4. the old ServiceCIDRs are released when their last alias is dropped",
        ]
        if self.notes:
            out.append("special cases:")
            out += [f"  - {n}" for n in self.notes]
        return out


def _service_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    return model.key_of(obj)


def plan_migration(
    services: Iterable[Resource], cidrs: Iterable[Resource], target: Net, cidr_name: str = ""
) -> Plan:
    """Plan moving every Service with an IPv4 ClusterIP into ``target``.

    Args:
        services / cidrs: the stored Service and ServiceCIDR records.
        target: the new range; cidr_name: its ServiceCIDR's name (default derived from it).

    Raises:
        MigrationRefused: ``target`` overlaps a current ServiceCIDR, or holds fewer usable
            addresses than there are Services to move.
    """
    stored = list(cidrs)
    ranges = [
        (str((c.get("metadata") or {}).get("name") or ""), n)
        for c in stored
        for n in model.cidr_networks(c)
    ]
    for name, net in ranges:
        if net.overlaps(target):
            raise MigrationRefused(f"{target} overlaps ServiceCIDR {name} {net}: migrate to a "
                                   "range no ServiceCIDR covers")  # fmt: skip
    movable = sorted(
        ((_service_key(s), s, model.service_ips(s)[0]) for s in services if model.service_ips(s)),
        key=lambda t: t[0],
    )
    usable = max(0, target.num_addresses - 2)
    if len(movable) > usable:
        raise MigrationRefused(f"{target} has {usable} usable addresses but {len(movable)} "
                               "Services need one")  # fmt: skip
    name = cidr_name or "migrated-" + str(target).replace(".", "-").replace("/", "-")
    counts = {(n, net): 0 for n, net in ranges}
    taken: set[Addr] = set()
    wanted: list[tuple[str, Resource, Addr, Addr | None]] = []
    for key, obj, ip in movable:
        home = next(((n, net) for n, net in ranges if ip in net), None)
        candidate = None
        if home is not None:
            counts[home] += 1
            offset = int(ip) - int(home[1].network_address)
            if 0 < offset < target.num_addresses - 1:
                candidate = Addr(int(target.network_address) + offset)
        wanted.append((f"{key[0]}/{key[1]}", obj, ip, candidate))
    # offsets first (in name order), then the rest from the start of the range
    plan = Plan(target, name, [(n, net, c) for (n, net), c in counts.items()])
    chosen: dict[str, tuple[Addr, bool]] = {}
    for display, _, _, candidate in wanted:
        if candidate is not None and candidate not in taken:
            taken.add(candidate)
            chosen[display] = (candidate, True)
    free = (Addr(int(target.network_address) + i) for i in range(1, target.num_addresses - 1))
    for display, _, _, _ in wanted:
        if display not in chosen:
            address = next(a for a in free if a not in taken)
            taken.add(address)
            chosen[display] = (address, False)
    for display, obj, ip, _ in wanted:
        new, kept = chosen[display]
        plan.moves.append(Move(display, ip, new, kept))
        plan.notes += _special(obj, display, ip, new)
    return plan


def _special(obj: Resource, display: str, old: Addr, new: Addr) -> list[str]:
    key = _service_key(obj)
    if key in DNS_SERVICES or model.labels_of(obj).get("k8s-app") == "kube-dns":
        return [
            f"cluster DNS {display}: pods keep {old} in /etc/resolv.conf and are served "
            f"through the alias until the grace period ends; set the kubelets' "
            f"--cluster-dns (clusterDNS) to {new} so new pods use the new address, and "
            "restart no pod: old ones keep working while they use the alias"
        ]
    if key == ("default", "kubernetes"):
        return [
            f"{display}: with --store kubernetes kube-apiserver owns this Service (its "
            "ClusterIP is the first address of the API server's --service-cluster-ip-range) "
            "and Cilia cannot move it: change the API server's flag (it then re-creates the "
            f"Service in the new range); Cilia keeps serving {old} as an alias of the new "
            "address from the datapath, so pods and agents holding the old API address keep "
            "reaching the API server. Standalone it moves like any Service"
        ]
    return []
