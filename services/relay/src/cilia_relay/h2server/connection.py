"""One client connection of the relay's HTTP/2 server: the h2 state machine fed from the
socket, stream admission (SETTINGS_MAX_CONCURRENT_STREAMS, REFUSED_STREAM), write
backpressure and GOAWAY."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import TYPE_CHECKING, Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from .call import Call
from .wire import CLIENT_PREFACE, HTTP1_ANSWER, HTTP1_REQUEST, WRITE_BUFFER_HIGH_BYTES

if TYPE_CHECKING:
    from .server import GrpcH2Server

log = logging.getLogger(__name__)


def peer_name(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        return f"unix:{peer or ''}"
    if isinstance(peer, tuple) and len(peer) >= 2:
        if sock is not None and sock.family == socket.AF_INET6:
            return f"ipv6:[{peer[0]}]:{peer[1]}"
        return f"ipv4:{peer[0]}:{peer[1]}"
    return "unknown"


class _H2Connection(h2.connection.H2Connection):
    """h2's server connection, except for a HEADERS frame that opens one stream more than
    our SETTINGS_MAX_CONCURRENT_STREAMS: RFC 9113 section 5.1.2 makes that a stream error
    (PROTOCOL_ERROR or REFUSED_STREAM), but h2 4.x raises TooManyStreamsError, a connection
    error (GOAWAY), which failed every other call of the connection. Such a frame is taken
    as usual (its header block must still pass the connection's HPACK decoder) and its
    stream id put in :attr:`refused`; the server resets it with REFUSED_STREAM.

    Attributes:
        refused: ids of streams opened past the limit, not answered yet.
    """

    def __init__(self, config: h2.config.H2Configuration) -> None:
        super().__init__(config=config)
        self.refused: set[int] = set()
        self._admitting = False

    @property
    def open_inbound_streams(self) -> int:
        """h2's count of open inbound streams (0 while an over-limit stream is taken)."""
        count = super().open_inbound_streams
        return 0 if self._admitting else count

    def _receive_headers_frame(self, frame: Any) -> Any:
        if (
            frame.stream_id not in self.streams
            and self.open_inbound_streams + 1 > self.local_settings.max_concurrent_streams
        ):
            self.refused.add(frame.stream_id)
            self._admitting = True
            try:
                return super()._receive_headers_frame(frame)
            finally:
                self._admitting = False
        return super()._receive_headers_frame(frame)


class Connection(asyncio.Protocol):
    """One client connection: the h2 state machine and its calls."""

    def __init__(self, server: GrpcH2Server) -> None:
        self.server = server
        config = h2.config.H2Configuration(client_side=False, header_encoding=None)
        self.h2 = _H2Connection(config=config)
        self.calls: dict[int, Call] = {}
        self.raw_headers: dict[int, list[tuple[bytes, bytes]]] = {}
        self.transport: asyncio.Transport | None = None
        self.paused = False
        self.peer = "unknown"
        self.greeted = False  # the client's first bytes were seen (and were not HTTP/1)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH_BYTES)
        self.peer = peer_name(transport)
        self.server.connections.add(self)
        self.h2.update_settings(
            {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.server.max_concurrent_streams}
        )
        self.h2.initiate_connection()  # sent with the first answer: see data_received

    def write(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def acknowledge(self, stream_id: int, length: int) -> None:
        if length and self.transport is not None and not self.transport.is_closing():
            with contextlib.suppress(h2.exceptions.H2Error):
                self.h2.acknowledge_received_data(length, stream_id)
                self.write()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        for call in list(self.calls.values()):
            if call.out:
                call.schedule_flush()

    def data_received(self, data: bytes) -> None:
        if not self.greeted:
            # Our SETTINGS wait for the client's first bytes, so an HTTP/1.x client (curl,
            # a browser, a probe) gets a readable 505 instead of a binary frame and a close.
            self.greeted = True
            if not CLIENT_PREFACE.startswith(data[: len(CLIENT_PREFACE)]) and (
                HTTP1_REQUEST.match(data)
            ):
                log.info("HTTP/1 request on the gRPC port: 505", extra={"peer": self.peer})
                if self.transport is not None:
                    self.transport.write(HTTP1_ANSWER)
                    self.transport.close()
                return
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.info("HTTP/2 protocol error: closing", extra={"peer": self.peer, "error": str(exc)})
            self.write()
            if self.transport is not None:
                self.transport.close()
            return
        for event in events:
            self._event(event)
        self.write()

    def _event(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.RequestReceived):
            self._request(event)
        elif isinstance(event, h2.events.DataReceived):
            call = self.calls.get(event.stream_id)
            if call is None:
                self.acknowledge(event.stream_id, event.flow_controlled_length)
            else:
                call.inbox.put_nowait((event.data, event.flow_controlled_length))
        elif isinstance(event, h2.events.StreamEnded):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.inbox.put_nowait(None)
        elif isinstance(event, h2.events.StreamReset):
            call = self.calls.pop(event.stream_id, None)
            if call is not None:
                call.closed = True
                if call.task is not None:
                    call.task.cancel()
        elif isinstance(event, h2.events.WindowUpdated):
            targets = (
                self.calls.values() if event.stream_id == 0 else [self.calls.get(event.stream_id)]
            )
            for call in list(targets):
                if call is not None and call.out:
                    call.schedule_flush()
        elif isinstance(event, h2.events.RemoteSettingsChanged):
            for call in list(self.calls.values()):
                if call.out:
                    call.schedule_flush()

    def _request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        raw = [(bytes(k), bytes(v)) for k, v in event.headers or ()]
        headers = {k.decode("latin-1"): v for k, v in raw}
        if self.server.stopping or sid in self.h2.refused:
            self.h2.refused.discard(sid)
            self.h2.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        if headers.get(":method") != b"POST":
            self.h2.send_headers(sid, [(b":status", b"405")], end_stream=True)
            return
        if not headers.get("content-type", b"").startswith(b"application/grpc"):
            self.h2.send_headers(sid, [(b":status", b"415")], end_stream=True)
            return
        self.raw_headers[sid] = raw
        call = Call(self, sid, headers)
        self.calls[sid] = call
        call.task = asyncio.get_running_loop().create_task(self._run(call))
        if event.stream_ended is not None:
            call.inbox.put_nowait(None)

    async def _run(self, call: Call) -> None:
        try:
            await call.run()
        finally:
            self.raw_headers.pop(call.id, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            call.closed = True
            call.wake()
            if call.task is not None:
                call.task.cancel()
        self.calls.clear()

    def close(self) -> None:
        """GOAWAY and close (calls still running are cancelled by ``connection_lost``)."""
        with contextlib.suppress(h2.exceptions.H2Error):
            self.h2.close_connection()
            self.write()
        if self.transport is not None:
            self.transport.close()
