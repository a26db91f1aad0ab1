"""Peer manager: learns agents through ``peer.Peer/Notify`` and keeps one channel per peer.

* A background task holds the ``Notify`` stream to ``--peer-service``; every
  ``PEER_ADDED``/``PEER_UPDATED`` creates (or, when the address changed, replaces)
  the peer's ``grpc.aio`` channel, ``PEER_DELETED`` closes and forgets it. When the
  stream fails it is re-opened after ``--retry-timeout``; known peers are kept.
* A dial waits up to ``--dial-timeout`` for the channel to become READY; a failed
  dial leaves the peer without a channel (unavailable).
* A check loop re-dials peers without a channel or whose channel is in
  TRANSIENT_FAILURE/SHUTDOWN, at most once per ``--retry-timeout``.

Source: upstream relay pool manager (``pkg/hubble/relay/pool``; cilium-upstream.md §6).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from cilia.hubble.observer import observer_pb2, observer_pb2_grpc
from cilia.hubble.peer import peer_pb2, peer_pb2_grpc
from cilia_common.backoff import Backoff
from cilia_common.retry import run_periodic, run_watch
from cilia_common.tls import ClientTLS, TLSFileError, channel_credentials, channel_options
from cilia_relay.config import dial_target

log = logging.getLogger("cilia_relay.peers")

UNAVAILABLE_STATES = frozenset(
    {grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN}
)


class _TLSNotConfigured(Exception):
    """A peer announces TLS and the relay was given no CA to check it."""


@dataclass
class Peer:
    """One agent known through the Peer service.

    Attributes:
        name: node name (``cluster/node`` outside the default cluster).
        address: the peer's Hubble address as announced (``host:port`` or ``unix:/path``).
        tls_server_name: TLS server name announced, ``""`` when the peer has no TLS.
        channel: the gRPC channel, None while not (or no longer) dialled.
        last_dial: monotonic time (s) of the last dial attempt.
        error: why the last dial failed in a way that waiting will not mend (a refused
            certificate, TLS asked for but not configured), "" otherwise: such a peer is
            reported NODE_ERROR with this text, not NODE_UNAVAILABLE.
    """

    name: str
    address: str
    tls_server_name: str = ""
    channel: grpc.aio.Channel | None = None
    last_dial: float = 0.0
    error: str = ""
    dial_task: asyncio.Task[None] | None = field(default=None, repr=False)

    def state(self) -> grpc.ChannelConnectivity | None:
        """Connectivity of the channel without triggering a connect; None without one."""
        if self.channel is None:
            return None
        state: grpc.ChannelConnectivity = self.channel.get_state(try_to_connect=False)
        return state

    @property
    def available(self) -> bool:
        """True when a channel exists and is not in TRANSIENT_FAILURE or SHUTDOWN."""
        state = self.state()
        return state is not None and state not in UNAVAILABLE_STATES


def _consume_result(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


class PeerManager:
    """Tracks peers announced by the Peer service and their channels.

    Args:
        peer_service: address of ``peer.Peer`` (``host:port``, ``:port`` or ``unix:/path``).
        dial_timeout: seconds a dial waits for READY.
        retry_timeout: seconds before a failed dial or a lost Notify stream is retried.
        on_peer_service: awaited with True once the Notify stream is established and
            with False when it is lost (drives health).
        client_tls: how a peer that announces a TLS name is dialled (CA files and the
            relay's client pair; the name announced is checked); None: such a peer is an
            error (``--tls-hubble-server-ca-files`` not given) unless ``plaintext_only``.
        plaintext_only: dial every peer in plaintext (``--disable-client-tls``).
    """

    def __init__(
        self,
        peer_service: str,
        dial_timeout: float,
        retry_timeout: float,
        on_peer_service: Callable[[bool], Awaitable[None]] | None = None,
        *,
        client_tls: ClientTLS | None = None,
        plaintext_only: bool = False,
    ) -> None:
        self.client_tls = client_tls
        self.plaintext_only = plaintext_only
        self.peer_service = peer_service
        self.dial_timeout = dial_timeout
        self.retry_timeout = retry_timeout
        self._on_peer_service = on_peer_service
        self._peers: dict[str, Peer] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self.peer_service_connected = False

    # -- public API ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start the Notify watcher and the connection check loop."""
        self._tasks = [
            asyncio.create_task(self._watch_notifications(), name="relay-peer-notify"),
            asyncio.create_task(self._check_connections(), name="relay-peer-check"),
        ]

    async def stop(self) -> None:
        """Stop the background tasks and close every peer channel."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for peer in list(self._peers.values()):
            await self._forget(peer)
        self._peers.clear()

    def list(self) -> list[Peer]:
        """Known peers sorted by name (the objects themselves; do not mutate)."""
        return [self._peers[name] for name in sorted(self._peers)]

    async def wait_changed(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a peer to be added, removed or (re)connected.

        Returns True when something changed, False on timeout.
        """
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def wait_for_peers(self, names: set[str], timeout: float) -> bool:
        """Wait until every peer in ``names`` is known and available (tests, start-up)."""
        deadline = time.monotonic() + timeout
        while True:
            ready = {p.name for p in self._peers.values() if p.available}
            if names <= ready:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await self.wait_changed(min(remaining, 0.05))

    # -- notifications ------------------------------------------------------------------

    def _notify_changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _set_peer_service(self, connected: bool) -> None:
        if connected == self.peer_service_connected:
            return
        self.peer_service_connected = connected
        if self._on_peer_service is not None:
            await self._on_peer_service(connected)

    async def _watch_notifications(self) -> None:
        """Hold the Notify stream to ``--peer-service`` (:func:`cilia_common.retry.run_watch`):
        re-opened ``--retry-timeout`` after each loss; known peers are kept meanwhile."""

        async def lost(reason: str, retry_in_s: float) -> None:
            await self._set_peer_service(False)

        await run_watch(
            "peer-service",
            self._notifications,
            self._consume_notifications,
            Backoff.fixed(self.retry_timeout),
            logger=log,
            quiet=(grpc.aio.AioRpcError, TimeoutError),
            describe=self._describe_loss,
            on_lost=lost,
        )

    async def _notifications(self) -> AsyncIterator[peer_pb2.ChangeNotification]:
        """One attempt: dial (``--dial-timeout``), open Notify, wait until it is up, yield its
        changes; the channel is closed when the attempt ends."""
        channel = grpc.aio.insecure_channel(dial_target(self.peer_service))
        try:
            await asyncio.wait_for(channel.channel_ready(), self.dial_timeout)
            stub = peer_pb2_grpc.PeerStub(channel)  # type: ignore[no-untyped-call]
            call = stub.Notify(peer_pb2.NotifyRequest())
            await self._wait_established(call)
            log.info("peer service connected", extra={"peer_service": self.peer_service})
            await self._set_peer_service(True)
            async for change in call:
                yield change
        finally:
            await channel.close()

    async def _consume_notifications(
        self, changes: AsyncIterable[peer_pb2.ChangeNotification]
    ) -> bool:
        """Apply every change; True once the stream was up (the backoff then starts over)."""
        async for change in changes:
            await self._apply(change)
        return self.peer_service_connected

    def _describe_loss(self, exc: BaseException) -> str:
        if isinstance(exc, grpc.aio.AioRpcError):
            return f"{self.peer_service}: {exc.code().name}: {exc.details()}"
        if isinstance(exc, TimeoutError):
            return f"{self.peer_service}: connect timed out after {self.dial_timeout:g}s"
        return f"{self.peer_service}: {exc}"

    async def _wait_established(self, call: grpc.aio.UnaryStreamCall) -> None:
        """Return once the Notify stream is up: its headers arrived, or it is still open
        after ``dial_timeout`` on a READY channel (a peer service with nothing to announce
        may send no headers yet). Raises the call's error if it failed first."""
        # Cancelling wait_for_connection() would cancel the RPC: let it finish on its own.
        headers = asyncio.ensure_future(call.wait_for_connection())
        headers.add_done_callback(_consume_result)
        await asyncio.wait({headers}, timeout=self.dial_timeout)
        if headers.done():
            headers.result()
        elif call.done():
            await call.wait_for_connection()

    async def _apply(self, change: peer_pb2.ChangeNotification) -> None:
        name = change.name
        tls_name = change.tls.server_name if change.HasField("tls") else ""
        if change.type == peer_pb2.PEER_DELETED:
            peer = self._peers.pop(name, None)
            if peer is not None:
                log.info("peer deleted", extra={"peer": name})
                await self._forget(peer)
                self._notify_changed()
            return
        if change.type not in (peer_pb2.PEER_ADDED, peer_pb2.PEER_UPDATED):
            log.warning("ignoring peer change of unknown type", extra={"peer": name})
            return
        if not name or not change.address:
            log.warning("ignoring peer change without name or address", extra={"peer": name})
            return
        peer = self._peers.get(name)
        if peer is not None and peer.address == change.address and peer.tls_server_name == tls_name:
            return
        if peer is not None:
            await self._forget(peer)
        peer = Peer(name=name, address=change.address, tls_server_name=tls_name)
        self._peers[name] = peer
        log.info("peer added", extra={"peer": name, "address": change.address})
        self._start_dial(peer)
        self._notify_changed()

    # -- connections --------------------------------------------------------------------

    async def _forget(self, peer: Peer) -> None:
        if peer.dial_task is not None:
            peer.dial_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await peer.dial_task
            peer.dial_task = None
        if peer.channel is not None:
            channel, peer.channel = peer.channel, None
            await channel.close()

    def _start_dial(self, peer: Peer) -> None:
        peer.last_dial = time.monotonic()
        peer.dial_task = asyncio.create_task(self._dial(peer), name=f"relay-dial-{peer.name}")

    async def _dial(self, peer: Peer) -> None:
        old, peer.channel = peer.channel, None
        if old is not None:
            await old.close()
        try:
            channel = self._channel(peer)
        except (TLSFileError, _TLSNotConfigured) as exc:
            peer.error = str(exc)
            peer.dial_task = None
            log.warning("cannot dial peer", extra={"peer": peer.name, "error": peer.error})
            self._notify_changed()
            return
        try:
            await asyncio.wait_for(channel.channel_ready(), self.dial_timeout)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            peer.error = await self._why(channel) if peer.tls_server_name else ""
            log.warning(
                "cannot connect to peer",
                extra={
                    "peer": peer.name,
                    "address": peer.address,
                    "error": peer.error or type(exc).__name__,
                    "retry_in_seconds": self.retry_timeout,
                },
            )
            await channel.close()
            self._notify_changed()
            return
        finally:
            peer.dial_task = None
        if self._peers.get(peer.name) is not peer:
            await channel.close()
            return
        peer.channel = channel
        peer.error = ""
        log.info(
            "peer connected",
            extra={"peer": peer.name, "address": peer.address, "tls": peer.tls_server_name},
        )
        self._notify_changed()

    def _channel(self, peer: Peer) -> grpc.aio.Channel:
        """A channel to ``peer``: TLS checking its announced name when it announces one.

        Raises:
            TLSFileError: a TLS file is unusable.
            _TLSNotConfigured: the peer announces TLS and the relay has no CA for it.
        """
        target = dial_target(peer.address)
        if not peer.tls_server_name or self.plaintext_only:
            return grpc.aio.insecure_channel(target)
        if self.client_tls is None:
            raise _TLSNotConfigured(
                f"peer {peer.name} serves TLS ({peer.tls_server_name}) and the relay has no CA "
                "to check it: give --tls-hubble-server-ca-files (and --tls-client-cert-file/"
                "--tls-client-key-file), or --disable-client-tls"
            )
        tls = dataclasses.replace(self.client_tls, server_name=peer.tls_server_name)
        return grpc.aio.secure_channel(
            target, channel_credentials(tls), options=channel_options(tls)
        )

    async def _why(self, channel: grpc.aio.Channel) -> str:
        """The reason a TLS channel did not get ready, from one short call's status (gRPC's
        text names the handshake failure, e.g. CERTIFICATE_VERIFY_FAILED)."""
        stub = observer_pb2_grpc.ObserverStub(channel)  # type: ignore[no-untyped-call]
        try:
            await stub.ServerStatus(
                observer_pb2.ServerStatusRequest(), timeout=min(self.dial_timeout, 1.0)
            )
        except grpc.aio.AioRpcError as exc:
            details = exc.details() or ""
            if "ssl" in details.lower() or "handshake" in details.lower():
                return f"TLS handshake failed: {details}"
        return ""

    async def _check_connections(self) -> None:
        """Every ``min(--retry-timeout, 1 s)``: :meth:`_check_once`
        (:func:`cilia_common.retry.run_periodic`: a failing check is logged, the next runs)."""
        await run_periodic(
            "relay-peer-check", min(self.retry_timeout, 1.0), self._check_once, logger=log
        )

    async def _check_once(self) -> None:
        """Probe IDLE channels and re-dial peers that are unavailable, at most once per
        ``--retry-timeout`` each."""
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.dial_task is not None:
                continue
            state = peer.state()
            if state == grpc.ChannelConnectivity.IDLE and peer.channel is not None:
                # A dropped connection leaves the channel IDLE; probing it keeps the
                # state honest so GetFlows skips dead agents.
                peer.channel.get_state(try_to_connect=True)
                continue
            if state is not None and state not in UNAVAILABLE_STATES:
                continue
            if now - peer.last_dial >= self.retry_timeout:
                log.info("re-dialling peer", extra={"peer": peer.name})
                self._start_dial(peer)
