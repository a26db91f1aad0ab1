"""``ipam plan|status``: a pool's numbers and conflicts before it is applied, and the live
allocation (nodes, CIDRs, draining) of a running operator."""

from __future__ import annotations

import ipaddress
import json
from typing import IO, Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_common.protojson import message_to_dict
from cilia_common.tls import (
    ClientTLS,
)

from ..addresses import special_ranges
from ..ipam.changes import NodeNetworks, overlap_errors, plan_numbers
from ..ipam.pool import PoolSpec, pool_overlaps
from .connection import (
    CommandError,
    call,
    check_server,
    ipam_stub,
)

DEFAULT_SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/12")  # the operator's default


def _service_cidrs(values: tuple[str, ...] | None) -> list[ipaddress.IPv4Network]:
    """``--service-cluster-ip-range`` values, each one CIDR or a comma list (as the
    operator's own flag takes them)."""
    out: list[ipaddress.IPv4Network] = []
    for value in values or ():
        for part in value.split(","):
            if not part.strip():
                continue
            try:
                net = ipaddress.IPv4Network(part.strip(), strict=True)
            except ValueError as exc:
                raise CommandError(
                    f"--service-cluster-ip-range: {part.strip()!r} is not an IPv4 CIDR: {exc}"
                ) from None
            if net not in out:
                out.append(net)
    return out


def _offline_checks(
    nets: list[ipaddress.IPv4Network], given: list[ipaddress.IPv4Network], out: IO[str], note: str
) -> int:
    services = given or [DEFAULT_SERVICE_CIDR]
    print(f"service CIDRs:      {', '.join(str(s) for s in services)} ({note})", file=out)
    offline = [str(e) for e in overlap_errors(nets, service_cidrs=services)]
    for problem in offline:
        print(f"problem: {problem}", file=out)
    if not offline:
        print("fits: no overlap with the service CIDRs (pools and node networks not checked)",
              file=out)  # fmt: skip
    return len(offline)


def ipam_plan(
    cidrs: list[str],
    mask_size: int,
    allow_first: bool,
    allow_last: bool,
    server: str | None,
    timeout: float,
    out: IO[str],
    pool: str = "",
    service_cidrs: tuple[str, ...] | None = None,
    *,
    tls: ClientTLS | None = None,
    default_pool: str = "default",
) -> int:
    """Print the node blocks, pod IPs per node and in total for a pool shape; with a
    reachable operator (``server``), also check it against live pools and nodes:
    overlaps (pools, node networks, service CIDRs), a maskSize change of the existing
    ``pool`` (immutable) and nodes that would not get a block.

    Pod IPs per node are a block's usable addresses minus the agent's router IP (the first
    usable address of a node's first block); the total assumes one block per node. The
    rules are apply's: a mask that leaves no pod address after the router IP (``/32``) is
    refused for the default pool (``default_pool``, ``--ipam-default-ip-pool``) only;
    another pool uses single-address blocks, one per pod.

    The service CIDRs checked are the operator's own ``--service-cluster-ip-range``
    (GetStatus ``service_cidrs``) plus ``service_cidrs`` when given (each a CIDR or a comma
    list); offline, with an unreachable operator (said so in the output), or against an
    operator too old to report them, ``service_cidrs`` or else the operator's default
    10.96.0.0/12.

    Returns the number of problems found (0 = fits); offline only service CIDR overlaps
    are checked.

    Raises:
        CommandError: a CIDR or the mask is invalid, a CIDR overlaps a special-purpose
            range (loopback, link-local, multicast, ...), the mask leaves the default pool
            no pod address,
            two ``--cidr`` values overlap (apply refuses these too), or ``server`` is not
            an address (:func:`check_server`).
    """
    nets: list[ipaddress.IPv4Network] = []
    for cidr in cidrs:
        try:
            net = ipaddress.IPv4Network(cidr, strict=True)
        except ValueError as exc:
            raise CommandError(f"--cidr: {cidr!r} is not an IPv4 CIDR: {exc}") from None
        hits = special_ranges(net)
        if hits:
            name, special = hits[0]
            raise CommandError(
                f"--cidr: {net} overlaps the {name} range {special}: not usable for pods "
                "(apply refuses it too)"
            )
        for prev in nets:
            if net.overlaps(prev):
                raise CommandError(f"--cidr: {net} overlaps --cidr {prev}")
        nets.append(net)
    given = _service_cidrs(service_cidrs)
    if server is not None:
        check_server(server)
    try:
        plan = plan_numbers(nets, mask_size, allow_first, allow_last)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if plan.pods_per_node < 1 and pool == default_pool:
        raise CommandError(
            f"--mask-size: a /{mask_size} block of the default pool {default_pool!r} leaves no "
            f"pod address: its {plan.usable_per_block} usable address is the agent's router "
            "IP (use a shorter mask; another pool may use it, as apply allows)"
        )
    print(f"CIDRs:              {', '.join(str(n) for n in nets)}", file=out)
    print(f"block size:         /{mask_size}", file=out)
    print(f"node blocks:        {plan.blocks}", file=out)
    print(f"IPs per block:      {plan.usable_per_block}", file=out)
    if plan.pods_per_node < 1:
        # as apply: a pool other than the default may use single-address blocks, one per
        # pod (the router IP comes from the default pool)
        print(f"pod IPs per node:   {plan.usable_per_block} per block, one block per pod "
              f"(not usable as the default pool {default_pool!r}: the router IP would take "
              "the block's only address)", file=out)  # fmt: skip
        print(f"pod IPs in total:   {plan.blocks * plan.usable_per_block}", file=out)
    else:
        print(f"pod IPs per node:   {plan.pods_per_node} (one block; the agent's router IP "
              "takes one address)", file=out)  # fmt: skip
        print(f"pod IPs in total:   {plan.pods_total} ({plan.blocks} nodes with one block "
              "each)", file=out)  # fmt: skip
    if server is None:
        return _offline_checks(nets, given, out, "offline")
    try:
        status = ipam_stub(server, tls).GetStatus(pb.IPAMServiceGetStatusRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        print(f"live check skipped: cannot reach operator at {server}: {exc.details()}; "
              "falling back to the offline checks (service CIDRs only; pools and node "
              "networks not checked)", file=out)  # fmt: skip
        return _offline_checks(nets, given, out, "offline: operator unreachable")
    services = list(dict.fromkeys([*(ipaddress.IPv4Network(c) for c in status.service_cidrs
                                     if ":" not in c), *given]))  # fmt: skip
    if not status.service_cidrs and not given:
        services = [DEFAULT_SERVICE_CIDR]  # an operator older than GetStatus.service_cidrs
    others = [
        PoolSpec(p.name, tuple(ipaddress.IPv4Network(c) for c in p.cidrs), p.mask_size,
                 draining=tuple(ipaddress.IPv4Network(c) for c in p.draining_cidrs))
        for p in status.pools
    ]  # fmt: skip
    networks = _node_networks(status)
    problems = [str(e) for e in pool_overlaps(pool, nets, others)]
    problems += [
        str(e) for e in overlap_errors(nets, service_cidrs=services, node_networks=networks)
    ]
    for p in status.pools:
        if pool and p.name == pool and p.mask_size != mask_size:
            problems.append(
                f"--mask-size: cannot change IPv4 mask size in existing pool {pool!r} "
                f"({p.mask_size} -> {mask_size}); apply would refuse it"
            )
    node_count = len(status.nodes)
    if plan.blocks < node_count:
        problems.append(
            f"{node_count - plan.blocks} of {node_count} nodes would not get a block "
            f"({plan.blocks} blocks for {node_count} nodes)"
        )
    print(f"live cluster:       {node_count} nodes, {len(status.pools)} pools ({server})",
          file=out)  # fmt: skip
    print(f"service CIDRs:      {', '.join(str(s) for s in services)}", file=out)
    for problem in problems:
        print(f"problem: {problem}", file=out)
    if not problems:
        print("fits: no overlap with pools or node networks; every node can get a block",
              file=out)  # fmt: skip
    return len(problems)


def ipam_status(
    server: str,
    timeout: float,
    out: IO[str],
    output: str = "text",
    *,
    tls: ClientTLS | None = None,
) -> None:
    """Print the service CIDRs, pools (CIDRs, draining CIDRs, blocks), per-node allocations
    and errors, the migration progress, and pools overlapping a node network registered after them
    (``-o json``: the GetStatus response in protobuf's JSON mapping with every field
    present, zero/empty ones too, and 64-bit counts as JSON numbers:
    ``{"mode": "multi-pool", "pools": [{"name": "default", "blocksTotal": 16, ...}], ...}``).

    Raises:
        CommandError: unreachable operator.
    """
    status = call(ipam_stub(server, tls).GetStatus, pb.IPAMServiceGetStatusRequest(), server,
                   timeout)  # fmt: skip
    if output == "json":
        print(json.dumps(message_to_dict(status), indent=2), file=out)
        return
    print(f"mode: {status.mode}   leader: {'yes' if status.leader else 'no'}", file=out)
    if status.service_cidrs:
        print(f"service CIDRs: {', '.join(status.service_cidrs)}", file=out)
    if status.migration:
        print(f"migration cluster-pool -> multi-pool: {status.migration} "
              f"({status.nodes_migrated}/{status.nodes_total} nodes)", file=out)  # fmt: skip
    print("POOL        MASK  BLOCKS(USED/TOTAL)  CIDRS  DRAINING", file=out)
    for p in status.pools:
        print(f"{p.name:<11} /{p.mask_size:<4} {p.blocks_allocated}/{p.blocks_total:<16} "
              f"{','.join(p.cidrs) or '-'}  {','.join(p.draining_cidrs) or '-'}",
              file=out)  # fmt: skip
    print("NODE        ALLOCATED  REQUESTED  ERROR", file=out)
    for n in status.nodes:
        alloc = " ".join(f"{a.pool}:{c}" for a in n.allocated for c in a.cidrs)
        alloc = " ".join(filter(None, [alloc, *(f"podCIDR:{c}" for c in n.pod_cidrs)]))
        req = " ".join(f"{r.pool}={r.needed_ipv4}" for r in n.requested)
        print(f"{n.node_name:<11} {alloc or '-'}  {req or '-'}  {n.error or '-'}", file=out)
    for line in draining_lines(status):
        print(line, file=out)
    for line in _live_conflicts(status):
        print(f"conflict: {line}", file=out)


def draining_lines(status: Any) -> list[str]:
    """One line per draining CIDR with the blocks still held inside it and by which nodes
    (what the drain waits for), or one line saying no drain is in progress (every CIDR removed
    from a pool has been handed back: the drain is complete)."""
    held = {
        n.node_name: [ipaddress.IPv4Network(c) for a in n.allocated for c in a.cidrs]
        + [ipaddress.IPv4Network(c) for c in n.pod_cidrs]
        for n in status.nodes
    }
    lines = []
    for p in status.pools:
        for cidr in p.draining_cidrs:
            net = ipaddress.IPv4Network(cidr)
            inside = {
                node: sum(1 for b in blocks if b.subnet_of(net))
                for node, blocks in sorted(held.items())
            }
            users = {node: count for node, count in inside.items() if count}
            who = ", ".join(f"{node} ({n})" for node, n in users.items()) or "no node"
            lines.append(
                f"draining: pool {p.name} {cidr}: {sum(users.values())} blocks still held by "
                f"{who}; handed back as their pods leave"
            )
    return lines or ["draining: none in progress (every CIDR removed from a pool is handed back)"]


def _node_networks(status: Any) -> list[NodeNetworks]:
    """Each node of an ``IpamStatusResponse``: its IPv4 local networks (interface, CIDR)
    and what it holds (pool CIDRs and cluster-pool podCIDRs)."""
    return [
        NodeNetworks(
            n.node_name,
            tuple((ln.interface, ipaddress.IPv4Network(ln.cidr)) for ln in n.local_networks
                  if ":" not in ln.cidr),
            tuple(ipaddress.IPv4Network(c) for p in n.allocated for c in p.cidrs)
            + tuple(ipaddress.IPv4Network(c) for c in n.pod_cidrs),
        )
        for n in status.nodes
    ]  # fmt: skip


def _live_conflicts(status: Any) -> list[str]:
    """Pools overlapping a node network that was registered after the pool was made
    (``apply`` refuses the other order)."""
    networks = _node_networks(status)
    out = []
    for p in status.pools:
        cidrs = [ipaddress.IPv4Network(c) for c in p.cidrs]
        out += [f"pool {p.name}: {e.reason}" for e in overlap_errors(cidrs, node_networks=networks)]
    return out
