"""When an alias VIP of a migrated Service may be released: "connection tracking tells".

Each agent's socket load balancer stamps the time of every ``connect()``/``sendmsg()`` to
an alias VIP (``bpf/bpf_sock.c``, map ``cilia_lb4_alias_use``); the agent reports those
times with ``NodeService.ReportAliasUse`` (``alias_uses``: per alias, whether it was used
and how many milliseconds ago) every ``--alias-use-report-interval`` while it serves
aliases, and once per session with ``NodeService.Register`` (``reports_alias_use``,
``alias_uses``; an older agent sends every report that way). The operator turns each report
into an absolute time on its own clock (receipt time minus the idle duration, so the
nodes' clocks do not matter) and keeps one record per node, kind
:data:`USE_KIND`, name the node, in the store:

    status: {reportedAt: <RFC 3339>, lastUsed: {"<alias ip>": <RFC 3339>, ...}}

A use only moves a time forward (a later report never makes an alias look older).

Release rule (:func:`judge`): an alias is released when ``now - max(since, last use on
any node) >= grace`` (``--service-alias-grace-period``), where ``since`` is when it
became an alias. Only new connections need the VIP: the socket load balancer connects a
socket to the backend itself, so established connections made through the alias are
untouched by its release.

Limit: a node whose agent cannot reach the operator reports nothing; its uses are not
seen. Choose a grace period longer than an agent outage you expect (the default, one
hour, is far longer than the agents' reconnect backoff).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..store import AlreadyExists, Conflict, NotFound, Resource, Store
from . import model

Addr = ipaddress.IPv4Address

USE_KIND = "CiliaServiceAliasUse"
USE_API_VERSION = "cilia.io/v1alpha1"
DEFAULT_GRACE_SECONDS = 3600.0
"""``--service-alias-grace-period`` default: one hour without a use."""


def record_use(
    current: Resource | None,
    node: str,
    uses: Iterable[tuple[str, bool, int]],
    now: datetime.datetime,
) -> Resource:
    """The alias-use record of ``node`` after a report received at ``now``.

    Args:
        current: the stored record (None when there is none).
        uses: ``(alias ip, used, idle milliseconds)`` as the agent sent them; addresses
            that are not IPv4 are skipped.

    Returns:
        the new record (``metadata.resourceVersion`` of ``current`` kept, so an update is
        conditional). Times only move forward.
    """
    status = dict((current or {}).get("status") or {})
    last = dict(status.get("lastUsed") or {})
    for ip, used, idle_ms in uses:
        try:
            text = str(Addr(ip))
        except ValueError:
            continue
        if not used:
            continue
        seen = now - datetime.timedelta(milliseconds=max(0, int(idle_ms)))
        before = model.parse_time(str(last.get(text) or ""))
        if before is None or seen > before:
            last[text] = model.rfc3339(seen)
    meta: dict[str, Any] = {"name": node}
    rv = ((current or {}).get("metadata") or {}).get("resourceVersion")
    if rv:
        meta["resourceVersion"] = rv
    return {
        "apiVersion": USE_API_VERSION,
        "kind": USE_KIND,
        "metadata": meta,
        "status": {"reportedAt": model.rfc3339(now), "lastUsed": last},
    }


def last_uses(records: Iterable[Mapping[str, Any]]) -> dict[Addr, datetime.datetime]:
    """The latest use of every alias over all nodes' records."""
    out: dict[Addr, datetime.datetime] = {}
    for rec in records:
        for ip, text in ((rec.get("status") or {}).get("lastUsed") or {}).items():
            when = model.parse_time(str(text))
            try:
                addr = Addr(str(ip))
            except ValueError:
                continue
            if when is not None and (addr not in out or when > out[addr]):
                out[addr] = when
    return out


@dataclass(frozen=True)
class Verdict:
    """One alias of one Service: ``service`` ``ns/name``, ``ip``, ``since`` (when it became
    an alias, None when unknown), ``last_used`` (None: never seen used), ``release``
    (True: idle for the whole grace period), ``idle_seconds`` (since the later of the two)."""

    service: str
    ip: Addr
    since: datetime.datetime | None
    last_used: datetime.datetime | None
    release: bool
    idle_seconds: float


def judge(
    services: Iterable[Resource],
    records: Iterable[Mapping[str, Any]],
    now: datetime.datetime,
    grace: float,
) -> list[Verdict]:
    """Every alias of ``services`` with its release verdict (module docstring's rule).

    Args:
        services: Service records (their :data:`model.ALIAS_ANNOTATION`).
        records: every node's :data:`USE_KIND` record.
        now: the operator's clock; grace: seconds.

    An alias without a valid ``since`` counts from ``now`` (it is never released before
    the grace period has been watched whole).
    """
    uses = last_uses(records)
    out = []
    for svc in services:
        key = model.key_of(svc)
        for ip, since_text in sorted(model.alias_ips(svc).items()):
            since = model.parse_time(since_text)
            last = uses.get(ip)
            start = max(t for t in (since or now, last) if t is not None)
            idle = (now - start).total_seconds()
            out.append(Verdict(f"{key[0]}/{key[1]}", ip, since, last, idle >= grace, idle))
    return out


async def store_report(
    store: Store,
    node: str,
    uses: Iterable[tuple[str, bool, int]],
    now: datetime.datetime,
    attempts: int = 5,
) -> None:
    """Record one node's report (``NodeService.ReportAliasUse``, or ``Register`` with
    ``reports_alias_use``) in its :data:`USE_KIND` record, retrying a resourceVersion
    conflict up to ``attempts`` times.

    Raises:
        StoreError: the store failed, or kept conflicting.
    """
    listed = list(uses)
    for attempt in range(attempts):
        try:
            current: Resource | None = await store.get(USE_KIND, node)
        except NotFound:
            current = None
        desired = record_use(current, node, listed, now)
        try:
            if current is None:
                await store.create(desired)
            else:
                await store.update(desired)
            return
        except (Conflict, AlreadyExists):
            if attempt == attempts - 1:
                raise
