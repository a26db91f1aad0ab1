"""The plugin's own HTTP/2 gRPC client (cilia_cni.h2grpc, via cilia_cni.agent.AgentClient)
against a real grpcio server implementing the agent.v1 services on a tmp unix socket, plus
a scripted HTTP/2 peer (hyperframe + hpack) for what grpcio never sends on its own
(RST_STREAM, GOAWAY, a missing grpc-status, a small flow-control window, PING)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from cni_testlib import assert_cni_error, cni_env, exec_cni, netconf
from hpack import Decoder, Encoder
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
    WindowUpdateFrame,
)

from cilia.agent.v1 import agent_pb2, agent_pb2_grpc
from cilia_cni import h2grpc
from cilia_cni.agent import AgentClient
from cilia_cni.errors import (
    AgentTimeout,
    AgentUnavailable,
    AgentUnreachable,
    CheckMismatch,
    CniError,
    InternalError,
    UnknownContainer,
)
from cilia_common import grpcerrors

#: A status message that needs percent-encoding: non-ASCII, '%', control characters.
AWKWARD = "netns /var/run/netns/pöd-1 gone: 100% sûre ✗ %41 %zz\ttab\nnewline"


class Servicer(agent_pb2_grpc.AttachmentServiceServicer, agent_pb2_grpc.DebugServiceServicer):
    """AttachmentService + DebugService whose answers each test sets.

    Add echoes ``len(prev_result)`` as ``endpoint_id`` and the remaining deadline it saw;
    GC releases exactly the attachments it is given (response size = request size);
    ``abort`` ends every call with that status, ``sleep`` delays it first.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.abort: tuple[grpc.StatusCode, str] | None = None
        self.sleep = 0.0
        self.time_remaining: list[float | None] = []
        self.requests: list[Any] = []

    def _common(self, request: Any, context: grpc.ServicerContext) -> None:
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        if self.sleep:
            time.sleep(self.sleep)
        if self.abort is not None:
            context.abort(*self.abort)

    def Add(self, request: agent_pb2.AddRequest, context: Any) -> agent_pb2.AddResponse:  # noqa: N802
        self._common(request, context)
        return agent_pb2.AddResponse(
            interfaces=[agent_pb2.Interface(name=request.ifname, sandbox=request.netns)],
            ips=[agent_pb2.IPConfig(address="10.239.0.2/32", gateway="10.239.0.1")],
            endpoint_id=len(request.prev_result),
        )

    def Del(self, request: agent_pb2.DelRequest, context: Any) -> agent_pb2.DelResponse:  # noqa: N802
        self._common(request, context)
        return agent_pb2.DelResponse(deleted=True)

    def Check(self, request: agent_pb2.CheckRequest, context: Any) -> agent_pb2.CheckResponse:  # noqa: N802
        self._common(request, context)
        return agent_pb2.CheckResponse()

    def GC(self, request: agent_pb2.GCRequest, context: Any) -> agent_pb2.GCResponse:  # noqa: N802
        self._common(request, context)
        return agent_pb2.GCResponse(released=request.valid_attachments)

    def Status(self, request: agent_pb2.StatusRequest, context: Any) -> agent_pb2.StatusResponse:  # noqa: N802
        self._common(request, context)
        return agent_pb2.StatusResponse(ready=True, message="ready", node_name="n1")


class GrpcServer:
    """A grpcio (sync) server with :class:`Servicer` on ``<tmp>/agent.sock``."""

    def __init__(self, directory: str) -> None:
        self.socket = os.path.join(directory, "agent.sock")
        self.servicer = Servicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        agent_pb2_grpc.add_AttachmentServiceServicer_to_server(self.servicer, self.server)  # type: ignore[no-untyped-call]
        agent_pb2_grpc.add_DebugServiceServicer_to_server(self.servicer, self.server)  # type: ignore[no-untyped-call]
        self.server.add_insecure_port("unix:" + self.socket)
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None).wait(30)


@pytest.fixture(scope="module")
def grpc_server() -> Iterator[GrpcServer]:
    directory = tempfile.mkdtemp(prefix="cilia-cni-h2", dir="/tmp")  # short socket path
    server = GrpcServer(directory)
    yield server
    server.stop()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def server(grpc_server: GrpcServer) -> GrpcServer:
    grpc_server.servicer.reset()
    return grpc_server


def _add_request(**fields: Any) -> agent_pb2.AddRequest:
    base = {"container_id": "h2-1", "ifname": "eth0", "netns": "/var/run/netns/h2"}
    return agent_pb2.AddRequest(**{**base, **fields})


# -- against grpcio --------------------------------------------------------------------


def test_add_round_trips_request_and_response(server: GrpcServer) -> None:
    request = _add_request(labels={"app": "web"}, mtu=1400, prev_result="{}")
    with AgentClient(server.socket) as client:
        response = client.add(request, timeout=10)
        assert client.call_ms > 0
    assert server.servicer.requests == [request]
    assert response.endpoint_id == 2
    assert response.interfaces[0].name == "eth0"
    assert response.ips[0].address == "10.239.0.2/32"
    # grpc-timeout reached the server: it saw a deadline of at most 10 s.
    (remaining,) = server.servicer.time_remaining
    assert remaining is not None and 0 < remaining <= 10


def test_every_method_of_both_services(server: GrpcServer) -> None:
    with AgentClient(server.socket) as client:
        assert client.delete(agent_pb2.DelRequest(container_id="x", ifname="eth0"), 5) is True
        client.check(agent_pb2.CheckRequest(container_id="x", ifname="eth0"), 5)
        gc = agent_pb2.GCRequest(valid_attachments=[agent_pb2.Attachment(container_id="a")])
        assert [a.container_id for a in client.gc(gc, 5).released] == ["a"]
        status = client.status(5)
    assert (status.ready, status.node_name) == (True, "n1")
    kinds = [type(r).__name__ for r in server.servicer.requests]
    assert kinds == ["DelRequest", "CheckRequest", "GCRequest", "StatusRequest"]


@pytest.mark.parametrize("code", [c for c in grpc.StatusCode if c is not grpc.StatusCode.OK])
def test_every_error_status_and_its_percent_encoded_message(
    server: GrpcServer, code: grpc.StatusCode
) -> None:
    server.servicer.abort = (code, AWKWARD)
    method = "/cilia.agent.v1.AttachmentService/Del"
    request = agent_pb2.DelRequest(container_id="x", ifname="eth0").SerializeToString()
    with pytest.raises(h2grpc.RpcError) as caught:
        h2grpc.unary_call(server.socket, method, request, timeout=10)
    assert (caught.value.code, caught.value.name) == (code.value[0], code.name)
    assert caught.value.details == AWKWARD
    assert caught.value.transport is False


@pytest.mark.parametrize(
    ("code", "error", "needle"),
    [
        (grpc.StatusCode.UNAVAILABLE, AgentUnavailable, "cannot complete CHECK now"),
        (grpc.StatusCode.NOT_FOUND, UnknownContainer, "holds no attachment"),
        (grpc.StatusCode.FAILED_PRECONDITION, CheckMismatch, "differs from prevResult"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, InternalError, "failed CHECK"),
        (grpc.StatusCode.DATA_LOSS, InternalError, "failed CHECK"),
    ],
)
def test_agent_statuses_map_to_the_plugins_errors(
    server: GrpcServer, code: grpc.StatusCode, error: type[CniError], needle: str
) -> None:
    server.servicer.abort = (code, AWKWARD)
    with AgentClient(server.socket) as client, pytest.raises(CniError) as caught:
        client.check(agent_pb2.CheckRequest(container_id="x", ifname="eth0"), 5)
    assert type(caught.value) is error
    assert needle in caught.value.msg and AWKWARD in caught.value.msg
    assert code.name in caught.value.details


def test_long_status_message_arrives_in_header_continuations(server: GrpcServer) -> None:
    message = "x" * 20_000 + " ✗ end"  # trailers > 16 KiB: HEADERS + CONTINUATION
    server.servicer.abort = (grpc.StatusCode.INVALID_ARGUMENT, message)
    with pytest.raises(h2grpc.RpcError) as caught:
        h2grpc.unary_call(server.socket, "/cilia.agent.v1.DebugService/Status", b"", timeout=10)
    assert caught.value.details == message


@pytest.mark.parametrize("count", [1000, 4000, 50_000], ids=["19kB", "76kB", "950kB"])
def test_large_request_and_response_cross_frames_and_windows(
    server: GrpcServer, count: int
) -> None:
    """GC echoes its attachments: request and response both exceed one 16 KiB frame, then
    the 64 KiB initial window (the request waits for the server's WINDOW_UPDATEs)."""
    valid = [agent_pb2.Attachment(container_id=f"c{i:08d}", ifname="eth0") for i in range(count)]
    request = agent_pb2.GCRequest(valid_attachments=valid)
    assert request.ByteSize() > {1000: 16 * 1024, 4000: 64 * 1024, 50_000: 900 * 1024}[count]
    with AgentClient(server.socket) as client:
        response = client.gc(request, timeout=30)
    released = [(a.container_id, a.ifname) for a in response.released]
    assert released == [(a.container_id, a.ifname) for a in valid]
    assert server.servicer.requests == [request]


def test_response_over_the_configured_limit_is_refused(server: GrpcServer) -> None:
    valid = [agent_pb2.Attachment(container_id=f"c{i:08d}", ifname="eth0") for i in range(200)]
    request = agent_pb2.GCRequest(valid_attachments=valid)  # the response: 3800 bytes
    with AgentClient(server.socket, max_response_bytes=3000) as client:
        with pytest.raises(InternalError) as caught:
            client.gc(request, timeout=10)
        assert "larger than 3000 bytes" in caught.value.msg
        assert "`agent-max-response-bytes`" in caught.value.msg
        client.max_response_bytes = 3800  # exactly the message: accepted
        assert len(client.gc(request, timeout=10).released) == 200


def test_large_add_request(server: GrpcServer) -> None:
    prev = "p" * 300_000
    with AgentClient(server.socket) as client:
        response = client.add(_add_request(prev_result=prev), timeout=30)
    assert response.endpoint_id == len(prev)


def test_deadline_exceeded_is_the_plugins_timeout_error(server: GrpcServer) -> None:
    server.servicer.sleep = 2.0
    started = time.monotonic()
    with AgentClient(server.socket) as client, pytest.raises(AgentTimeout) as caught:
        client.add(_add_request(), timeout=0.3)
    assert time.monotonic() - started < 2.0  # the client gave up, not the server
    assert caught.value.code == 11
    assert "did not answer ADD within 0.3s" in caught.value.msg
    assert "agent-timeout-seconds" in caught.value.msg
    assert "DEADLINE_EXCEEDED" in caught.value.details
    (remaining,) = server.servicer.time_remaining
    assert remaining is not None and remaining <= 0.3  # grpc-timeout was sent


def test_missing_socket_is_unreachable(absent_socket: str) -> None:
    path = absent_socket
    with AgentClient(path) as client, pytest.raises(AgentUnreachable) as caught:
        client.add(_add_request(), timeout=5)
    assert caught.value.code == 11
    assert "No such file" in caught.value.details


def test_refused_connection_is_unreachable(short_tmp: str) -> None:
    path = os.path.join(short_tmp, "refusing.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)  # bound, never listening: connect() is refused
        with AgentClient(path) as client, pytest.raises(AgentUnreachable) as caught:
            client.delete(agent_pb2.DelRequest(container_id="x", ifname="eth0"), 5)
    assert "Connection refused" in caught.value.details


def test_server_stopping_mid_call_is_unreachable(short_tmp: str) -> None:
    """A real grpcio server stopped without grace while the agent works on the call."""
    own = GrpcServer(short_tmp)
    own.servicer.sleep = 3.0
    threading.Timer(0.5, lambda: own.server.stop(None)).start()
    try:
        with AgentClient(own.socket) as client, pytest.raises(AgentUnavailable) as caught:
            client.delete(agent_pb2.DelRequest(container_id="x", ifname="eth0"), 10)
    finally:
        own.stop()
    assert caught.value.code == 11
    assert not isinstance(caught.value, AgentTimeout)


# -- a scripted HTTP/2 peer --------------------------------------------------------------


class ScriptedPeer:
    """Accepts one connection on ``<tmp>/peer.sock``, reads the client's preface and frames
    until the request's END_STREAM (or ``read_until_end=False``: the HEADERS), then runs
    ``script(conn, send)``; records every frame received."""

    def __init__(
        self,
        directory: str,
        script: Callable[[Callable[..., None]], None],
        settings: dict[int, int] | None = None,
        read_until_end: bool = True,
    ) -> None:
        self.socket = os.path.join(directory, "peer.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.socket)
        self.listener.listen(1)
        self.script = script
        self.settings = settings or {}
        self.read_until_end = read_until_end
        self.frames: list[Frame] = []
        self.headers: list[tuple[bytes, bytes]] = []
        self.encoder = Encoder()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _recv(self, conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def read_frame(self, conn: socket.socket) -> Frame:
        frame, length = Frame.parse_frame_header(memoryview(self._recv(conn, 9)))
        frame.parse_body(memoryview(self._recv(conn, length)))
        self.frames.append(frame)
        return frame

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        try:
            assert self._recv(conn, len(h2grpc.PREFACE)) == h2grpc.PREFACE
            conn.sendall(SettingsFrame(0, settings=self.settings).serialize())
            decoder = Decoder()
            while True:
                frame = self.read_frame(conn)
                if isinstance(frame, HeadersFrame):
                    self.headers = [
                        (bytes(k), bytes(v)) for k, v in decoder.decode(frame.data, raw=True)
                    ]
                    if not self.read_until_end:
                        break
                if "END_STREAM" in frame.flags:
                    break

            def send(*frames: Frame) -> None:
                conn.sendall(b"".join(f.serialize() for f in frames))

            self.conn = conn
            self.script(send)
        except BaseException as exc:  # reported by the test through self.error
            self.error = exc
        finally:
            time.sleep(0.1)
            conn.close()
            self.listener.close()

    def headers_frame(self, fields: list[tuple[str, str]], end_stream: bool) -> HeadersFrame:
        flags = ["END_HEADERS"] + (["END_STREAM"] if end_stream else [])
        return HeadersFrame(1, self.encoder.encode(fields), flags=flags)


OK_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]


def _message(payload: bytes) -> bytes:
    return bytes([0]) + len(payload).to_bytes(4, "big") + payload


def _call(peer: ScriptedPeer, timeout: float = 5) -> bytes:
    try:
        return h2grpc.unary_call(peer.socket, "/cilia.agent.v1.DebugService/Status", b"", timeout)
    finally:
        peer.thread.join(10)
        assert peer.error is None, peer.error


def test_request_headers_follow_the_grpc_spec(short_tmp: str) -> None:
    response = agent_pb2.StatusResponse(ready=True).SerializeToString()

    def script(send: Callable[..., None]) -> None:
        send(
            peer.headers_frame(OK_HEADERS, False),
            DataFrame(1, _message(response)),
            peer.headers_frame([("grpc-status", "0")], True),
        )

    peer = ScriptedPeer(short_tmp, script)
    assert _call(peer, timeout=7) == response
    names = [k for k, _ in peer.headers]
    assert names[:4] == [b":method", b":scheme", b":path", b":authority"]
    fields = dict(peer.headers)
    assert fields[b":method"] == b"POST" and fields[b":scheme"] == b"http"
    assert fields[b":path"] == b"/cilia.agent.v1.DebugService/Status"
    assert fields[b"te"] == b"trailers"
    assert fields[b"content-type"] == b"application/grpc"
    timeout = fields[b"grpc-timeout"]
    assert timeout.endswith(b"u") and 6_000_000 < int(timeout[:-1]) <= 7_000_000
    settings = next(f for f in peer.frames if isinstance(f, SettingsFrame))
    assert settings.settings == {
        SettingsFrame.ENABLE_PUSH: 0,
        SettingsFrame.INITIAL_WINDOW_SIZE: 2**31 - 1,
    }
    (update,) = [f for f in peer.frames if isinstance(f, WindowUpdateFrame)]
    assert (update.stream_id, update.window_increment) == (0, 2**31 - 1 - 65535)
    data = [f for f in peer.frames if isinstance(f, DataFrame)]
    assert [bytes(f.data) for f in data] == [b"\0\0\0\0\0"]
    assert "END_STREAM" in data[-1].flags


def test_request_waits_for_the_peers_flow_control_window(short_tmp: str) -> None:
    """The client sends at most the default 65,535-byte windows in <= 16 KiB frames, then
    stops until WINDOW_UPDATEs arrive (the peer's SETTINGS lower the stream window to 1000
    meanwhile, RFC 9113 §6.9.2); it answers the peer's PING and ACKs its SETTINGS."""
    sent_before_update: list[int] = []

    def script(send: Callable[..., None]) -> None:
        got = 0
        while got < 65535:
            frame = peer.read_frame(peer.conn)
            if isinstance(frame, DataFrame):
                got += len(frame.data)
        send(PingFrame(0, b"12345678"))
        time.sleep(0.3)  # the client has nothing it may send: nothing arrives
        peer.conn.setblocking(False)
        try:
            extra = peer.conn.recv(65536)
        except BlockingIOError:
            extra = b""
        peer.conn.setblocking(True)
        sent_before_update.append(got)
        arrived = _frames(extra)
        peer.frames.extend(arrived)
        assert not any(isinstance(f, DataFrame) for f in arrived), "sent past the window"
        send(WindowUpdateFrame(0, window_increment=200_000))
        send(WindowUpdateFrame(1, window_increment=200_000))
        while True:
            frame = peer.read_frame(peer.conn)
            if "END_STREAM" in frame.flags:
                break
        send(
            peer.headers_frame(OK_HEADERS, False),
            DataFrame(1, _message(b"")),
            peer.headers_frame([("grpc-status", "0")], True),
        )

    peer = ScriptedPeer(
        short_tmp, script, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 1000}, read_until_end=False
    )
    request = b"r" * 150_000
    try:
        assert h2grpc.unary_call(peer.socket, "/s/M", request, 10) == b""
    finally:
        peer.thread.join(10)
    assert peer.error is None, peer.error
    assert sent_before_update == [65535]
    data = [f for f in peer.frames if isinstance(f, DataFrame)]
    assert b"".join(bytes(f.data) for f in data) == _message(request)
    assert max(len(f.data) for f in data) <= 16384
    pings = [f for f in peer.frames if isinstance(f, PingFrame)]
    assert [(p.opaque_data, "ACK" in p.flags) for p in pings] == [(b"12345678", True)]
    assert any(isinstance(f, SettingsFrame) and "ACK" in f.flags for f in peer.frames)


def _frames(data: bytes) -> list[Frame]:
    """The complete frames ``data`` holds (nothing may be left over)."""
    out = []
    while data:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        assert len(data) >= 9 + length, "a partial frame"
        out.append(frame)
        data = data[9 + length :]
    return out


def test_trailers_only_and_continuation(short_tmp: str) -> None:
    def script(send: Callable[..., None]) -> None:
        block = peer.encoder.encode(
            [*OK_HEADERS, ("grpc-status", "5"), ("grpc-message", "pod%20gone%E2%9C%97 %zz")]
        )
        send(
            HeadersFrame(1, block[:3], flags=["END_STREAM"]),
            ContinuationFrame(1, block[3:], flags=["END_HEADERS"]),
        )

    peer = ScriptedPeer(short_tmp, script)
    with pytest.raises(h2grpc.RpcError) as caught:
        _call(peer)
    assert (caught.value.name, caught.value.details) == ("NOT_FOUND", "pod gone✗ %zz")


@pytest.mark.parametrize(
    ("frames", "status", "transport"),
    [
        ("no-grpc-status", "INTERNAL", False),
        ("http-503", "UNAVAILABLE", False),
        ("rst-refused", "UNAVAILABLE", True),
        ("rst-cancel", "CANCELLED", False),
        ("rst-no-error", "INTERNAL", False),
        ("goaway-before-stream", "UNAVAILABLE", True),
        ("close-mid-response", "UNAVAILABLE", True),
        ("two-messages", "INTERNAL", False),
        ("compressed", "INTERNAL", False),
    ],
)
def test_peer_failures_map_to_grpc_statuses(
    short_tmp: str, frames: str, status: str, transport: bool
) -> None:
    def script(send: Callable[..., None]) -> None:
        msg = _message(b"\x08\x01")
        if frames == "no-grpc-status":
            send(peer.headers_frame(OK_HEADERS, False), DataFrame(1, msg, flags=["END_STREAM"]))
        elif frames == "http-503":
            send(peer.headers_frame([(":status", "503")], True))
        elif frames.startswith("rst-"):
            code = {"rst-refused": 7, "rst-cancel": 8, "rst-no-error": 0}[frames]
            send(peer.headers_frame(OK_HEADERS, False), RstStreamFrame(1, error_code=code))
        elif frames == "goaway-before-stream":
            send(GoAwayFrame(0, last_stream_id=0, error_code=0, additional_data=b"draining"))
        elif frames == "close-mid-response":
            send(peer.headers_frame(OK_HEADERS, False), DataFrame(1, msg[:3]))
        elif frames == "two-messages":
            send(
                peer.headers_frame(OK_HEADERS, False),
                DataFrame(1, msg + msg),
                peer.headers_frame([("grpc-status", "0")], True),
            )
        elif frames == "compressed":
            send(
                peer.headers_frame(OK_HEADERS, False),
                DataFrame(1, b"\x01" + msg[1:]),
                peer.headers_frame([("grpc-status", "0")], True),
            )

    peer = ScriptedPeer(short_tmp, script)
    with pytest.raises(h2grpc.RpcError) as caught:
        _call(peer)
    assert (caught.value.name, caught.value.transport) == (status, transport), caught.value


def test_goaway_after_our_stream_lets_the_call_finish(short_tmp: str) -> None:
    def script(send: Callable[..., None]) -> None:
        send(
            GoAwayFrame(0, last_stream_id=2**31 - 1),
            peer.headers_frame(OK_HEADERS, False),
            DataFrame(1, _message(b"ok")),
            peer.headers_frame([("grpc-status", "0")], True),
        )

    peer = ScriptedPeer(short_tmp, script)
    assert _call(peer) == b"ok"


def test_timeout_header_units() -> None:
    assert h2grpc.timeout_header(0.5) == "500000u"
    assert h2grpc.timeout_header(30) == "30000000u"
    assert h2grpc.timeout_header(240) == "240000m"
    assert h2grpc.timeout_header(1e-9) == "1u"


# -- a socket that does not speak HTTP/2 ---------------------------------------------------


class ForeignServer:
    """Answers every connection on ``<tmp>/foreign.sock`` with ``reply`` once it has read
    the client's first bytes, then closes it (an HTTP/1.1 server, or anything else)."""

    def __init__(self, directory: str, reply: bytes) -> None:
        self.socket = os.path.join(directory, "foreign.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.socket)
        self.listener.listen(8)
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(self.reply)

    def close(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()


HTTP1_REPLY = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
FOREIGN_REPLIES = {
    "http1": HTTP1_REPLY,
    "garbage": b"\x00\x00\x04\x00\x00\x00\x00\x00\x01abcd and more garbage\n" * 3,
    "text": b"hello, this is not HTTP/2 at all\n" * 10,
}


@pytest.mark.parametrize("reply", sorted(FOREIGN_REPLIES))
def test_a_socket_that_does_not_speak_http2_is_unreachable_code_11(
    short_tmp: str, reply: str
) -> None:
    """Before: 999 "frame of 4740180 bytes exceeds MAX_FRAME_SIZE" (b"HTTP/1.1 " read as
    a frame header). The server's preface must be a SETTINGS frame (RFC 9113 §3.4)."""
    server = ForeignServer(short_tmp, FOREIGN_REPLIES[reply])
    try:
        with AgentClient(server.socket) as client, pytest.raises(AgentUnreachable) as caught:
            client.add(agent_pb2.AddRequest(container_id="x", ifname="eth0"), 5)
        assert caught.value.code == 11
        assert "does not speak HTTP/2 (gRPC)" in caught.value.msg
        assert "agent-socket" in caught.value.msg
        conf = netconf(server.socket)
        run = exec_cni(cni_env("ADD"), conf)
        assert_cni_error(run, 11, "does not speak HTTP/2 (gRPC)", server.socket)
        # DEL: the agent never got it, so it is queued like for an absent socket.
        run = exec_cni(cni_env("DEL"), conf)
        assert (run.returncode, run.stdout) == (0, ""), run
        assert len(os.listdir(conf["del-queue-dir"])) == 1
    finally:
        server.close()


@contextlib.contextmanager
def _aio_server(methods: dict[str, Callable[..., Any]]) -> Iterator[str]:
    """A grpc.aio server of ``cilia.test.Test`` with unary bytes ``methods``, on a unix
    socket in a short tmp dir, run by a loop in a thread; yields the socket path."""
    tmp = tempfile.mkdtemp(prefix="cilia-h2-", dir="/tmp")
    path = os.path.join(tmp, "s.sock")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> grpc.aio.Server:
        server = grpc.aio.server()
        handlers = {n: grpc.unary_unary_rpc_method_handler(m) for n, m in methods.items()}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("cilia.test.Test", handlers),)
        )
        server.add_insecure_port("unix:" + path)
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield path
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_error_info_in_the_status_details_trailer_is_read_back() -> None:
    """A real grpc.aio server aborts with google.rpc.ErrorInfo (cilia_common.grpcerrors):
    the HTTP/2 client keeps grpc-status-details-bin and the agent client decodes the
    (domain, reason)."""
    from cilia_cni.agent import error_reason

    async def fail(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await grpcerrors.abort(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "pool 'blue' ran dry",
            reason="POOL_EXHAUSTED",
            domain=grpcerrors.AGENT_DOMAIN,
            metadata={"pool": "blue"},
        )

    async def plain(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no details")

    with _aio_server({"Fail": fail, "Plain": plain}) as sock:
        with pytest.raises(h2grpc.RpcError) as err:
            h2grpc.unary_call(sock, "/cilia.test.Test/Fail", b"", 5)
        assert err.value.name == "RESOURCE_EXHAUSTED" and err.value.details == "pool 'blue' ran dry"
        assert err.value.status_details
        assert error_reason(err.value) == ("agent.cilia.io", "POOL_EXHAUSTED")
        with pytest.raises(h2grpc.RpcError) as err:
            h2grpc.unary_call(sock, "/cilia.test.Test/Plain", b"", 5)
        assert err.value.status_details == b"" and error_reason(err.value) is None


def test_malformed_status_details_are_no_reason() -> None:
    assert error_reason_of(b"\xff\xff\xff") is None
    assert h2grpc._binary_header(b"!!notbase64") == b""
    assert h2grpc._binary_header(b"YWJj") == b"abc"  # unpadded base64 is accepted


def error_reason_of(details: bytes) -> tuple[str, str] | None:
    from cilia_cni.agent import error_reason

    return error_reason(h2grpc.RpcError(8, "x", status_details=details))
