"""A ServiceCIDR migration (``cilia-operator servicecidr migrate --to CIDR [--dry-run]``;
issue 13 item 4): the plan, the record that drives it, and each step's writes.

Every Service moves to an address in a new range while its old address keeps working:
each Service gets its new ClusterIP and keeps the old one as an alias (annotation
``service.cilia.io/alias-ips``, sent to the agents as ``Service.alias_ips`` of the
WatchServices contract), which the agents serve like the ClusterIP until nothing has used
it for ``--service-alias-grace-period`` (:mod:`.aliases`: the socket load balancer of every
node reports when it last saw a connect/sendmsg to the alias); then the alias is dropped
and the old ServiceCIDRs, terminating since the start, are released once no ClusterIP
or alias holds an address in them.

New addresses keep the offset in the range where they can (``10.96.0.10`` in
``10.96.0.0/12`` becomes ``10.100.0.10`` in ``10.100.0.0/16``), so the cluster DNS address
stays recognisable; a Service whose offset does not fit or is taken gets the first free
address.

Execution (standalone store; the leader's Service controller runs it): the CLI applies
one record, kind :data:`KIND` ``cilia.io/v1alpha1``, name :data:`NAME`, ``spec.to`` the
target. Then, each step one store transaction over Services, ServiceCIDRs and the record
(``Store.transact``: with Redis it writes only if none of them changed since it read them,
so a Service applied meanwhile is planned again):

1. :func:`start_writes`: create the target ServiceCIDR (annotated with the ranges it
   replaces) and mark every other ServiceCIDR terminating; ``status.phase`` Moving;
2. :func:`move_writes`, once per Service: its new ClusterIP, the old one as alias, and its
   line in ``status.services`` -- in the same transaction, so the record never says a
   Service moved that did not (``status.phase`` Aliased when none is left);
3. :func:`release_writes`: aliases idle for the grace period are removed from their
   Service and marked released in the record; ``status.phase`` Done once every alias is
   released and the old ServiceCIDRs are gone.

Interrupted anywhere (operator restart, leader change), the next leader goes on from the
store: a Service already in the target range is not moved again, and the plan of the
rest is the same (it depends only on what is stored). Running ``migrate`` again with the
same target only follows the progress.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..addresses import special_ranges
from ..errors import FieldError, InvalidResource
from ..store import Resource, Write
from . import aliases, model

Net = ipaddress.IPv4Network
Addr = ipaddress.IPv4Address

KIND = "CiliaServiceCIDRMigration"
API_VERSION = "cilia.io/v1alpha1"
NAME = "servicecidr-migration"
"""The one migration record's name (one migration at a time)."""
POOL_KIND = "CiliumPodIPPool"

DNS_SERVICES = (("kube-system", "kube-dns"), ("kube-system", "coredns"))
"""Names the cluster DNS Service goes by (kubeadm's ``kube-dns``, Deckhouse's and others'
``coredns``); a Service labelled ``k8s-app: kube-dns`` counts too."""

#: status.phase values, in order; Failed: refused at the start (status.message says why).
PHASES = ("Pending", "Moving", "Aliased", "Done", "Failed")


class MigrationRefused(ValueError):
    """The target range cannot take the Services (the message says why, naming both
    ranges of an overlap)."""


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

    def lines(self, grace: str, dry_run: bool = True) -> list[str]:
        """The plan as text lines; ``grace``: the migration's alias grace period as the
        CLI's ``--alias-grace-period`` gave it (text), "" for the operator's default."""
        head = "dry run: nothing was changed" if dry_run else "executing"
        out = [f"ServiceCIDR migration plan ({head})"]
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
            "  3. an alias is dropped once connection tracking shows no use of it for "
            + (
                f"{grace} (--alias-grace-period)"
                if grace
                else "the operator's --service-alias-grace-period (default 1h)"
            )
            + "; pods that still hold an old address in their configuration keep working "
            "until then, without a restart",
            "  4. the old ServiceCIDRs are released when their last alias is dropped",
        ]
        if self.notes:
            out.append("special cases:")
            out += [f"  - {n}" for n in self.notes]
        return out


def _service_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    return model.key_of(obj)


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def default_cidr_name(target: Net) -> str:
    """The target ServiceCIDR's name when none is given: ``migrated-10-100-0-0-16``."""
    return "migrated-" + str(target).replace(".", "-").replace("/", "-")


def pool_ranges(pools: Iterable[Mapping[str, Any]]) -> list[tuple[str, Net]]:
    """``(pool name, CIDR)`` of stored CiliumPodIPPools (``spec.ipv4.cidrs`` and
    ``status.drainingCIDRs``); unparsable entries skipped."""
    out = []
    for obj in pools:
        spec = obj.get("spec") or {}
        raw = list((spec.get("ipv4") or {}).get("cidrs") or [])
        raw += list((obj.get("status") or {}).get("drainingCIDRs") or [])
        for text in raw:
            try:
                out.append((_name(obj), Net(str(text), strict=False)))
            except ValueError:
                continue
    return out


def check_target(
    target: Net,
    pools: Sequence[tuple[str, Net]] = (),
    pod_cidrs: Sequence[Net] = (),
) -> None:
    """Refuse a target range that overlaps a special-purpose range, a pod pool or the
    cluster-pool pod CIDR.

    Raises:
        MigrationRefused: naming the target and the range it overlaps.
    """
    for name, special in special_ranges(target)[:1]:
        raise MigrationRefused(f"target {target} overlaps the special-purpose range "
                               f"{special} ({name}): choose a private range")  # fmt: skip
    for name, cidr in pools:
        if target.overlaps(cidr):
            raise MigrationRefused(f"target {target} overlaps pod pool {name!r} CIDR {cidr} "
                                   "(CiliumPodIPPool): pods and Services may not share "
                                   "addresses")  # fmt: skip
    for cidr in pod_cidrs:
        if target.overlaps(cidr):
            raise MigrationRefused(f"target {target} overlaps the cluster-pool pod CIDR "
                                   f"{cidr} (--cluster-pool-ipv4-cidr)")  # fmt: skip


def plan_migration(
    services: Iterable[Resource],
    cidrs: Iterable[Resource],
    target: Net,
    cidr_name: str = "",
    *,
    pools: Sequence[tuple[str, Net]] = (),
    pod_cidrs: Sequence[Net] = (),
) -> Plan:
    """Plan moving every Service with an IPv4 ClusterIP outside ``target`` into it.

    Args:
        services / cidrs: the stored Service and ServiceCIDR records. The ServiceCIDR named
            ``cidr_name`` (the target's, once a migration started) is not a source.
        target: the new range; cidr_name: its ServiceCIDR's name (default derived from it).
        pools / pod_cidrs: pod ranges the target may not overlap (:func:`check_target`).

    Services already in ``target`` are not moved; their ClusterIPs and every alias in
    ``target`` are never chosen again (so the plan of what is left after an interruption
    is the plan's own remainder).

    Raises:
        MigrationRefused: ``target`` overlaps a current ServiceCIDR, a pod range or a
            special-purpose range, or holds fewer free addresses than Services to move.
    """
    check_target(target, pools, pod_cidrs)
    name = cidr_name or default_cidr_name(target)
    stored = [c for c in cidrs if _name(c) != name]
    ranges = [(_name(c), n) for c in stored for n in model.cidr_networks(c)]
    for cidr, net in ranges:
        if net.overlaps(target):
            raise MigrationRefused(f"target {target} overlaps ServiceCIDR {cidr} {net}: "
                                   "migrate to a range no ServiceCIDR covers")  # fmt: skip
    taken: set[Addr] = set()
    movable = []
    for svc in services:
        ips = model.service_ips(svc)
        taken |= {a for a in model.alias_ips(svc) if a in target}
        if not ips:
            continue
        if ips[0] in target:
            taken.add(ips[0])
            continue
        movable.append((_service_key(svc), svc, ips[0]))
    movable.sort(key=lambda t: t[0])
    usable = max(0, target.num_addresses - 2) - len(taken)
    if len(movable) > usable:
        raise MigrationRefused(f"{target} has {usable} usable addresses but {len(movable)} "
                               "Services need one")  # fmt: skip
    counts = {(n, net): 0 for n, net in ranges}
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


# ------------------------------------------------------------------------ the record


def migration_record(target: Net, cidr_name: str = "", grace: float | None = None) -> Resource:
    """The record ``migrate --to`` applies: ``spec.to``, ``spec.serviceCIDRName`` and,
    when given, ``spec.aliasGracePeriodSeconds`` (else the operator's
    ``--service-alias-grace-period``)."""
    spec: dict[str, Any] = {
        "to": str(target),
        "serviceCIDRName": cidr_name or default_cidr_name(target),
    }
    if grace is not None:
        spec["aliasGracePeriodSeconds"] = grace
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": NAME}, "spec": spec}


def grace_of(record: Mapping[str, Any] | None, default: float) -> float:
    """The record's ``spec.aliasGracePeriodSeconds``, else ``default`` (seconds)."""
    value = ((record or {}).get("spec") or {}).get("aliasGracePeriodSeconds")
    return float(value) if isinstance(value, int | float) and value > 0 else default


def validate_migration(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    """Validate a :data:`KIND` manifest: ``metadata.name`` :data:`NAME`, ``spec.to`` an
    IPv4 network outside the special-purpose ranges, ``spec.serviceCIDRName`` optional,
    ``spec.aliasGracePeriodSeconds`` a positive number when given.

    Raises:
        InvalidResource: with field paths.
    """
    errors = []
    if _name(doc) != NAME:
        errors.append(FieldError("metadata.name", f"must be {NAME!r} (one migration at a time)"))
    spec = doc.get("spec") or {}
    try:
        target = Net(str(spec.get("to") or ""), strict=True)
    except ValueError as exc:
        errors.append(FieldError("spec.to", f"{spec.get('to')!r} is not an IPv4 CIDR: {exc}"))
    else:
        try:
            check_target(target)
        except MigrationRefused as exc:
            errors.append(FieldError("spec.to", str(exc)))
    grace = spec.get("aliasGracePeriodSeconds")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int | float)
                              or grace <= 0):  # fmt: skip
        errors.append(FieldError("spec.aliasGracePeriodSeconds", f"{grace!r}: a number > 0"))
    if errors:
        raise InvalidResource(errors)
    return doc


def phase(record: Mapping[str, Any] | None) -> str:
    """``status.phase`` of a migration record ("Pending" before the controller saw it)."""
    return str(((record or {}).get("status") or {}).get("phase") or "Pending")


def _target(record: Mapping[str, Any]) -> tuple[Net, str]:
    spec = record.get("spec") or {}
    target = Net(str(spec["to"]))
    return target, str(spec.get("serviceCIDRName") or default_cidr_name(target))


def _with_status(record: Resource, **changes: Any) -> Resource:
    out = dict(record)
    out["status"] = {**(record.get("status") or {}), **changes}
    return out


def _items(snapshot: Mapping[str, Any], kind: str) -> list[Resource]:
    listed = snapshot.get(kind)
    return list(listed.items) if listed is not None else []


def _record(snapshot: Mapping[str, Any]) -> Resource | None:
    return next((r for r in _items(snapshot, KIND) if _name(r) == NAME), None)


def start_writes(
    snapshot: Mapping[str, Any], now: datetime.datetime, pod_cidrs: Sequence[Net] = ()
) -> list[Write]:
    """Step 1 (module docstring) on a transaction snapshot of :data:`KIND`, ServiceCIDRs,
    Services and CiliumPodIPPools: the target ServiceCIDR created, the others marked
    terminating, ``status.phase`` Moving -- or ``status.phase`` Failed with the reason when
    the plan is refused. No writes when the record is not Pending."""
    record = _record(snapshot)
    if record is None or phase(record) != "Pending":
        return []
    target, cidr_name = _target(record)
    cidrs = _items(snapshot, model.CIDR_KIND)
    existing = next((c for c in cidrs if _name(c) == cidr_name), None)
    try:
        if existing is not None and model.cidr_networks(existing) != [target]:
            raise MigrationRefused(f"ServiceCIDR {cidr_name} exists with other ranges "
                                   f"({', '.join(map(str, model.cidr_networks(existing)))})")  # fmt: skip
        plan_migration(_items(snapshot, model.SERVICE_KIND), cidrs, target, cidr_name,
                       pools=pool_ranges(_items(snapshot, POOL_KIND)), pod_cidrs=pod_cidrs)  # fmt: skip
    except MigrationRefused as exc:
        return [Write("update", _with_status(record, phase="Failed", message=str(exc)))]
    old = [c for c in cidrs if _name(c) != cidr_name]
    writes = []
    if existing is None:
        created = {
            "apiVersion": model.CIDR_API_VERSION,
            "kind": model.CIDR_KIND,
            "metadata": {
                "name": cidr_name,
                "annotations": {model.MIGRATED_FROM_ANNOTATION: ",".join(
                    str(n) for c in old for n in model.cidr_networks(c))},
            },
            "spec": {"cidrs": [str(target)]},
        }  # fmt: skip
        writes.append(Write("create", created))
    writes += [Write("update", model.terminating(c)) for c in old if not model.cidr_terminating(c)]
    writes.append(Write("update", _with_status(
        record, phase="Moving", message="", startedAt=model.rfc3339(now),
        serviceCIDR=cidr_name, sources=sorted(_name(c) for c in old), services={},
    )))  # fmt: skip
    return writes


def move_writes(
    snapshot: Mapping[str, Any], now: datetime.datetime
) -> tuple[list[Write], Move | None]:
    """Step 2 for ONE Service (the first of the plan of what is left), on a snapshot of
    :data:`KIND`, Services and ServiceCIDRs: its new ClusterIP and the old one as alias, and
    its ``status.services`` entry ``{old, new, movedAt, released: false}``. When none is
    left: ``status.phase`` Aliased. Returns ``(writes, the move or None)``."""
    record = _record(snapshot)
    if record is None or phase(record) != "Moving":
        return [], None
    target, cidr_name = _target(record)
    services = _items(snapshot, model.SERVICE_KIND)
    plan = plan_migration(services, _items(snapshot, model.CIDR_KIND), target, cidr_name)
    if not plan.moves:
        return [Write("update", _with_status(record, phase="Aliased"))], None
    move = plan.moves[0]
    ns, _, name = move.service.partition("/")
    svc = next(s for s in services if model.key_of(s) == (ns, name))
    moved = model.with_aliases(svc, {**model.alias_ips(svc), move.old: model.rfc3339(now)})
    moved["spec"] = {**moved["spec"], "clusterIP": str(move.new), "clusterIPs": [str(move.new)]}
    entries = dict((record.get("status") or {}).get("services") or {})
    entries[move.service] = {"old": str(move.old), "new": str(move.new),
                             "movedAt": model.rfc3339(now), "released": False}  # fmt: skip
    return [Write("update", moved), Write("update", _with_status(record, services=entries))], move


def release_writes(
    snapshot: Mapping[str, Any], now: datetime.datetime, default_grace: float
) -> tuple[list[Write], list[aliases.Verdict]]:
    """Step 3 on a snapshot of :data:`KIND`, Services, alias-use records and ServiceCIDRs:
    every alias idle for the grace period (:func:`grace_of` the record, else
    ``default_grace`` seconds; :func:`aliases.judge`) removed from its Service
    and marked ``released`` (with ``releasedAt``, ``lastUsed``) in ``status.services``; the
    other entries' ``lastUsed`` brought up to date; ``status.phase`` Done once nothing is
    aliased and no source ServiceCIDR is left. Returns ``(writes, released verdicts)``;
    no writes when nothing changed."""
    record = _record(snapshot)
    services = _items(snapshot, model.SERVICE_KIND)
    grace = grace_of(record, default_grace)
    verdicts = aliases.judge(services, _items(snapshot, aliases.USE_KIND), now, grace)
    if record is None or phase(record) not in ("Moving", "Aliased"):
        return [], []
    status = record.get("status") or {}
    entries = {k: dict(v) for k, v in (status.get("services") or {}).items()}
    by_service: dict[str, list[aliases.Verdict]] = {}
    for v in verdicts:
        by_service.setdefault(v.service, []).append(v)
    writes: list[Write] = []
    released = []
    for svc in services:
        key = model.key_of(svc)
        display = f"{key[0]}/{key[1]}"
        mine = by_service.get(display, [])
        drop = {v.ip for v in mine if v.release}
        entry = entries.get(display)
        for v in mine:
            if entry is not None and entry.get("old") == str(v.ip) and v.last_used is not None:
                entry["lastUsed"] = model.rfc3339(v.last_used)
        if not drop:
            continue
        keep = {ip: t for ip, t in model.alias_ips(svc).items() if ip not in drop}
        writes.append(Write("update", model.with_aliases(svc, keep)))
        released += [v for v in mine if v.release]
        if entry is not None and entry.get("old") in {str(ip) for ip in drop}:
            entry.update(released=True, releasedAt=model.rfc3339(now))
    # a moved Service deleted since (or its alias removed by hand): nothing left to release
    held = {(f"{model.key_of(s)[0]}/{model.key_of(s)[1]}", str(ip))
            for s in services for ip in model.alias_ips(s)}  # fmt: skip
    for name, entry in entries.items():
        if not entry.get("released") and (name, str(entry.get("old"))) not in held:
            entry.update(released=True, releasedAt=model.rfc3339(now))
    left = {_name(c) for c in _items(snapshot, model.CIDR_KIND)} & set(status.get("sources") or [])
    still = any(not e.get("released") for e in entries.values()) or len(verdicts) > len(released)
    changes: dict[str, Any] = {}
    if entries != (status.get("services") or {}):
        changes["services"] = entries
    if phase(record) == "Aliased" and not still and not left:
        changes.update(phase="Done", finishedAt=model.rfc3339(now))
    if changes:
        writes.append(Write("update", _with_status(record, **changes)))
    return writes, released


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
