"""cilia_relay.h2server against grpcio clients (and a raw h2 client for flow control): the fast
path's messages, status, metadata, deadline and cancellation; forwarding of every other method
to a grpcio server; TLS with ALPN h2. The upstream Go client is exercised through the relay
(tests/e2e/test_hubble_cli.py) and by bench/flows.py."""

from __future__ import annotations

import asyncio
import pathlib
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cilia_common import grpcserver
from cilia_common.tls import ServerTLS, generate_bundle
from cilia_relay import h2server

STREAM = "/test.Fast/Stream"
ECHO = "/test.Slow/Echo"


class Recorder:
    """What the fast handler saw and whether its ``finally`` ran."""

    def __init__(self) -> None:
        self.metadata: tuple[tuple[str, str | bytes], ...] = ()
        self.produced = 0
        self.closed = asyncio.Event()


def fast_handler(rec: Recorder) -> h2server.StreamHandler:
    """``b"N"`` -> N messages ``msg-<i>``; ``b"abort"``; ``b"boom"``; ``b"hang"`` (sleeps);
    ``b"flood"`` (yields 1 KiB messages forever)."""

    async def handler(request: bytes, context: h2server.H2Context) -> AsyncIterator[bytes]:
        rec.metadata = context.invocation_metadata()
        try:
            if request == b"abort":
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, "nein: ü 100%")
            if request == b"boom":
                raise ValueError("broken handler")
            if request == b"hang":
                await asyncio.sleep(3600)
            if request == b"flood":
                while True:
                    rec.produced += 1
                    yield b"x" * 1024
            for i in range(int(request)):
                rec.produced += 1
                yield f"msg-{i}".encode()
        finally:
            rec.closed.set()

    return handler


def _parse(data: bytes) -> bytes:
    if data == b"\xff":
        raise ValueError("not a request")
    return data


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    md = dict(context.invocation_metadata() or ())
    if request == b"fail":
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "backend says no")
    await context.send_initial_metadata((("x-initial", "i"),))
    context.set_trailing_metadata((("x-trailing", "t"), ("x-blob-bin", b"\x00\x01")))
    return request + b"|" + str(md.get("x-user", "")).encode()


def _add_echo(servicer: Any, server: grpc.aio.Server) -> None:
    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
    )
    server.add_generic_rpc_handlers((handler,))


async def _with_server(
    tmp: pathlib.Path,
    body: Callable[[str, Recorder], Awaitable[Any]],
    *,
    ssl_context: Any = None,
    send_buffer: int = h2server.DEFAULT_SEND_BUFFER_BYTES,
    max_streams: int = h2server.DEFAULT_MAX_CONCURRENT_STREAMS,
) -> Any:
    backend = f"unix:{tmp}/backend.sock"
    server, health, _ = await grpcserver.start_server_with_ports(
        [grpcserver.Service(_add_echo, None, "test.Slow")], [backend]
    )
    await grpcserver.set_serving(health, ["test.Slow"])
    rec = Recorder()
    front = h2server.GrpcH2Server(
        forward_to=backend,
        ssl_context=ssl_context,
        send_buffer_bytes=send_buffer,
        max_concurrent_streams=max_streams,
    )
    front.add_unary_stream(STREAM, fast_handler(rec), _parse, bytes)
    address = await front.start("127.0.0.1:0")
    try:
        return await body(address, rec)
    finally:
        await front.stop(0)
        await server.stop(0)


def _stream(channel: grpc.aio.Channel) -> Any:
    return channel.unary_stream(STREAM)


def test_fast_path_streams_every_message_in_order_then_ok_with_metadata(
    tmp_path: pathlib.Path,
) -> None:
    async def body(address: str, rec: Recorder) -> tuple[list[bytes], Any, Any]:
        async with grpc.aio.insecure_channel(address) as ch:
            call = _stream(ch)(b"5000", metadata=(("x-user", "ana"), ("x-key-bin", b"\x00\xff")))
            got = [m async for m in call]
            return got, await call.code(), rec.metadata

    got, code, metadata = asyncio.run(_with_server(tmp_path, body))
    assert got == [f"msg-{i}".encode() for i in range(5000)]
    assert code == grpc.StatusCode.OK
    assert ("x-user", "ana") in metadata
    assert ("x-key-bin", b"\x00\xff") in metadata


@pytest.mark.parametrize(
    ("request_bytes", "code", "details"),
    [
        (b"abort", grpc.StatusCode.PERMISSION_DENIED, "nein: ü 100%"),
        (b"boom", grpc.StatusCode.UNKNOWN, "Unexpected ValueError: broken handler"),
        (b"\xff", grpc.StatusCode.INVALID_ARGUMENT, f"{STREAM}: malformed request: not a request"),
    ],
)
def test_fast_path_errors_reach_the_client_as_status_and_message(
    tmp_path: pathlib.Path, request_bytes: bytes, code: grpc.StatusCode, details: str
) -> None:
    async def body(address: str, rec: Recorder) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in _stream(ch)(request_bytes):
                    pass
            return err.value

    error = asyncio.run(_with_server(tmp_path, body))
    assert (error.code(), error.details()) == (code, details)


def test_deadline_and_client_cancel_end_the_handler(tmp_path: pathlib.Path) -> None:
    async def body(address: str, rec: Recorder) -> tuple[grpc.StatusCode, bool, bool]:
        async with grpc.aio.insecure_channel(address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in _stream(ch)(b"hang", timeout=0.3):
                    pass
            await asyncio.wait_for(rec.closed.wait(), 5)
            after_deadline = rec.closed.is_set()
            rec.closed.clear()
            call = _stream(ch)(b"hang")
            await asyncio.sleep(0.2)
            call.cancel()
            await asyncio.wait_for(rec.closed.wait(), 5)
            return err.value.code(), after_deadline, rec.closed.is_set()

    code, after_deadline, after_cancel = asyncio.run(_with_server(tmp_path, body))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert after_deadline and after_cancel


def test_other_methods_are_forwarded_with_metadata_status_and_health(
    tmp_path: pathlib.Path,
) -> None:
    async def body(address: str, rec: Recorder) -> dict[str, Any]:
        async with grpc.aio.insecure_channel(address) as ch:
            echo = ch.unary_unary(ECHO)
            call = echo(b"hi", metadata=(("x-user", "bo"),), timeout=5)
            answer = await call
            initial = dict(await call.initial_metadata())
            trailing = dict(await call.trailing_metadata())
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await echo(b"fail", timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await ch.unary_unary("/test.Slow/Nope")(b"", timeout=5)
            health = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="test.Slow"), timeout=5
            )
        return {
            "answer": answer,
            "initial": initial,
            "trailing": trailing,
            "failed": (failed.value.code(), failed.value.details()),
            "unknown": unknown.value.code(),
            "health": health.status,
        }

    out = asyncio.run(_with_server(tmp_path, body))
    assert out["answer"] == b"hi|bo"
    assert out["initial"]["x-initial"] == "i"
    assert out["trailing"]["x-trailing"] == "t"
    assert out["trailing"]["x-blob-bin"] == b"\x00\x01"
    assert out["failed"] == (grpc.StatusCode.FAILED_PRECONDITION, "backend says no")
    assert out["unknown"] == grpc.StatusCode.UNIMPLEMENTED
    assert out["health"] == health_pb2.HealthCheckResponse.SERVING


def test_a_client_that_does_not_read_stops_the_handler_at_the_buffer_bound(
    tmp_path: pathlib.Path,
) -> None:
    """A raw h2 client that never sends WINDOW_UPDATE: the server may send one 64 KiB stream
    window, then the handler waits once ``send_buffer_bytes`` are held; it is not cancelled
    and produced no more than window + buffer + one message."""
    send_buffer = 32 * 1024

    async def body(address: str, rec: Recorder) -> tuple[int, bool]:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [(":method", "POST"), (":scheme", "http"), (":authority", address),
             (":path", STREAM), ("content-type", "application/grpc"), ("te", "trailers")],
        )  # fmt: skip
        conn.send_data(sid, b"\x00" + (5).to_bytes(4, "big") + b"flood", end_stream=True)
        writer.write(conn.data_to_send())
        received = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        while loop.time() < deadline:
            try:
                data = await asyncio.wait_for(reader.read(65536), deadline - loop.time())
            except TimeoutError:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    received += len(event.data)  # never acknowledged: no WINDOW_UPDATE
        produced = rec.produced
        writer.close()
        await asyncio.wait_for(rec.closed.wait(), 5)  # the lost connection cancels it
        return produced, received <= 65535

    produced, within_window = asyncio.run(_with_server(tmp_path, body, send_buffer=send_buffer))
    assert within_window
    message = 1024 + 5
    assert 0 < produced * message <= 65535 + send_buffer + message


def test_tls_with_alpn_h2_and_client_certificates(tmp_path: pathlib.Path) -> None:
    bundle = generate_bundle(tmp_path / "tls", server_hosts=["127.0.0.1"], admins=["client"])
    tls = ServerTLS(bundle.server_cert, bundle.server_key, (bundle.ca_cert,))
    context = h2server.server_ssl_context(tls)
    ca = pathlib.Path(bundle.ca_cert).read_bytes()
    cert, key = (pathlib.Path(p).read_bytes() for p in bundle.clients["client"])

    async def body(address: str, rec: Recorder) -> tuple[list[bytes], grpc.StatusCode]:
        creds = grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert)
        async with grpc.aio.secure_channel(address, creds) as ch:
            got = [m async for m in _stream(ch)(b"3", timeout=5)]
        anonymous = grpc.ssl_channel_credentials(ca)
        async with grpc.aio.secure_channel(address, anonymous) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in _stream(ch)(b"3", timeout=5):
                    pass
        return got, refused.value.code()

    got, refused = asyncio.run(_with_server(tmp_path, body, ssl_context=context.context))
    assert got == [b"msg-0", b"msg-1", b"msg-2"]
    assert refused == grpc.StatusCode.UNAVAILABLE


def test_bound_address_and_unusable_address(tmp_path: pathlib.Path) -> None:
    async def scenario() -> tuple[str, str]:
        front = h2server.GrpcH2Server()
        bound = await front.start("[::]:0")
        sock = tmp_path / "front.sock"
        unix = await front.start(f"unix:{sock}")
        try:
            with socket.create_connection(("127.0.0.1", int(bound.rsplit(":", 1)[1])), 2):
                pass
            with pytest.raises(OSError):
                await h2server.GrpcH2Server().start(f"127.0.0.1:{bound.rsplit(':', 1)[1]}")
            return bound, unix
        finally:
            await front.stop(0)

    bound, unix = asyncio.run(scenario())
    assert bound.startswith("[::]:") and not bound.endswith(":0")
    assert unix == f"unix:{tmp_path}/front.sock"


def test_grpc_timeout_and_message_encoding() -> None:
    assert h2server.parse_timeout("250m") == pytest.approx(0.25)
    assert h2server.parse_timeout("2S") == 2.0
    assert h2server.parse_timeout("123456789S") is None  # at most 8 digits
    assert h2server.parse_timeout("5x") is None
    assert h2server.encode_grpc_message("a 100% ü") == b"a 100%25 %C3%BC"


def test_tls_negotiates_h2_and_serves_renewed_files_at_the_next_handshake(
    tmp_path: pathlib.Path,
) -> None:
    tls_dir = tmp_path / "tls"
    bundle = generate_bundle(tls_dir, server_hosts=["127.0.0.1"])
    tls = ServerTLS(bundle.server_cert, bundle.server_key, ())
    reloading = h2server.server_ssl_context(tls)

    async def handshake(address: str) -> tuple[str | None, int]:
        host, port = address.rsplit(":", 1)
        client = ssl.create_default_context(cafile=bundle.ca_cert)
        client.set_alpn_protocols(["h2"])
        _, writer = await asyncio.open_connection(host, int(port), ssl=client)
        sslobj = writer.get_extra_info("ssl_object")
        der = sslobj.getpeercert(binary_form=True)
        writer.close()
        return sslobj.selected_alpn_protocol(), x509.load_der_x509_certificate(der).serial_number

    async def body(address: str, rec: Recorder) -> tuple[Any, Any]:
        first = await handshake(address)
        generate_bundle(tls_dir, server_hosts=["127.0.0.1"])  # same CA, new server pair
        second = await handshake(address)
        return first, second

    first, second = asyncio.run(_with_server(tmp_path, body, ssl_context=reloading.context))
    assert first[0] == second[0] == "h2"
    assert first[1] != second[1]
    assert reloading.reloads == 1


def test_forwarded_calls_with_a_far_deadline_or_a_truncated_request(
    tmp_path: pathlib.Path,
) -> None:
    """A raw h2 client calls the forwarded ECHO: ``grpc-timeout: 9999999H`` (valid, ~1,141
    years; past grpcio's int64-nanosecond deadline) is served, not DEADLINE_EXCEEDED at once;
    a request that ends inside a message answers INTERNAL with the reason (as the fast path
    does), not a bare RST_STREAM(CANCEL)."""

    async def call(address: str, headers: list[tuple[str, str]], body: bytes) -> dict[str, str]:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [(":method", "POST"), (":scheme", "http"), (":authority", address),
             (":path", ECHO), ("content-type", "application/grpc"), ("te", "trailers"),
             *headers],
        )  # fmt: skip
        conn.send_data(sid, body, end_stream=True)
        writer.write(conn.data_to_send())
        seen: dict[str, str] = {}
        try:
            while "grpc-status" not in seen and "reset" not in seen:
                data = await asyncio.wait_for(reader.read(65536), 5)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        seen.update(dict(event.headers))  # type: ignore[arg-type]
                    elif isinstance(event, h2.events.StreamReset):
                        seen["reset"] = str(int(event.error_code))
                writer.write(conn.data_to_send())
        finally:
            writer.close()
        return seen

    async def body(address: str, rec: Recorder) -> tuple[dict[str, str], dict[str, str]]:
        framed = b"\x00" + (2).to_bytes(4, "big") + b"hi"
        far = await call(address, [("grpc-timeout", "9999999H")], framed)
        truncated = await call(address, [], b"\x00\x00\x00")
        return far, truncated

    far, truncated = asyncio.run(_with_server(tmp_path, body))
    assert far.get("grpc-status") == "0", far
    assert truncated.get("grpc-status") == str(grpc.StatusCode.INTERNAL.value[0]), truncated
    assert truncated.get("grpc-message") == "request ended inside a message"


def test_an_http1_client_gets_a_readable_505_and_grpc_clients_still_work(
    tmp_path: pathlib.Path,
) -> None:
    """``curl http://relay:4245/`` (HTTP/1.1) got the server's binary SETTINGS frame and a
    close ("Received HTTP/0.9 when not allowed"); now an HTTP/1.1 505 naming gRPC."""

    async def body(address: str, rec: Recorder) -> tuple[bytes, list[bytes]]:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)  # until the server closes
        writer.close()
        async with grpc.aio.insecure_channel(address) as ch:
            got = [m async for m in _stream(ch)(b"2", timeout=5)]
        return answer, got

    answer, got = asyncio.run(_with_server(tmp_path, body))
    assert answer.startswith(b"HTTP/1.1 505 "), answer[:60]
    assert b"gRPC" in answer
    assert got == [b"msg-0", b"msg-1"]


def test_a_stream_past_the_concurrency_limit_is_refused_alone(tmp_path: pathlib.Path) -> None:
    """A raw h2 client opens 101 streams at once (before it could read the server's
    SETTINGS; h2's limit before the ACK is 100): stream 101 gets RST_STREAM(REFUSED_STREAM)
    and the other 100 calls end OK; the connection stays (it was a GOAWAY that failed all)."""

    async def body(address: str, rec: Recorder) -> tuple[dict[int, str], bool]:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        conn.initiate_connection()
        ids = []
        for _ in range(101):
            sid = conn.get_next_available_stream_id()
            conn.send_headers(
                sid,
                [(":method", "POST"), (":scheme", "http"), (":authority", address),
                 (":path", STREAM), ("content-type", "application/grpc"), ("te", "trailers")],
            )  # fmt: skip
            conn.send_data(sid, b"\x00" + (1).to_bytes(4, "big") + b"1", end_stream=True)
            ids.append(sid)
        writer.write(conn.data_to_send())
        outcome: dict[int, str] = {}
        terminated = False
        try:
            while len(outcome) < len(ids) and not terminated:
                data = await asyncio.wait_for(reader.read(65536), 5)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.TrailersReceived):
                        trailers = {str(k): str(v) for k, v in event.headers or ()}
                        outcome[event.stream_id] = trailers["grpc-status"]
                    elif isinstance(event, h2.events.StreamReset):
                        outcome[event.stream_id] = f"reset {int(event.error_code)}"
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        terminated = True
                writer.write(conn.data_to_send())
        finally:
            writer.close()
        return outcome, terminated

    outcome, terminated = asyncio.run(_with_server(tmp_path, body, max_streams=100))
    assert not terminated
    assert outcome.pop(201) == "reset 7"  # REFUSED_STREAM
    assert sorted(outcome.values()) == ["0"] * 100


def test_a_malformed_grpc_timeout_ends_the_call_internal(tmp_path: pathlib.Path) -> None:
    """``grpc-timeout: abc`` (or 9 digits) was ignored and the call ran without a deadline;
    grpc-go's server answers INTERNAL "malformed grpc-timeout", and so does this one, on the
    fast path and when forwarding."""

    async def call(address: str, path: str, value: str) -> dict[str, str]:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(
            sid,
            [(":method", "POST"), (":scheme", "http"), (":authority", address),
             (":path", path), ("content-type", "application/grpc"), ("te", "trailers"),
             ("grpc-timeout", value)],
        )  # fmt: skip
        conn.send_data(sid, b"\x00" + (1).to_bytes(4, "big") + b"1", end_stream=True)
        writer.write(conn.data_to_send())
        seen: dict[str, str] = {}
        try:
            while "grpc-status" not in seen:
                data = await asyncio.wait_for(reader.read(65536), 5)
                if not data:
                    break
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                        seen.update({str(k): str(v) for k, v in event.headers or ()})
                writer.write(conn.data_to_send())
        finally:
            writer.close()
        return seen

    async def body(address: str, rec: Recorder) -> list[dict[str, str]]:
        return [
            await call(address, STREAM, "abc"),
            await call(address, ECHO, "123456789S"),
            await call(address, STREAM, "5S"),
        ]

    fast, forwarded, good = asyncio.run(_with_server(tmp_path, body))
    internal = str(grpc.StatusCode.INTERNAL.value[0])
    assert fast["grpc-status"] == internal and "malformed grpc-timeout" in fast["grpc-message"]
    assert forwarded["grpc-status"] == internal, forwarded
    assert good["grpc-status"] == "0", good
