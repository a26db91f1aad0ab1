"""Deleting many objects at once (one job: ``Delete`` with a manifest or a label selector).

``cilia-operator delete -f FILE`` deletes every object the manifest's documents name;
``cilia-operator delete KIND -l SELECTOR`` every object of the kind whose labels match (as
``kubectl delete``). Either way all or nothing, as apply writes: one store transaction
(Redis: ``MULTI``/``EXEC``) after every check passed — each named object exists, no pool
is still held by a node — so a refused delete changes nothing.

The selector grammar is kubectl's equality-based one: terms joined by ``,`` (and), each
``key=value``, ``key==value``, ``key!=value``, ``key`` (has the label) or ``!key`` (has
not). Set-based terms (``in``, ``notin``) are refused with one line.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ..ipam import claims
from ..ipam import node as nodes
from ..kinds import IDENTITY, NODE, POOL, SERVICE_CIDR, KindInfo, UnknownKind, kind_of
from ..store import Resource, Snapshot, Store, Write

_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_TERM = re.compile(rf"^(?P<not>!)?(?P<key>{_KEY})(\s*(?P<op>==|!=|=)\s*(?P<value>{_VALUE}))?$")

BULK_REFUSED = (IDENTITY, SERVICE_CIDR)
"""Kinds whose delete does more than remove the object (an identity's number, a
ServiceCIDR's addresses): deleted one at a time only."""


class DeleteRefused(Exception):
    """Nothing was deleted: ``code`` (a ``grpc.StatusCode``) and the one-line reason."""

    def __init__(self, code: Any, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Target:
    """One object to delete: its kind, namespace ("" for cluster-scoped kinds), name."""

    info: KindInfo
    namespace: str
    name: str

    def display(self) -> str:
        where = f" -n {self.namespace}" if self.namespace else ""
        return f"{self.info.display(self.name)}{where}"


def parse_selector(text: str) -> Callable[[Mapping[str, str]], bool]:
    """The matcher of a label selector (grammar: the module docstring), e.g.
    ``parse_selector("app=web,tier!=db")({"app": "web"})`` is True.

    Raises:
        DeleteRefused: INVALID_ARGUMENT naming the term that is not understood.
    """
    checks: list[Callable[[Mapping[str, str]], bool]] = []
    for raw in text.split(","):
        term = raw.strip()
        match = _TERM.match(term)
        if not term or match is None or (match["not"] and match["op"]):
            raise DeleteRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"label_selector: term {term!r} is not understood (key=value, key==value, "
                "key!=value, key or !key, joined by ','; set-based terms are not supported)",
            )
        key, op, value = match["key"], match["op"], match["value"] or ""
        checks.append(_check(key, op, value, bool(match["not"])))
    return lambda labels: all(check(labels) for check in checks)


def _check(
    key: str, op: str | None, value: str, negated: bool
) -> Callable[[Mapping[str, str]], bool]:
    """One selector term as a test of a label set."""

    def test(labels: Mapping[str, str]) -> bool:
        if op in ("=", "=="):
            return labels.get(key) == value
        if op == "!=":
            return labels.get(key) != value
        return (key not in labels) if negated else (key in labels)

    return test


def _labels(obj: Resource) -> dict[str, str]:
    raw = (obj.get("metadata") or {}).get("labels") or {}
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def _find(items: Sequence[Resource], target: Target) -> Resource | None:
    for obj in items:
        meta = obj.get("metadata") or {}
        if meta.get("name") == target.name and (meta.get("namespace") or "") == target.namespace:
            return obj
    return None


def manifest_targets(
    docs: Sequence[Any], namespace_of: Callable[[KindInfo, str], str]
) -> list[Target]:
    """The objects the parsed documents name, in order, each once.

    Raises:
        DeleteRefused: INVALID_ARGUMENT naming the document that names no object of a
            served kind.
    """
    out: dict[tuple[str, str, str], Target] = {}
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise DeleteRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                f"document {i}: not a mapping")  # fmt: skip
        try:
            info = kind_of(str(doc.get("apiVersion") or ""), str(doc.get("kind") or ""))
        except UnknownKind as exc:
            raise DeleteRefused(grpc.StatusCode.INVALID_ARGUMENT, f"document {i}: {exc}") from None
        raw_meta = doc.get("metadata")
        meta: dict[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
        name = str(meta.get("name") or "")
        if not name:
            raise DeleteRefused(grpc.StatusCode.INVALID_ARGUMENT,
                                f"document {i}: metadata.name: required")  # fmt: skip
        target = Target(info, namespace_of(info, str(meta.get("namespace") or "")), name)
        out.setdefault((info.kind, target.namespace, name), target)
    return list(out.values())


async def delete_all(
    store: Store,
    *,
    targets: Sequence[Target] = (),
    selected: tuple[KindInfo, str, Callable[[Mapping[str, str]], bool]] | None = None,
    in_use: Callable[[str, list[str], list[Resource]], str],
    attempts: int = 5,
) -> list[Target]:
    """Delete every target (or every object of ``selected`` = (kind, namespace, matcher)),
    all or nothing, in one store transaction; returns what was deleted.

    Args:
        in_use: the refusal of a pool some node holds (pool name, holders, node records).

    Raises:
        DeleteRefused: INVALID_ARGUMENT (a kind deleted one at a time only), NOT_FOUND
            (every missing object named), FAILED_PRECONDITION (a pool in use); nothing
            deleted.
        StoreError: the store failed (Contention: it kept changing).
    """
    kinds = [t.info for t in targets] if selected is None else [selected[0]]
    for info in kinds:
        if info in BULK_REFUSED:
            raise DeleteRefused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{info.kind}: deleted one at a time only (cilia-operator delete KIND NAME)",
            )
    read = list(dict.fromkeys(info.kind for info in kinds))
    if POOL.kind in read:
        read += [NODE.kind, claims.KIND]
    done: list[Target] = []

    async def plan(snapshot: Snapshot) -> list[Write]:
        found: list[tuple[Target, Resource]] = []
        if selected is not None:
            info, namespace, matches = selected
            for obj in snapshot[info.kind].items:
                meta = obj.get("metadata") or {}
                if (meta.get("namespace") or "") == namespace and matches(_labels(obj)):
                    found.append((Target(info, namespace, str(meta.get("name"))), obj))
        else:
            missing: list[str] = []
            for target in targets:
                current = _find(snapshot[target.info.kind].items, target)
                if current is None:
                    missing.append(target.display())
                else:
                    found.append((target, current))
            if missing:
                raise DeleteRefused(grpc.StatusCode.NOT_FOUND,
                                    f"not found: {', '.join(missing)}; nothing deleted")  # fmt: skip
        pools = [t.name for t, _ in found if t.info is POOL]
        if pools:
            records = snapshot[NODE.kind].items
            held = nodes.pools_in_use(records)
            claimed: dict[str, set[str]] = {}
            for obj in snapshot[claims.KIND].items:
                claim = claims.claim_from_resource(obj)
                if claim is not None:
                    claimed.setdefault(claim.pool, set()).add(claim.node)
            for pool in pools:
                holders = sorted({*held.get(pool, []), *claimed.get(pool, set())})
                if holders:
                    raise DeleteRefused(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"{in_use(pool, holders, records)}; nothing deleted")  # fmt: skip
        done[:] = [t for t, _ in found]
        return [Write("delete", obj) for _, obj in found]

    await store.transact(read, plan, attempts=attempts)
    return done


def pool_in_use_message(
    display: str, pool: str, holders: list[str], records: list[dict[str, Any]]
) -> str:
    """The refusal of a pool delete: per holder node the blocks it holds and the addresses
    its agent still requests from the pool, and when that ends, e.g. ``ciliumpodippool.
    cilium.io/blue is in use by node(s) n1: node n1 holds 10.1.0.0/24 and requests 1
    address(es) from it (pods of the pool on that node, or a pod add still waiting) ...``.

    An agent requests addresses for its running pods and for a failed pod add until that
    pod is deleted -- at the latest its ``--ipam-pending-allocation-ttl`` (default 300 s)
    after the failure -- and hands the blocks back by itself once it requests none.
    """
    by_name = {nodes.node_name(r): r for r in records}
    parts = []
    for name in holders:
        record = by_name.get(name)
        blocks = [str(b) for b in nodes.allocated(record).get(pool, [])] if record else []
        wanted = nodes.requested(record).get(pool, 0) if record else 0
        part = f"node {name} " + (
            f"holds {', '.join(blocks)}" if blocks else "is being given a block (claim in flight)"
        )
        if wanted:
            part += (
                f" and requests {wanted} address(es) from it (pods of the pool on that node, "
                "or a pod add still waiting)"
            )
        elif blocks:
            part += " and requests none from it any more (its agent hands the blocks back now)"
        parts.append(part)
    return (
        f"{display} is in use by node(s) {', '.join(holders)}: {'; '.join(parts)}. "
        "Delete the pool's pods first; an agent requests addresses for a failed pod add until "
        "that pod is deleted, at the latest its --ipam-pending-allocation-ttl (default 300 s) "
        "after the failure, then hands the blocks back: retry the delete after that"
    )
