"""Authorisation of control-plane RPCs by the client certificate (mutual TLS only).

Who a caller is comes from its verified certificate (:func:`cilia_common.tls.peer_identity`):

* an **agent** is ``CN=system:node:<node>, O=system:nodes``, the shape of a kubelet's client
  certificate that Kubernetes' Node authorizer uses, so the names read as they do in a
  cluster's RBAC;
* an **administrator** is any certificate in ``O=system:masters`` (the group the API server
  treats as cluster-admin);
* any other verified certificate is an authenticated client with no rights beyond reads.

Rules (:data:`RULES`, one per method; the order of checks is: identity present, rule):

* reads and watches (``Get``, ``List``, ``Watch*``, ``ResolvePool``, ``GetStatus``, health,
  reflection): every authenticated client;
* node-scoped writes (``Register``, ``ReportAliasUse``, ``UpdateDemand``, ``WatchAllocations``,
  ``UpsertEndpoint``, ``DeleteEndpoint``, ``Allocate``, ``Release``): an administrator, or
  the agent of the node named in the request (``node_name``; ``endpoint.node_name`` for
  ``UpsertEndpoint``); an empty node name is another node's;
* resource writes (``ResourceService.Apply``/``Delete``/``ApplyOutcome``) and any method of
  ``cilia.controlplane.v1`` not listed here: administrators only (fail closed, so a new
  method is admin-only until it gets a rule).
* **Kubernetes mode** (``--store kubernetes``): resource writes (:data:`RESOURCE_WRITES`) are
  refused for every caller, administrators included, with FAILED_PRECONDITION, reason
  ``RESOURCES_VIA_API_SERVER``, naming ``kubectl``: resources are changed through the API
  server (its RBAC, admission and audit), and the operator's gRPC serves agents only. This
  holds with or without TLS (the interceptor is installed in Kubernetes mode either way).
* **Records owned by another node**: an agent that sends its own node name with the name
  of an endpoint whose record belongs to another, still registered node (the pod name was
  reused there) must not take it over. The handler checks that, because only it reads the
  record: :func:`foreign_record_refusal` (``UpsertEndpoint``; ``DeleteEndpoint`` already
  leaves another node's record alone with FAILED_PRECONDITION, which the agent takes as
  "not mine").

A refusal is PERMISSION_DENIED with ``google.rpc.ErrorInfo`` reason ``PERMISSION_DENIED``
(domain ``operator.cilia.io``, metadata ``method``, ``identity`` and, for node-scoped
methods, ``node``), raised before the handler runs (or, for another node's record, before
the handler writes), so nothing changes. Without TLS (``--disable-tls``, loopback) no
identity is checked (only the Kubernetes-mode rule applies).

Source: Kubernetes' Node authorizer (a node writes only its own Node, its pods' status) and
the ``system:masters`` group; the issue's rule that an agent writes only its own records.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from cilia_common import grpcerrors
from cilia_common.tls import PeerIdentity, peer_identity

REASON = "PERMISSION_DENIED"
KUBERNETES_REASON = "RESOURCES_VIA_API_SERVER"
PACKAGE = "/cilia.controlplane.v1."
RESOURCE_WRITES = frozenset(
    {"ResourceService/Apply", "ResourceService/Delete", "ResourceService/ApplyOutcome"}
)
"""Methods refused in Kubernetes mode whoever calls (``cilia-operator apply``/``delete``)."""


@dataclass(frozen=True)
class Rule:
    """Who may call one method.

    Attributes:
        kind: ``"read"`` (any authenticated client), ``"node"`` (admin or the agent of
            the request's node) or ``"admin"``.
        node_field: dotted path of the node name in the request (``"endpoint.node_name"``),
            for ``"node"`` rules.
    """

    kind: str
    node_field: str = ""


_READ = Rule("read")
_ADMIN = Rule("admin")
_NODE = Rule("node", "node_name")

RULES: dict[str, Rule] = {
    "NodeService/Register": _NODE,
    "NodeService/WatchNodes": _READ,
    "NodeService/ReportAliasUse": _NODE,
    "IPAMService/UpdateDemand": _NODE,
    "IPAMService/WatchAllocations": _NODE,
    "IPAMService/ResolvePool": _READ,
    "IPAMService/GetStatus": _READ,
    "ResourceService/Apply": _ADMIN,
    "ResourceService/Delete": _ADMIN,
    "ResourceService/ApplyOutcome": _ADMIN,
    "ResourceService/Get": _READ,
    "ResourceService/List": _READ,
    "IdentityService/Allocate": _NODE,
    "IdentityService/Release": _NODE,
    "IdentityService/WatchIdentities": _READ,
    "EndpointService/UpsertEndpoint": Rule("node", "endpoint.node_name"),
    "EndpointService/DeleteEndpoint": _NODE,
    "EndpointService/WatchIPCache": _READ,
    "PolicyService/WatchPolicies": _READ,
    "PodService/WatchPods": _READ,
    "ServiceService/WatchServices": _READ,
}
"""Method (``Service/Method`` within ``cilia.controlplane.v1``) -> rule."""


def rule_for(method: str) -> Rule:
    """The rule of a full method name (``/cilia.controlplane.v1.NodeService/Register``):
    its entry in :data:`RULES`; other ``cilia.controlplane.v1`` methods are admin-only;
    methods outside that package (health, reflection) are reads."""
    if not method.startswith(PACKAGE):
        return _READ
    return RULES.get(method[len(PACKAGE) :], _ADMIN)


def _field(request: Any, path: str) -> str:
    value = request
    for part in path.split("."):
        value = getattr(value, part, "")
    return str(value)


def refusal(rule: Rule, who: PeerIdentity | None, request: Any) -> tuple[str, dict[str, str]]:
    """``("", {})`` when ``who`` may make a call under ``rule`` with ``request``; else the
    message and ErrorInfo metadata of the refusal."""
    if who is None:
        return "no verified client certificate", {}
    if rule.kind == "read" or who.is_admin:
        return "", {}
    meta = {"identity": who.describe()}
    if rule.kind == "admin":
        return f"{who.describe()} is not an administrator (O=system:masters)", meta
    node = _field(request, rule.node_field)
    meta["node"] = node
    if not who.node:
        return f"{who.describe()} is not a node (CN=system:node:<name>, O=system:nodes)", meta
    if who.node != node:
        return f"node {who.node!r} may not act for node {node!r} ({rule.node_field})", meta
    return "", {}


def kubernetes_mode_refusal(method: str) -> str:
    """The message refusing ``method`` (a full method name) in Kubernetes mode, or ""
    when the method is allowed there (everything but :data:`RESOURCE_WRITES`)."""
    if not method.startswith(PACKAGE) or method[len(PACKAGE) :] not in RESOURCE_WRITES:
        return ""
    return (
        f"{method}: the operator runs with --store kubernetes, where resources are changed "
        "through the Kubernetes API server (kubectl apply -f / kubectl delete), not over "
        "the operator's gRPC, which serves agents only"
    )


def foreign_record_refusal(who: PeerIdentity | None, owner: str, node: str) -> str:
    """Why ``who`` may not write a record owned by node ``owner`` as node ``node``, or "".

    Allowed: no identity (plaintext listener, nothing is authenticated), an administrator,
    a record without an owner or owned by ``node`` itself. The caller has already passed
    :data:`RULES` (``node`` is the caller's own node). The handler decides separately
    whether ``owner`` still exists (a departed node's records may be taken over).
    """
    if who is None or who.is_admin or not owner or owner == node:
        return ""
    return f"the record belongs to node {owner!r}; node {node!r} may not overwrite it"


async def deny(context: Any, method: str, why: str, meta: dict[str, str]) -> None:
    """End the RPC with PERMISSION_DENIED (reason :data:`REASON`, ``method`` + ``meta`` in
    the ErrorInfo metadata). Raises ``grpc.aio.AbortError`` always."""
    await grpcerrors.abort(
        context,
        grpc.StatusCode.PERMISSION_DENIED,
        f"{method}: {why}",
        reason=REASON,
        domain=grpcerrors.OPERATOR_DOMAIN,
        metadata={"method": method, **meta},
    )


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks :data:`RULES` before each handler runs (unary and server-streaming requests;
    the control plane has no client streams).

    Args:
        authorise: check the peer certificate against :data:`RULES` (mutual TLS on).
        kubernetes: refuse :data:`RESOURCE_WRITES` to everyone (``--store kubernetes``).
    """

    def __init__(self, *, authorise: bool = True, kubernetes: bool = False) -> None:
        self.authorise = authorise
        self.kubernetes = kubernetes

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the method's handler with the check of its rule."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        rule = rule_for(method)
        in_kubernetes = kubernetes_mode_refusal(method) if self.kubernetes else ""
        if handler is None or (not in_kubernetes and (rule.kind == "read" or not self.authorise)):
            # reads need only a verified certificate, which the handshake already demanded
            return handler

        async def check(request: Any, context: Any) -> None:
            if in_kubernetes:
                await grpcerrors.abort(
                    context,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    in_kubernetes,
                    reason=KUBERNETES_REASON,
                    domain=grpcerrors.OPERATOR_DOMAIN,
                    metadata={"method": method},
                )
            if not self.authorise:
                return
            why, meta = refusal(rule, peer_identity(context), request)
            if why:
                await deny(context, method, why, meta)

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: Any) -> Any:
                await check(request, context)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                await check(request, context)
                responses = inner_us(request, context)
                try:
                    async for response in responses:
                        yield response
                finally:
                    # a cancelled stream ends the handler's generator now (its store watch
                    # stops), not whenever it is collected
                    if isinstance(responses, AsyncGenerator):
                        await responses.aclose()

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        # client streams carry no single request to check
        return grpc.unary_unary_rpc_method_handler(_denied(method))


def _denied(method: str) -> Callable[[Any, Any], Awaitable[Any]]:
    async def deny(request: Any, context: Any) -> Any:
        await grpcerrors.abort(
            context,
            grpc.StatusCode.PERMISSION_DENIED,
            f"{method}: client-streaming methods are not authorised",
            reason=REASON,
            domain=grpcerrors.OPERATOR_DOMAIN,
            metadata={"method": method},
        )

    return deny
