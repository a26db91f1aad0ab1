"""``apply``, ``get`` and ``delete``: manifests and resources through the ResourceService."""

from __future__ import annotations

import json
import sys
import uuid
from typing import IO, Any

import grpc
import yaml

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia_common.grpcerrors import error_reason
from cilia_common.tls import (
    ClientTLS,
)

from ..kinds import UnknownKind, kind_of, resolve_kind
from ..manifests import parse_manifest
from .connection import (
    CommandError,
    call,
    resource_stub,
    rpc_error,
)


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
    text = read_manifest(path)
    stub = resource_stub(server, tls)
    request_id = str(uuid.uuid4())
    try:
        response = stub.Apply(
            pb.ApplyRequest(manifest=text, dry_run=dry_run, request_id=request_id),
            timeout=timeout,
        )
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.ABORTED and error_reason(exc) == "APPLY_ABANDONED":
            # the operator fenced it at its deadline (a moment before the client's): a
            # definite "nothing written", said as the read-back below says it
            raise CommandError(
                f"apply did not answer within --timeout {timeout:g}s and nothing was written "
                f"({exc.details()}); the operator writes all documents of a manifest or none; "
                "retry (e.g. with a longer --timeout)"
            ) from None
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or dry_run:
            raise rpc_error(exc, server) from None
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
    stub = resource_stub(server, tls)
    scope = (namespace or "default") if info.namespaced else ""
    if name:
        request = pb.GetRequest(kind=info.kind, name=name, namespace=scope)
        response = call(stub.Get, request, server, timeout)
        print(_render(json.loads(response.resource.json), output), file=out)
        return
    response = call(stub.List, pb.ListRequest(kind=info.kind), server, timeout)
    items = [json.loads(r.json) for r in response.items]
    if info.namespaced and namespace is not None:
        items = [i for i in items if (i.get("metadata") or {}).get("namespace") == namespace]
    print(_render({"apiVersion": "v1", "kind": "List", "items": items}, output), file=out)


def read_manifest(path: str) -> str:
    """The text of the manifest at ``path`` (``-`` = stdin).

    Raises:
        CommandError: unreadable, or not UTF-8.
    """
    try:
        return sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise CommandError(
            f"cannot read {path}: not UTF-8 text (byte {exc.start}); give a YAML or JSON manifest"
        ) from None


def delete_many(
    server: str,
    timeout: float,
    out: IO[str],
    *,
    filename: str = "",
    kind: str = "",
    selector: str = "",
    namespace: str = "default",
    tls: ClientTLS | None = None,
) -> None:
    """``delete -f FILE`` (every object the manifest names) or ``delete KIND -l SELECTOR``
    (every object of the kind whose labels match), all or nothing on the operator's side;
    prints one ``ciliumnetworkpolicy.cilium.io/web deleted`` line per object, or
    ``No resources found`` (a selector matching nothing).

    Raises:
        CommandError: unreadable file, unknown kind, refused (nothing deleted: a missing
            object, a pool in use, a bad selector), unreachable operator.
    """
    if filename:
        request = pb.DeleteRequest(manifest=read_manifest(filename))
    else:
        try:
            info = resolve_kind(kind)
        except UnknownKind as exc:
            raise CommandError(str(exc)) from None
        request = pb.DeleteRequest(kind=info.kind, label_selector=selector,
                                   namespace=namespace if info.namespaced else "")  # fmt: skip
    response = call(resource_stub(server, tls).Delete, request, server, timeout)
    if not response.resources:
        print("No resources found", file=out)
    for res in response.resources:
        where = f" (namespace {res.namespace})" if res.namespace else ""
        print(f"{resolve_kind(res.kind).display(res.name)} deleted{where}", file=out)


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
    stub = resource_stub(server, tls)
    call(stub.Delete, request, server, timeout)
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
