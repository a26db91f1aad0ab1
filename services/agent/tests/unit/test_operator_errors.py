"""How the agent classifies a failed operator call, over a real gRPC channel.

An operator that answers INVALID_ARGUMENT (a request that can never succeed, e.g. a pod
name that is no DNS-1123 subdomain) must reach the CNI as INVALID_ARGUMENT (code 7), not as
UNAVAILABLE (code 11, "try again later": a runtime would retry it forever).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from cilia.controlplane.v1 import controlplane_pb2 as cp
from cilia.controlplane.v1 import controlplane_pb2_grpc as cp_grpc
from cilia_agent.api import _CODES
from cilia_agent.controlplane import OperatorAPI, OperatorRejected, OperatorUnavailable


class RefusingOperator(cp_grpc.IdentityServiceServicer, cp_grpc.EndpointServiceServicer):  # type: ignore[misc]
    """Answers every Allocate/UpsertEndpoint with ``code``."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    async def Allocate(self, request: cp.AllocateRequest, context: Any) -> cp.AllocateResponse:  # noqa: N802
        await context.abort(self.code, "name: 'reA' is not a valid name (test)")

    async def UpsertEndpoint(  # noqa: N802
        self, request: cp.UpsertEndpointRequest, context: Any
    ) -> cp.UpsertEndpointResponse:
        await context.abort(self.code, "name: 'reA' is not a valid name (test)")


async def _call_both(code: grpc.StatusCode) -> list[BaseException]:
    server = grpc.aio.server()
    servicer = RefusingOperator(code)
    cp_grpc.add_IdentityServiceServicer_to_server(servicer, server)
    cp_grpc.add_EndpointServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    api = OperatorAPI(
        address=f"127.0.0.1:{port}", node_name="n1", timeout=5.0, min_backoff=0.1, max_backoff=1
    )
    errors: list[BaseException] = []
    try:
        for call in (
            lambda: api.allocate_identity(["k8s:app=x"]),
            lambda: api.upsert_endpoint(cp.EndpointRecord(namespace="default", name="reA")),
        ):
            try:
                await call()
            except OperatorUnavailable as exc:
                errors.append(exc)
    finally:
        await api.channel.close()
        await server.stop(None)
    return errors


def _status_for(exc: BaseException) -> grpc.StatusCode:
    return next(code for kind, code, _reason in _CODES if isinstance(exc, kind))


def test_operator_invalid_argument_is_a_permanent_rejection_mapped_to_invalid_argument() -> None:
    errors = asyncio.run(_call_both(grpc.StatusCode.INVALID_ARGUMENT))

    assert len(errors) == 2
    for exc in errors:
        assert isinstance(exc, OperatorRejected), exc
        assert "INVALID_ARGUMENT" in str(exc) and "not a valid name" in str(exc)
        assert _status_for(exc) == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED]
)
def test_other_operator_failures_stay_unavailable(code: grpc.StatusCode) -> None:
    errors = asyncio.run(_call_both(code))

    assert len(errors) == 2
    for exc in errors:
        assert not isinstance(exc, OperatorRejected), exc
        assert _status_for(exc) == grpc.StatusCode.UNAVAILABLE
