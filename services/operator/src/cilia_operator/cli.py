"""Client commands: ``apply``, ``get``, ``delete`` and ``ipam plan|status`` against a
running operator (plaintext, or mutual TLS with ``--tls-operator-*`` files), and
``certs generate`` (the standalone control plane's certificates).

Each returns the process exit status: 0 on success; on failure one line on stderr and
status 2 (bad input, not found, refused) -- never a traceback.
"""

from __future__ import annotations

import ipaddress
import json
import re
import sys
import time
import uuid
from typing import IO, Any

import grpc
import yaml

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_common.durations import parse_duration
from cilia_common.protojson import message_to_dict
from cilia_common.tls import (
    ClientTLS,
    TLSFileError,
    channel_credentials,
    channel_options,
    generate_bundle,
)

from .addresses import special_ranges
from .ipam.changes import NodeNetworks, overlap_errors, plan_numbers
from .ipam.pool import PoolSpec, pool_overlaps
from .kinds import UnknownKind, kind_of, resolve_kind
from .manifests import parse_manifest
from .service import allocation, migration
from .service import model as svc_model

EXIT_ERROR = 2
DEFAULT_SERVICE_CIDR = ipaddress.IPv4Network("10.96.0.0/12")  # the operator's default


class CommandError(Exception):
    """A client command failed; the message is the one line shown to the user."""


SERVER_FORM = "HOST:PORT, [IPV6]:PORT, dns:[//AUTHORITY/]HOST:PORT or unix:PATH"
_HOSTNAME = re.compile(
    r"^[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*\.?$"
)


def check_server(server: str) -> str:
    """Return ``server`` when it is a gRPC target the operator can be reached at:
    ``HOST:PORT`` (hostname or IPv4), ``[IPV6]:PORT``, ``dns:[//AUTHORITY/]HOST:PORT``,
    ``unix:PATH`` / ``unix:///PATH`` or ``unix-abstract:NAME``; the port is 1..65535.

    Raises:
        CommandError: anything else (``--server garbage::``), so a typo is a usage error
            rather than an "operator unreachable".
    """
    problem = ""
    if server.startswith(("unix:", "unix-abstract:")):
        if not server.partition(":")[2].strip("/"):
            problem = "no socket path"
    else:
        target = server.removeprefix("dns:")
        if target != server and target.startswith("//"):
            target = target[2:].partition("/")[2]  # dns://AUTHORITY/HOST:PORT
        if target.startswith("["):
            host, _, rest = target[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                problem = f"{host!r} is not an IPv6 address"
        else:
            host, sep, port = target.rpartition(":")
            if not sep:
                host, port = target, ""
            if not host or not _HOSTNAME.match(host):
                problem = f"{host!r} is not a host name or IPv4 address" if host else "no host"
        if not problem and not (port.isdigit() and 1 <= int(port) <= 65535):
            problem = f"port {port!r} is not in 1..65535" if port else "no port"
    if problem:
        raise CommandError(f"--server: {server!r} is not an operator address ({problem}); "
                           f"expected {SERVER_FORM}")  # fmt: skip
    return server


def channel(server: str, tls: ClientTLS | None = None) -> grpc.Channel:
    """A channel to the operator at ``server``: mutual TLS with ``tls``'s files, else
    plaintext (an operator with TLS refuses it at the handshake).

    Raises:
        CommandError: a malformed address or an unusable TLS file.
    """
    target = check_server(server)
    if tls is None:
        return grpc.insecure_channel(target)
    try:
        credentials = channel_credentials(tls)
    except TLSFileError as exc:
        raise CommandError(f"TLS: {exc}") from None
    return grpc.secure_channel(target, credentials, options=channel_options(tls))


def _stub(server: str, tls: ClientTLS | None = None) -> Any:
    return pb_grpc.ResourceServiceStub(channel(server, tls))  # type: ignore[no-untyped-call]


def _rpc_error(exc: Any, server: str) -> CommandError:
    """The one-line CommandError for a failed RPC."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CommandError(f"cannot reach operator at {server}: {exc.details()}")
    return CommandError(f"{code.name}: {exc.details()}")


def _call(method: Any, request: Any, server: str, timeout: float) -> Any:
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as exc:
        raise _rpc_error(exc, server) from None


def _display(api_version: str, kind: str, name: str) -> str:
    try:
        return kind_of(api_version, kind).display(name)
    except UnknownKind:
        return f"{kind.lower()}/{name}"


def apply(
    path: str,
    server: str,
    dry_run: bool,
    timeout: float,
    out: IO[str],
    *,
    tls: ClientTLS | None = None,
) -> None:
    """Send the manifest at ``path`` (``-`` = stdin); print one kubectl-style line per
    resource (``ciliumpodippool.cilium.io/blue created``). When the operator does not
    answer within ``timeout``, ask it (``ApplyOutcome``, with the request's id) whether all
    were written (``... applied (confirmed after the deadline)``) or none (error).

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
    stub = _stub(server, tls)
    request_id = str(uuid.uuid4())
    try:
        response = stub.Apply(
            pb.ApplyRequest(manifest=text, dry_run=dry_run, request_id=request_id),
            timeout=timeout,
        )
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or dry_run:
            raise _rpc_error(exc, server) from None
        _after_deadline(stub, text, request_id, timeout, out)
        return
    suffix = " (dry run)" if dry_run else ""
    for res in response.resources:
        print(f"{_display(res.api_version, res.kind, res.name)} {res.action}{suffix}", file=out)
    if dry_run:
        for effect in response.effects:
            print(f"  {effect}", file=out)


def _after_deadline(stub: Any, text: str, request_id: str, timeout: float, out: IO[str]) -> None:
    """Say whether an apply cut off by its deadline was written, exactly: ``ApplyOutcome``
    fences an apply that has not begun writing (it will write nothing) and waits for one
    that has (the operator writes a manifest's documents all or none).

    Raises:
        CommandError: nothing was written, or the outcome cannot be told.
    """
    head = f"apply did not answer within --timeout {timeout:g}s"
    try:
        answer = stub.ApplyOutcome(pb.ApplyOutcomeRequest(request_id=request_id), timeout=timeout)
    except grpc.RpcError as exc:
        raise CommandError(
            f"{head}; whether it was written is unknown ({exc.code().name}: {exc.details()}): "
            "the operator writes all documents of a manifest or none; check with "
            "cilia-operator get"
        ) from None
    if answer.outcome == pb.ApplyOutcomeResponse.OUTCOME_WRITTEN:
        for doc in parse_manifest(text):
            if isinstance(doc, dict):
                meta = doc.get("metadata") or {}
                name = _display(
                    str(doc.get("apiVersion")), str(doc.get("kind")), str(meta.get("name"))
                )
                print(f"{name} applied (confirmed after the deadline)", file=out)
        return
    if answer.outcome == pb.ApplyOutcomeResponse.OUTCOME_NOT_WRITTEN:
        raise CommandError(
            f"{head} and nothing was written ({answer.detail}); the operator writes all "
            "documents of a manifest or none; retry (e.g. with a longer --timeout)"
        )
    raise CommandError(
        f"{head}; whether it was written is unknown ({answer.detail}); check with "
        "cilia-operator get"
    )


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
    *,
    tls: ClientTLS | None = None,
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
    stub = _stub(server, tls)
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
    kind: str,
    name: str,
    server: str,
    timeout: float,
    out: IO[str],
    namespace: str = "default",
    *,
    tls: ClientTLS | None = None,
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
    stub = _stub(server, tls)
    _call(stub.Delete, request, server, timeout)
    if info.kind == "ServiceCIDR":
        # a ServiceCIDR that Services still hold addresses in stays, terminating
        try:
            left = stub.Get(pb.GetRequest(kind=info.kind, name=name), timeout=timeout)
        except grpc.RpcError:
            left = None
        if left is not None and json.loads(left.resource.json)["metadata"].get("deletionTimestamp"):
            print(f"{info.display(name)} terminating: Services hold addresses in it; it is "
                  "deleted when the last of them goes", file=out)  # fmt: skip
            return
    print(f"{info.display(name)} deleted", file=out)


def _list(stub: Any, kind: str, server: str, timeout: float) -> list[dict[str, Any]]:
    return [json.loads(r.json) for r in
            _call(stub.List, pb.ListRequest(kind=kind), server, timeout).items]  # fmt: skip


def _migration(stub: Any, server: str, timeout: float) -> dict[str, Any] | None:
    try:
        got = stub.Get(pb.GetRequest(kind=migration.KIND, name=migration.NAME), timeout=timeout)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        if "no Kubernetes resource mapping" in str(exc.details()):
            raise CommandError(
                "the operator runs with --store kubernetes: kube-apiserver allocates ClusterIPs "
                "(and the kubernetes Service from its --service-cluster-ip-range), so Cilia "
                "cannot move Services; it serves the addresses listed in a Service's "
                "service.cilia.io/alias-ips annotation as aliases (see the operator README)"
            ) from None
        raise _rpc_error(exc, server) from None
    record: dict[str, Any] = json.loads(got.resource.json)
    return record


def servicecidr_migrate(
    to: str,
    dry_run: bool,
    grace: str | None,
    server: str,
    timeout: float,
    out: IO[str],
    *,
    tls: ClientTLS | None = None,
    wait_timeout: float = 600.0,
    poll_interval: float = 0.5,
) -> None:
    """Print the plan of moving every Service to addresses in ``to`` (see
    :mod:`cilia_operator.service.migration`); unless ``dry_run``, carry it out: apply the
    migration record and print each Service's move as the operator makes it, until every
    Service moved (the aliases are released later, by the operator: ``servicecidr status``).
    Run again with the same target after an interruption, it only follows the progress.

    Args:
        to: the new range (IPv4 CIDR); grace: ``--alias-grace-period`` as given (Go
            duration; None: the operator's ``--service-alias-grace-period``).
        wait_timeout: ``--wait-timeout``: seconds to follow the moves at most;
            poll_interval: seconds between two looks at the record.

    Raises:
        CommandError: not a CIDR; the target overlaps a ServiceCIDR, a pod pool or a
            special-purpose range, or is too small; another migration is under way; the
            operator refused or is unreachable; the moves did not finish in time.
    """
    try:
        target = ipaddress.IPv4Network(to, strict=True)
    except ValueError as exc:
        raise CommandError(f"--to: {to!r} is not an IPv4 CIDR: {exc}") from None
    stub = _stub(server, tls)
    current = _migration(stub, server, timeout)
    cidr_name = migration.default_cidr_name(target)
    if current is not None and migration.phase(current) not in ("Done", "Failed"):
        spec = current.get("spec") or {}
        if spec.get("to") != str(target):
            raise CommandError(f"a migration to {spec.get('to')} is {migration.phase(current)}: "
                               "wait for it to finish (servicecidr status)")  # fmt: skip
        cidr_name = str(spec.get("serviceCIDRName") or cidr_name)
    services = _list(stub, "Service", server, timeout)
    cidrs = _list(stub, "ServiceCIDR", server, timeout)
    pools = _pod_ranges(stub, server, timeout, tls)
    try:
        plan = migration.plan_migration(services, cidrs, target, cidr_name, pools=pools)
    except migration.MigrationRefused as exc:
        raise CommandError(str(exc)) from None
    for line in plan.lines(grace or "", dry_run):
        print(line, file=out)
    if dry_run:
        return
    if current is None or migration.phase(current) in ("Done", "Failed"):
        if current is not None:  # a finished one's status would be kept by an apply
            _call(stub.Delete, pb.DeleteRequest(kind=migration.KIND, name=migration.NAME),
                  server, timeout)  # fmt: skip
        seconds = parse_duration(grace) if grace else None
        record = migration.migration_record(target, cidr_name, seconds)
        _call(stub.Apply, pb.ApplyRequest(manifest=json.dumps(record),
                                          request_id=str(uuid.uuid4())), server, timeout)  # fmt: skip
    _follow_migration(stub, server, timeout, out, wait_timeout, poll_interval)


def _pod_ranges(
    stub: Any, server: str, timeout: float, tls: ClientTLS | None
) -> list[tuple[str, ipaddress.IPv4Network]]:
    """Every pod range a migration target may not overlap: the pools of ``ipam status``
    (``cluster-pool`` included in that mode), else the stored CiliumPodIPPools."""
    try:
        status = _ipam_stub(server, tls).GetStatus(pb.IPAMServiceGetStatusRequest(),
                                                   timeout=timeout)  # fmt: skip
    except grpc.RpcError:
        return migration.pool_ranges(_list(stub, "CiliumPodIPPool", server, timeout))
    return [
        (p.name, ipaddress.IPv4Network(c, strict=False))
        for p in status.pools
        for c in [*p.cidrs, *p.draining_cidrs]
    ]


def _follow_migration(
    stub: Any, server: str, timeout: float, out: IO[str], wait_timeout: float, poll: float
) -> None:
    shown: set[str] = set()
    deadline = time.monotonic() + wait_timeout
    while True:
        record = _migration(stub, server, timeout) or {}
        status = record.get("status") or {}
        state = migration.phase(record)
        entries = status.get("services") or {}
        for name in sorted(entries, key=lambda n: str(entries[n].get("movedAt") or "")):
            if name not in shown:
                shown.add(name)
                e = entries[name]
                print(f"moved {name}: {e.get('old')} -> {e.get('new')} ({e.get('old')} stays an "
                      "alias until unused)", file=out, flush=True)  # fmt: skip
        if state == "Failed":
            raise CommandError(f"migration refused by the operator: {status.get('message')}")
        if state in ("Aliased", "Done"):
            print(f"every Service moved ({len(shown)}); ServiceCIDR {status.get('serviceCIDR')} "
                  f"serves new Services; old ServiceCIDRs {', '.join(status.get('sources') or [])}"
                  " are terminating until their aliases are released (servicecidr status)",
                  file=out)  # fmt: skip
            return
        if time.monotonic() > deadline:
            raise CommandError(f"the migration is still {state} after {wait_timeout:g} s "
                               "(--wait-timeout); it goes on in the operator: run the same "
                               "command again to follow it, or servicecidr status")  # fmt: skip
        time.sleep(poll)


def servicecidr_status(
    server: str, timeout: float, out: IO[str], *, output: str = "text",
    tls: ClientTLS | None = None,
) -> None:  # fmt: skip
    """Print the migration's state: phase, grace period, per Service old and new ClusterIP,
    when its alias was last used and whether it was released; then every ServiceCIDR with
    its state (active / terminating and who holds it).

    Raises:
        CommandError: the operator is unreachable.
    """
    stub = _stub(server, tls)
    record = _migration(stub, server, timeout)
    services = _list(stub, "Service", server, timeout)
    cidrs = _list(stub, "ServiceCIDR", server, timeout)
    holders = {
        str(c["metadata"]["name"]): allocation.cidr_holders(c, services, cidrs) for c in cidrs
    }
    if output == "json":
        print(json.dumps({"migration": record, "serviceCIDRs": [
            {"name": n, "cidrs": (c.get("spec") or {}).get("cidrs"),
             "terminating": svc_model.cidr_terminating(c), "heldBy": holders[n]}
            for c in cidrs for n in [str(c["metadata"]["name"])]]}, indent=2), file=out)  # fmt: skip
        return
    if record is None:
        print("no ServiceCIDR migration", file=out)
    else:
        spec, status = record.get("spec") or {}, record.get("status") or {}
        grace = spec.get("aliasGracePeriodSeconds")
        print(f"migration to {spec.get('to')}: {migration.phase(record)}"
              + (f" ({status['message']})" if status.get("message") else "")
              + f"; alias grace period: {f'{grace:g} s' if grace else 'the operator default'}",
              file=out)  # fmt: skip
        entries = status.get("services") or {}
        if entries:
            print(f"  {'SERVICE':<32} {'OLD':<15} {'NEW':<15} {'ALIAS LAST USED':<24} RELEASED",
                  file=out)  # fmt: skip
        for name in sorted(entries):
            e = entries[name]
            released = f"yes ({e['releasedAt']})" if e.get("released") else "no"
            print(f"  {name:<32} {e.get('old', ''):<15} {e.get('new', ''):<15} "
                  f"{e.get('lastUsed') or 'never':<24} {released}", file=out)  # fmt: skip
    print("ServiceCIDRs:", file=out)
    for c in sorted(cidrs, key=lambda c: str(c["metadata"]["name"])):
        name = str(c["metadata"]["name"])
        nets = ",".join((c.get("spec") or {}).get("cidrs") or [])
        if svc_model.cidr_terminating(c):
            held = holders[name]
            state = f"terminating, held by {len(held)} Service(s)" + (
                f": {', '.join(held[:5])}" if held else "")  # fmt: skip
        else:
            state = "active"
        print(f"  {name:<28} {nets:<18} {state}", file=out)


def _ipam_stub(server: str, tls: ClientTLS | None = None) -> Any:
    return pb_grpc.IPAMServiceStub(channel(server, tls))  # type: ignore[no-untyped-call]


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
) -> int:
    """Print the node blocks, pod IPs per node and in total for a pool shape; with a
    reachable operator (``server``), also check it against live pools and nodes:
    overlaps (pools, node networks, service CIDRs), a maskSize change of the existing
    ``pool`` (immutable) and nodes that would not get a block.

    Pod IPs per node are a block's usable addresses minus the agent's router IP (the first
    usable address of a node's first block); the total assumes one block per node.

    The service CIDRs checked are the operator's own ``--service-cluster-ip-range``
    (GetStatus ``service_cidrs``) plus ``service_cidrs`` when given (each a CIDR or a comma
    list); offline, with an unreachable operator (said so in the output), or against an
    operator too old to report them, ``service_cidrs`` or else the operator's default
    10.96.0.0/12.

    Returns the number of problems found (0 = fits); offline only service CIDR overlaps
    are checked.

    Raises:
        CommandError: a CIDR or the mask is invalid, a CIDR overlaps a special-purpose
            range (loopback, link-local, multicast, ...), the mask leaves no pod address,
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
    if plan.pods_per_node < 1:
        raise CommandError(
            f"--mask-size: a /{mask_size} block leaves no pod address: its "
            f"{plan.usable_per_block} usable address is the agent's router IP (use a shorter mask)"
        )
    print(f"CIDRs:              {', '.join(str(n) for n in nets)}", file=out)
    print(f"block size:         /{mask_size}", file=out)
    print(f"node blocks:        {plan.blocks}", file=out)
    print(f"IPs per block:      {plan.usable_per_block}", file=out)
    print(f"pod IPs per node:   {plan.pods_per_node} (one block; the agent's router IP takes "
          "one address)", file=out)  # fmt: skip
    print(f"pod IPs in total:   {plan.pods_total} ({plan.blocks} nodes with one block each)",
          file=out)  # fmt: skip
    if server is None:
        return _offline_checks(nets, given, out, "offline")
    try:
        status = _ipam_stub(server, tls).GetStatus(
            pb.IPAMServiceGetStatusRequest(), timeout=timeout
        )
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
    status = _call(_ipam_stub(server, tls).GetStatus, pb.IPAMServiceGetStatusRequest(), server,
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


def _host_name_error(host: str) -> str:
    """Why ``host`` cannot be a certificate's subjectAltName, or "" when it can: an IPv4 or
    IPv6 address, or a DNS name of RFC 1123 labels (letters, digits, '-', 1-63 characters,
    not starting or ending with '-'; at most 253 characters)."""
    try:
        ipaddress.ip_address(host)
        return ""
    except ValueError:
        pass
    labels = host.split(".")
    if not host or len(host) > 253:
        return "not an IP address or a DNS name (1-253 characters)"
    for label in labels:
        ok = (
            0 < len(label) <= 63
            and label[0] != "-"
            and label[-1] != "-"
            and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        )
        if not ok:
            return f"not an IP address or a DNS name (label {label!r}: letters, digits, '-')"
    return ""


def certs_generate(
    directory: str,
    hosts: list[str],
    nodes: list[str],
    admins: list[str],
    days: float,
    out: IO[str],
    *,
    hubble_cluster: str | None = None,
) -> None:
    """Write the control plane's CA, the operator's server pair, one client pair per node and
    per admin into ``directory`` (``ca.crt``/``ca.key`` reused when present, so new nodes
    can be added later) and print the flags that use them; with ``hubble_cluster`` also
    Hubble's (each node's server pair, the relay's client and server pairs, hubble-ui's
    client pair).

    Raises:
        CommandError: bad node or Hubble cluster name (one line), no host, or the directory
            cannot be written.
    """
    import pydantic

    from .ipam.pool import ObjectMeta

    names = [("--nodes", node) for node in nodes]
    if hubble_cluster is not None:  # the middle label of each node's <node>.<cluster>.hubble-grpc…
        names.append(("--hubble-cluster", hubble_cluster))
    for flag, name in names:
        try:
            ObjectMeta(name=name)
        except ValueError as exc:
            # pydantic's text is several lines (model, field, docs link): its message only
            why = exc.errors()[0]["msg"] if isinstance(exc, pydantic.ValidationError) else exc
            raise CommandError(f"{flag}: {name!r}: {why}") from None
    for host in hosts:
        why = _host_name_error(host)
        if why:
            raise CommandError(f"--hosts: {host!r}: {why}")
    try:
        bundle = generate_bundle(
            directory, server_hosts=hosts, nodes=nodes, admins=admins, days=days,
            hubble_cluster=hubble_cluster,
        )  # fmt: skip
    except NotADirectoryError as exc:
        raise CommandError(f"--dir: {exc}") from None
    except (ValueError, OSError, TLSFileError) as exc:
        raise CommandError(str(exc)) from None
    print(f"CA:       {bundle.ca_cert} (key {bundle.ca_key}: keep it off the nodes)", file=out)
    print(f"operator: --tls-cert-file {bundle.server_cert} --tls-key-file {bundle.server_key} "
          f"--tls-client-ca-files {bundle.ca_cert}", file=out)  # fmt: skip
    for name, (cert, key) in bundle.clients.items():
        print(f"{name}: --tls-operator-server-ca-files {bundle.ca_cert} "
              f"--tls-operator-client-cert-file {cert} --tls-operator-client-key-file {key}",
              file=out)  # fmt: skip
    for name, (cert, key) in bundle.hubble.items():
        if name == "hubble-relay-client":
            flags = (f"--tls-hubble-server-ca-files {bundle.ca_cert} --tls-client-cert-file "
                     f"{cert} --tls-client-key-file {key}")  # fmt: skip
        elif name == "hubble-ui-client":
            flags = (f"--tls-relay-ca-cert-files {bundle.ca_cert} --tls-relay-client-cert-file "
                     f"{cert} --tls-relay-client-key-file {key} --tls-relay-server-name "
                     f"ui.hubble-relay.cilium.io (cilia-hubble-ui; Secret "
                     f"hubble-ui-client-certs: tls.crt, tls.key, ca.crt)")  # fmt: skip
        elif name == "hubble-relay-server":
            flags = (f"--tls-relay-server-cert-file {cert} --tls-relay-server-key-file {key} "
                     f"(clients: hubble --tls --tls-ca-cert-files {bundle.ca_cert})")  # fmt: skip
        else:
            flags = (f"--hubble-tls-cert-file {cert} --hubble-tls-key-file {key} "
                     f"--hubble-tls-client-ca-files {bundle.ca_cert}")  # fmt: skip
        print(f"{name}: {flags}", file=out)
