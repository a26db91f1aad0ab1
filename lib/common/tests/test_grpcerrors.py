"""A real grpc.aio server aborts with an ErrorInfo reason; real clients read it back."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from cilia_common import grpcerrors

METHOD = "/cilia.test.v1.Test/Allocate"


async def _allocate(request: bytes, context: Any) -> bytes:
    if request == b"exhausted":
        await grpcerrors.abort(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "pool 'default' has no free address",
            reason="POOL_EXHAUSTED",
            domain=grpcerrors.AGENT_DOMAIN,
            metadata={"pool": "default"},
        )
    if request == b"plain":
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no reason given")
    return b"ok"


async def _server() -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "cilia.test.v1.Test", {"Allocate": grpc.unary_unary_rpc_method_handler(_allocate)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _call(target: str, request: bytes) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await channel.unary_unary(METHOD)(request, timeout=5)
    return err.value


def test_an_aio_client_reads_the_reason_domain_and_metadata() -> None:
    async def scenario() -> None:
        server, target = await _server()
        try:
            err = await _call(target, b"exhausted")
        finally:
            await server.stop(None)
        assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.details() == "pool 'default' has no free address"
        assert grpcerrors.error_reason(err) == "POOL_EXHAUSTED"
        info = grpcerrors.error_info(err)
        assert info is not None
        assert info.domain == "agent.cilia.io" and dict(info.metadata) == {"pool": "default"}
        # the trailer holds a google.rpc.Status with the same code and message
        raw = dict(err.trailing_metadata())[grpcerrors.DETAILS_KEY]
        status = status_pb2.Status.FromString(raw)
        assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert status.message == "pool 'default' has no free address"
        assert status.details[0].TypeName() == error_details_pb2.ErrorInfo.DESCRIPTOR.full_name

    asyncio.run(scenario())


def test_a_sync_client_reads_the_reason_too() -> None:
    async def scenario() -> None:
        server, target = await _server()
        try:

            def call() -> grpc.RpcError:
                with grpc.insecure_channel(target) as channel:
                    try:
                        channel.unary_unary(METHOD)(b"exhausted", timeout=5)
                    except grpc.RpcError as exc:
                        return exc
                raise AssertionError("the call succeeded")

            err = await asyncio.to_thread(call)
        finally:
            await server.stop(None)
        assert grpcerrors.error_reason(err) == "POOL_EXHAUSTED"

    asyncio.run(scenario())


def test_an_error_without_details_has_no_reason() -> None:
    async def scenario() -> None:
        server, target = await _server()
        try:
            err = await _call(target, b"plain")
        finally:
            await server.stop(None)
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        assert grpcerrors.error_reason(err) is None
        assert grpcerrors.error_info(err) is None

    asyncio.run(scenario())


def test_garbage_in_the_trailer_is_no_reason() -> None:
    assert grpcerrors.error_info_from_trailers([(grpcerrors.DETAILS_KEY, b"\xff\xff")]) is None
    assert grpcerrors.error_info_from_trailers(None) is None


@pytest.mark.parametrize("reason", ["pool_exhausted", "PoolExhausted", "X", "A-B", ""])
def test_a_reason_must_be_upper_snake(reason: str) -> None:
    with pytest.raises(ValueError, match="UPPER_SNAKE"):
        grpcerrors.rich_status(grpc.StatusCode.INTERNAL, "m", reason=reason, domain="d")


def test_an_ok_status_is_refused() -> None:
    with pytest.raises(ValueError, match="OK"):
        grpcerrors.rich_status(grpc.StatusCode.OK, "m", reason="NOT_READY", domain="d")


def test_a_message_quoting_a_lone_surrogate_stays_a_valid_status() -> None:
    """JSON ``"\\ud800"`` decodes to a lone surrogate; quoted in an error message it must
    not turn the status into UNKNOWN (found by the operator's apply fuzz test)."""
    status = grpcerrors.rich_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        "kind: '\ud800' is not served",
        reason="INVALID_ARGUMENT",
        domain=grpcerrors.OPERATOR_DOMAIN,
        metadata={"kind": "\ud800"},
    )
    assert status.details == "kind: '\\ud800' is not served"
    status.details.encode("utf-8")
