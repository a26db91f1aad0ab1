"""``servicecidr migrate|status``: moving Services to another service CIDR, and following it."""

from __future__ import annotations

import ipaddress
import json
import time
import uuid
from typing import IO, Any

import grpc

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_common.durations import parse_duration
from cilia_common.tls import (
    ClientTLS,
)

from ..service import allocation, migration
from ..service import model as svc_model
from .connection import (
    CommandError,
    call,
    ipam_stub,
    resource_stub,
    rpc_error,
)


def _list(stub: Any, kind: str, server: str, timeout: float) -> list[dict[str, Any]]:
    return [json.loads(r.json) for r in
            call(stub.List, pb.ListRequest(kind=kind), server, timeout).items]  # fmt: skip


def _migration(stub: Any, server: str, timeout: float) -> dict[str, Any] | None:
    try:
        got = stub.Get(pb.GetRequest(kind=migration.KIND, name=migration.NAME), timeout=timeout)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return None
        if "no Kubernetes resource mapping" in str(exc.details()):
            raise CommandError(
                "the operator runs with --store kubernetes: run the migration against the "
                "Kubernetes API with --kubernetes (and --k8s-kubeconfig-path, or in-cluster): "
                "it re-creates each Service in the new range and keeps the old address an "
                "alias (see the operator README)"
            ) from None
        raise rpc_error(exc, server) from None
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
    stub = resource_stub(server, tls)
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
            call(stub.Delete, pb.DeleteRequest(kind=migration.KIND, name=migration.NAME),
                  server, timeout)  # fmt: skip
        seconds = parse_duration(grace) if grace else None
        record = migration.migration_record(target, cidr_name, seconds)
        call(stub.Apply, pb.ApplyRequest(manifest=json.dumps(record),
                                          request_id=str(uuid.uuid4())), server, timeout)  # fmt: skip
    _follow_migration(stub, server, timeout, out, wait_timeout, poll_interval)


def _pod_ranges(
    stub: Any, server: str, timeout: float, tls: ClientTLS | None
) -> list[tuple[str, ipaddress.IPv4Network]]:
    """Every pod range a migration target may not overlap: the pools of ``ipam status``
    (``cluster-pool`` included in that mode), else the stored CiliumPodIPPools."""
    try:
        status = ipam_stub(server, tls).GetStatus(pb.IPAMServiceGetStatusRequest(),
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
    stub = resource_stub(server, tls)
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
