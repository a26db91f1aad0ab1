"""The shared gRPC bootstrap: health starts NOT_SERVING, flips on demand, reflection lists services."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pathlib
import socket
import stat
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cilia_common.grpcserver import (
    BindError,
    bound_port,
    set_serving,
    start_server,
    start_server_with_ports,
)
from cilia_common.logs import JSONFormatter, setup_logging


def test_unix_socket_is_root_only_and_health_flips(tmp_path: pathlib.Path) -> None:
    sock = tmp_path / "sub" / "svc.sock"

    async def scenario() -> tuple[int, int, int]:
        server, health = await start_server([], [f"unix:{sock}"])
        try:
            mode = stat.S_IMODE(os.stat(sock).st_mode)
            async with grpc.aio.insecure_channel(f"unix:{sock}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                before = (await stub.Check(health_pb2.HealthCheckRequest())).status
                await set_serving(health, [])
                after = (await stub.Check(health_pb2.HealthCheckRequest())).status
            return mode, before, after
        finally:
            await server.stop(0)

    mode, before, after = asyncio.run(scenario())
    assert mode == 0o600
    assert before == health_pb2.HealthCheckResponse.NOT_SERVING
    assert after == health_pb2.HealthCheckResponse.SERVING


def test_stale_socket_file_is_replaced(tmp_path: pathlib.Path) -> None:
    sock = tmp_path / "svc.sock"
    sock.write_text("left over by a killed process")

    async def scenario() -> bool:
        server, _ = await start_server([], [f"unix:{sock}"])
        try:
            return sock.is_socket()
        finally:
            await server.stop(0)

    assert asyncio.run(scenario())


def test_reflection_lists_health_service(tmp_path: pathlib.Path) -> None:
    sock = tmp_path / "svc.sock"

    async def scenario() -> list[str]:
        server, _ = await start_server([], [f"unix:{sock}"])
        try:
            async with grpc.aio.insecure_channel(f"unix:{sock}") as ch:
                stub = reflection_pb2_grpc.ServerReflectionStub(ch)
                call = stub.ServerReflectionInfo()
                await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                await call.done_writing()
                names: list[str] = []
                async for resp in call:
                    names += [s.name for s in resp.list_services_response.service]
                return names
        finally:
            await server.stop(0)

    assert "grpc.health.v1.Health" in asyncio.run(scenario())


def test_tcp_port_in_use_raises_bind_error() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]

    async def scenario() -> None:
        server, _ = await start_server([], [f"127.0.0.1:{port}"])
        await server.stop(0)

    try:
        with pytest.raises(BindError, match=str(port)):
            asyncio.run(scenario())
    finally:
        holder.close()


def test_log_line_is_json_with_extra_fields() -> None:
    record = logging.LogRecord(
        "cilia.test", logging.INFO, __file__, 1, "endpoint %s", ("up",), None
    )
    record.container_id = "abc123"
    line = json.loads(JSONFormatter("cilia-agent").format(record))
    assert line["msg"] == "endpoint up"
    assert line["component"] == "cilia-agent"
    assert line["container_id"] == "abc123"
    assert line["level"] == "info"


def test_unknown_log_level_is_refused() -> None:
    with pytest.raises(ValueError, match="verbose"):
        setup_logging("cilia-test", "verbose")


def test_start_server_with_ports_reports_the_port_bound_for_port_zero(
    tmp_path: pathlib.Path,
) -> None:
    sock = tmp_path / "svc.sock"

    async def scenario() -> tuple[dict[str, int], int]:
        server, health, ports = await start_server_with_ports([], ["127.0.0.1:0", f"unix:{sock}"])
        try:
            await set_serving(health, [])
            address = bound_port("127.0.0.1:0", ports["127.0.0.1:0"])
            async with grpc.aio.insecure_channel(address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                status = (await stub.Check(health_pb2.HealthCheckRequest())).status
            return ports, status
        finally:
            await server.stop(0)

    ports, status = asyncio.run(scenario())
    assert list(ports) == ["127.0.0.1:0"] and ports["127.0.0.1:0"] > 0
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_second_server_on_the_same_port_is_refused() -> None:
    async def scenario() -> None:
        first, _, ports = await start_server_with_ports([], ["127.0.0.1:0"])
        try:
            with pytest.raises(BindError, match=str(ports["127.0.0.1:0"])):
                await start_server([], [f"127.0.0.1:{ports['127.0.0.1:0']}"])
        finally:
            await first.stop(0)

    asyncio.run(scenario())


def test_unparsable_request_bytes_get_invalid_argument_and_streams_still_work(
    tmp_path: pathlib.Path,
) -> None:
    """grpcio answers bytes that do not parse as the request with UNKNOWN (and logs a
    traceback); the server's guard makes it INVALID_ARGUMENT naming the method, for unary
    and server-streaming methods, while well-formed calls (health Check, and Watch, which
    writes with context.write) work as before."""
    sock = tmp_path / "svc.sock"
    identity: Any = None

    async def scenario() -> list[Any]:
        server, _ = await start_server([], [f"unix:{sock}"])
        try:
            async with grpc.aio.insecure_channel(f"unix:{sock}") as ch:
                out: list[Any] = []
                for kind, method in (("unary_unary", "Check"), ("unary_stream", "Watch")):
                    call = getattr(ch, kind)(
                        f"/grpc.health.v1.Health/{method}",
                        request_serializer=identity, response_deserializer=identity,
                    )(b"\xff\xff\xff", timeout=5)  # fmt: skip
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await (call if kind == "unary_unary" else call.read())
                    out.append((caught.value.code(), caught.value.details()))
                stub = health_pb2_grpc.HealthStub(ch)
                out.append((await stub.Check(health_pb2.HealthCheckRequest())).status)
                watch = stub.Watch(health_pb2.HealthCheckRequest())
                out.append((await watch.read()).status)
                watch.cancel()
                return out
        finally:
            await server.stop(0)

    check, watch, checked, watched = asyncio.run(scenario())
    for (code, details), method in ((check, "Check"), (watch, "Watch")):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert details.startswith(f"/grpc.health.v1.Health/{method}: malformed request: ")
    assert checked == watched == health_pb2.HealthCheckResponse.NOT_SERVING
