"""Client commands: ``apply``, ``get``, ``delete`` and ``ipam plan|status`` against a
running operator.

Each returns the process exit status: 0 on success; on failure one line on stderr and
status 2 (bad input, not found, refused) -- never a traceback.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from typing import IO, Any

import grpc
import yaml

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_common.protojson import message_to_dict

from .ipam.changes import NodeNetworks, overlap_errors, plan_numbers
from .ipam.pool import PoolSpec, pool_overlaps
from .kinds import UnknownKind, kind_of, resolve_kind

EXIT_ERROR = 2
DEFAULT_SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/12")  # the operator's default


class CommandError(Exception):
    """A client command failed; the message is the one line shown to the user."""


def _stub(server: str) -> Any:
    return pb_grpc.ResourceServiceStub(grpc.insecure_channel(server))  # type: ignore[no-untyped-call]


def _call(method: Any, request: Any, server: str, timeout: float) -> Any:
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise CommandError(f"cannot reach operator at {server}: {exc.details()}") from None
        raise CommandError(f"{code.name}: {exc.details()}") from None


def _display(api_version: str, kind: str, name: str) -> str:
    try:
        return kind_of(api_version, kind).display(name)
    except UnknownKind:
        return f"{kind.lower()}/{name}"


def apply(path: str, server: str, dry_run: bool, timeout: float, out: IO[str]) -> None:
    """Send the manifest at ``path`` (``-`` = stdin); print one kubectl-style line per
    resource (``ciliumpodippool.cilium.io/blue created``).

    Raises:
        CommandError: unreadable file, invalid manifest, unreachable operator.
    """
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()  # noqa: SIM115
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise CommandError(
            f"cannot read {path}: not UTF-8 text (byte {exc.start}); give a YAML or JSON manifest"
        ) from None
    response = _call(
        _stub(server).Apply, pb.ApplyRequest(manifest=text, dry_run=dry_run), server, timeout
    )
    suffix = " (dry run)" if dry_run else ""
    for res in response.resources:
        print(f"{_display(res.api_version, res.kind, res.name)} {res.action}{suffix}", file=out)
    if dry_run:
        for effect in response.effects:
            print(f"  {effect}", file=out)


def _render(obj: Any, output: str) -> str:
    if output == "yaml":
        return str(yaml.safe_dump(obj, sort_keys=False, default_flow_style=False)).rstrip("\n")
    return json.dumps(obj, indent=2, sort_keys=False)


def get(
    kind: str,
    name: str | None,
    output: str,
    server: str,
    timeout: float,
    out: IO[str],
    namespace: str | None = "default",
) -> None:
    """Print one resource, or every resource of ``kind`` as a ``List``, as JSON or YAML.

    ``namespace`` applies to namespaced kinds (CiliumNetworkPolicy, NetworkPolicy,
    CiliumEndpoint); None lists every namespace (``-A``).

    Raises:
        CommandError: unknown kind, not found, unreachable operator.
    """
    try:
        info = resolve_kind(kind)
    except UnknownKind as exc:
        raise CommandError(str(exc)) from None
    stub = _stub(server)
    scope = (namespace or "default") if info.namespaced else ""
    if name:
        request = pb.GetRequest(kind=info.kind, name=name, namespace=scope)
        response = _call(stub.Get, request, server, timeout)
        print(_render(json.loads(response.resource.json), output), file=out)
        return
    response = _call(stub.List, pb.ListRequest(kind=info.kind), server, timeout)
    items = [json.loads(r.json) for r in response.items]
    if info.namespaced and namespace is not None:
        items = [i for i in items if (i.get("metadata") or {}).get("namespace") == namespace]
    print(_render({"apiVersion": "v1", "kind": "List", "items": items}, output), file=out)


def delete(
    kind: str, name: str, server: str, timeout: float, out: IO[str], namespace: str = "default"
) -> None:
    """Delete one resource; prints ``ciliumpodippool.cilium.io/blue deleted``
    (``namespace`` applies to namespaced kinds).

    Raises:
        CommandError: unknown kind, not found, in use, unreachable operator.
    """
    try:
        info = resolve_kind(kind)
    except UnknownKind as exc:
        raise CommandError(str(exc)) from None
    request = pb.DeleteRequest(
        kind=info.kind, name=name, namespace=namespace if info.namespaced else ""
    )
    _call(_stub(server).Delete, request, server, timeout)
    print(f"{info.display(name)} deleted", file=out)


def _ipam_stub(server: str) -> Any:
    return pb_grpc.IPAMServiceStub(grpc.insecure_channel(server))  # type: ignore[no-untyped-call]


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
) -> int:
    """Print the node blocks, pod IPs per block and in total for a pool shape; with a
    reachable operator (``server``), also check it against live pools and nodes:
    overlaps (pools, node networks, service CIDRs), a maskSize change of the existing
    ``pool`` (immutable) and nodes that would not get a block.

    The service CIDRs checked are the operator's own ``--service-cluster-ip-range``
    (GetStatus ``service_cidrs``) plus ``service_cidrs`` when given; offline, or against an
    operator too old to report them, ``service_cidrs`` or else the operator's default
    10.96.0.0/12.

    Returns the number of problems found (0 = fits); offline only service CIDR overlaps
    are checked.

    Raises:
        CommandError: a CIDR or the mask is invalid, or two ``--cidr`` values overlap
            (apply refuses that too).
    """
    nets: list[ipaddress.IPv4Network] = []
    for cidr in cidrs:
        try:
            net = ipaddress.IPv4Network(cidr, strict=True)
        except ValueError as exc:
            raise CommandError(f"--cidr: {cidr!r} is not an IPv4 CIDR: {exc}") from None
        for prev in nets:
            if net.overlaps(prev):
                raise CommandError(f"--cidr: {net} overlaps --cidr {prev}")
        nets.append(net)
    try:
        given = [ipaddress.IPv4Network(c, strict=True) for c in service_cidrs or ()]
    except ValueError as exc:
        raise CommandError(f"--service-cluster-ip-range: {exc}") from None
    try:
        plan = plan_numbers(nets, mask_size, allow_first, allow_last)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    print(f"CIDRs:              {', '.join(str(n) for n in nets)}", file=out)
    print(f"block size:         /{mask_size}", file=out)
    print(f"node blocks:        {plan.blocks}", file=out)
    print(f"pod IPs per node:   {plan.usable_per_block}", file=out)
    print(f"pod IPs in total:   {plan.total_usable}", file=out)
    if server is None:
        services = given or [DEFAULT_SERVICE_CIDR]
        print(f"service CIDRs:      {', '.join(str(s) for s in services)} (offline)", file=out)
        offline = [str(e) for e in overlap_errors(nets, service_cidrs=services)]
        for problem in offline:
            print(f"problem: {problem}", file=out)
        return len(offline)
    try:
        status = _ipam_stub(server).GetStatus(pb.IPAMServiceGetStatusRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        print(f"live check skipped: cannot reach operator at {server}: {exc.details()}", file=out)
        return 0
    services = list(dict.fromkeys([*(ipaddress.IPv4Network(c) for c in status.service_cidrs
                                     if ":" not in c), *given]))  # fmt: skip
    if not status.service_cidrs and not given:
        services = [DEFAULT_SERVICE_CIDR]  # an operator older than GetStatus.service_cidrs
    others = [
        PoolSpec(p.name, tuple(ipaddress.IPv4Network(c) for c in p.cidrs), p.mask_size,
                 draining=tuple(ipaddress.IPv4Network(c) for c in p.draining_cidrs))
        for p in status.pools
    ]  # fmt: skip
    networks = [
        NodeNetworks(
            n.node_name,
            tuple((ln.interface, ipaddress.IPv4Network(ln.cidr)) for ln in n.local_networks
                  if ":" not in ln.cidr),
            tuple(ipaddress.IPv4Network(c) for p in n.allocated for c in p.cidrs)
            + tuple(ipaddress.IPv4Network(c) for c in n.pod_cidrs),
        )
        for n in status.nodes
    ]  # fmt: skip
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


def ipam_status(server: str, timeout: float, out: IO[str], output: str = "text") -> None:
    """Print the service CIDRs, pools (CIDRs, draining CIDRs, blocks), per-node allocations
    and errors, the migration progress, and pools overlapping a node network registered after them
    (``-o json``: the GetStatus response in protobuf's JSON mapping with every field
    present, zero/empty ones too, and 64-bit counts as JSON numbers:
    ``{"mode": "multi-pool", "pools": [{"name": "default", "blocksTotal": 16, ...}], ...}``).

    Raises:
        CommandError: unreachable operator.
    """
    status = _call(_ipam_stub(server).GetStatus, pb.IPAMServiceGetStatusRequest(), server,
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
    for line in _live_conflicts(status):
        print(f"conflict: {line}", file=out)


def _live_conflicts(status: Any) -> list[str]:
    """Pools overlapping a node network that was registered after the pool was made
    (``apply`` refuses the other order)."""
    networks = [
        NodeNetworks(
            n.node_name,
            tuple((ln.interface, ipaddress.IPv4Network(ln.cidr)) for ln in n.local_networks
                  if ":" not in ln.cidr),
            tuple(ipaddress.IPv4Network(c) for p in n.allocated for c in p.cidrs)
            + tuple(ipaddress.IPv4Network(c) for c in n.pod_cidrs),
        )
        for n in status.nodes
    ]  # fmt: skip
    out = []
    for p in status.pools:
        cidrs = [ipaddress.IPv4Network(c) for c in p.cidrs]
        out += [f"pool {p.name}: {e.reason}" for e in overlap_errors(cidrs, node_networks=networks)]
    return out
