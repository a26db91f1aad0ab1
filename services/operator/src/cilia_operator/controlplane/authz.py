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
* node-scoped writes (``Register``, ``UpdateDemand``, ``WatchAllocations``,
  ``UpsertEndpoint``, ``DeleteEndpoint``, ``Allocate``, ``Release``): an administrator, or
  the agent of the node named in the request (``node_name``; ``endpoint.node_name`` for
  ``UpsertEndpoint``); an empty node name is another node's;
* resource writes (``ResourceService.Apply``/``Delete``/``ApplyOutcome``) and any method of
  ``cilia.controlplane.v1`` not listed here: administrators only (fail closed, so a new
  method is admin-only until it gets a rule).

A refusal is PERMISSION_DENIED with ``google.rpc.ErrorInfo`` reason ``PERMISSION_DENIED``
(domain ``operator.cilia.io``, metadata ``method``, ``identity`` and, for node-scoped
methods, ``node``), raised before the handler runs, so nothing changes. Without TLS
(``--disable-tls``, loopback) the interceptor is not installed and nothing is checked.

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
PACKAGE = "/cilia.controlplane.v1."


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


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Checks :data:`RULES` before each handler runs (unary and server-streaming requests;
    the control plane has no client streams)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        """Wrap the method's handler with the check of its rule."""
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        rule = rule_for(method)
        if handler is None or rule.kind == "read":
            # reads need only a verified certificate, which the handshake already demanded
            return handler

        async def check(request: Any, context: Any) -> None:
            why, meta = refusal(rule, peer_identity(context), request)
            if why:
                await grpcerrors.abort(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{method}: {why}",
                    reason=REASON,
                    domain=grpcerrors.OPERATOR_DOMAIN,
                    metadata={"method": method, **meta},
                )

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
