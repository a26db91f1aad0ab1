"""Client commands: ``apply``, ``get`` and ``delete`` against a running operator.

Each returns the process exit status: 0 on success; on failure one line on stderr and
status 2 (bad input, not found, refused) -- never a traceback.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

import grpc
import yaml

from cilia.controlplane.v1 import controlplane_pb2 as pb
from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc

from .kinds import UnknownKind, kind_of, resolve_kind

EXIT_ERROR = 2


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
