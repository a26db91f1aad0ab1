"""The command-line entry points of the Kubernetes-mode ServiceCIDR migration
(``servicecidr migrate --kubernetes`` and ``servicecidr status --kubernetes``): arguments
checked, the API server's store opened and closed, :class:`~.servicecidr_k8s.K8sMigration`
run, its record printed. The steps themselves are :mod:`.servicecidr_k8s`.
"""

from __future__ import annotations

import asyncio
from ipaddress import IPv4Network as Net
from typing import IO

from ..service import migration, model
from ..store import NotFound, Resource, StoreError
from ..store.kubernetes import KubernetesStore
from .connection import CommandError
from .servicecidr_k8s import RECORD_KINDS, K8sMigration


def servicecidr_migrate_k8s(
    to: str,
    dry_run: bool,
    grace: str | None,
    out: IO[str],
    *,
    kubeconfig: str = "",
    apiserver_updated: bool = False,
    node_networks: tuple[str, ...] = (),
    settle: float = 1.0,
    endpoints_timeout: float = 30.0,
    lease_duration: float = 15.0,
    wait_timeout: float = 600.0,
    request_timeout: float = 10.0,
    apiserver_timeout: float = 60.0,
) -> None:
    """``servicecidr migrate --kubernetes`` (module docstring).

    Args:
        to: the new range (IPv4 CIDR); grace: ``--alias-grace-period`` (Go duration) or
            None (1 h); kubeconfig: ``--k8s-kubeconfig-path`` ("" = in-cluster or
            ``$KUBECONFIG``); node_networks: ``--node-network`` CIDRs the target may not
            overlap (besides every Node's address); the rest: see :class:`K8sMigration`.

    Raises:
        CommandError: a bad argument, a refused target (overlap with a pod range, a node
            network, a current ServiceCIDR), another migration unfinished or another run
            holding the lease -- with nothing changed; or a failed step (run again).
    """
    from cilia_common.durations import parse_duration

    try:
        target = Net(to, strict=True)
    except ValueError as exc:
        raise CommandError(f"--to: {to!r} is not an IPv4 CIDR: {exc}") from None
    nets = []
    for text in node_networks:
        try:
            nets.append(Net(text, strict=False))
        except ValueError as exc:
            raise CommandError(f"--node-network: {text!r} is not an IPv4 CIDR: {exc}") from None
    seconds = parse_duration(grace) if grace else None

    async def main() -> None:
        store = KubernetesStore(kubeconfig=kubeconfig, kinds=RECORD_KINDS,
                                request_timeout=request_timeout)  # fmt: skip
        try:
            await K8sMigration(store, out, settle=settle, endpoints_timeout=endpoints_timeout,
                               lease_duration=lease_duration, wait_timeout=wait_timeout,
                               apiserver_timeout=apiserver_timeout).run(
                target, dry_run=dry_run, grace=seconds, grace_text=grace or "",
                apiserver_updated=apiserver_updated, node_networks=nets)  # fmt: skip
        except StoreError as exc:
            raise CommandError(f"the Kubernetes API refused or failed: {exc}") from None
        finally:
            await store.close()

    asyncio.run(main())


def servicecidr_status_k8s(out: IO[str], *, kubeconfig: str = "") -> None:
    """``servicecidr status --kubernetes``: the record's phase and per-Service entries,
    every ServiceCIDR (terminating or not, finalizers) and the aliases still served.

    Raises:
        CommandError: the API server cannot be reached.
    """

    async def main() -> None:
        store = KubernetesStore(kubeconfig=kubeconfig, kinds=RECORD_KINDS)
        try:
            try:
                record: Resource | None = await store.get(migration.KIND, migration.NAME)
            except NotFound:
                record = None
            cidrs = (await store.list(model.CIDR_KIND)).items
            services = (await store.list(model.SERVICE_KIND)).items
        except StoreError as exc:
            raise CommandError(f"the Kubernetes API refused or failed: {exc}") from None
        finally:
            await store.close()
        if record is None:
            print("no ServiceCIDR migration", file=out)
        else:
            spec, status = record.get("spec") or {}, record.get("status") or {}
            print(f"migration to {spec.get('to')}: {migration.phase(record)}", file=out)
            entries = status.get("services") or {}
            if entries:
                print(f"  {'SERVICE':<36} {'OLD':<15} {'NEW':<15} {'STATE':<11} "
                      f"{'ALIAS LAST USED':<22} RELEASED", file=out)  # fmt: skip
            for name in sorted(entries):
                e = entries[name]
                print(f"  {name:<36} {e.get('old', ''):<15} {e.get('new', ''):<15} "
                      f"{e.get('state', ''):<11} {e.get('lastUsed') or 'never':<22} "
                      f"{'yes' if e.get('released') else 'no'}", file=out)  # fmt: skip
        print("ServiceCIDRs:", file=out)
        for c in cidrs:
            meta = c.get("metadata") or {}
            state = "terminating" if meta.get("deletionTimestamp") else "active"
            fins = ",".join(meta.get("finalizers") or [])
            print(f"  {meta.get('name'):<32} {','.join((c.get('spec') or {}).get('cidrs') or []):<18}"
                  f" {state}{f' (finalizers {fins})' if fins else ''}", file=out)  # fmt: skip
        served = [(model.key_of(s), ip) for s in services for ip in model.alias_ips(s)]
        print(f"aliases served: {len(served)}", file=out)
        for (ns, name), ip in served:
            print(f"  {ip} -> {ns}/{name}", file=out)

    asyncio.run(main())
