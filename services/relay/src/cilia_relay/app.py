"""Wires the relay: peer manager → Observer servicer → gRPC servers (+ optional metrics).

Start order: the Observer server on ``--listen-address`` and the health server on
``--health-listen-address`` (both report NOT_SERVING), metrics, then the peer manager.

The Observer listener is :class:`cilia_common.h2server.GrpcH2Server`: ``GetFlows`` is served
there directly (many flows per HTTP/2 DATA frame: a few µs of CPU per flow instead of
grpcio's 70-110 µs per message), every other method (ServerStatus, GetNodes, GetNamespaces,
GetAgentEvents, GetDebugEvents, health, reflection) is forwarded to a grpcio server on a
root-only unix socket in a private directory that only the relay uses. TLS
(``--tls-relay-server-*``) is the h2 listener's (ALPN ``h2``).
Health turns SERVING once the ``peer.Peer/Notify`` stream is established and back to
NOT_SERVING while it is lost. Both listeners serve ``grpc.health.v1`` for the overall
status (""), ``observer.Observer`` and ``hubble.server.Observer`` (the name upstream's relay
reports and ``hubble status`` checks). Once bound, each listener is logged once as ``"listening"``
with its name (``observer``, ``health``, ``metrics``) and bound address
(:func:`cilia_common.runtime.announce_listening`). Stop order is the reverse.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from cilia.hubble.observer import observer_pb2
from cilia_common import grpcserver
from cilia_common.metrics import MetricsServer, start_metrics_server
from cilia_common.runtime import announce_listening, run_until_signal
from cilia_relay import __version__
from cilia_relay.config import Config, grpc_address
from cilia_relay.observer import (
    ObserverOptions,
    RelayObserver,
    add_relay_observer_to_server,
    serialize_response,
)
from cilia_relay.peers import PeerManager

from . import h2server

log = logging.getLogger("cilia_relay")

OBSERVER_SERVICE = observer_pb2.DESCRIPTOR.services_by_name["Observer"].full_name
#: The ``grpc.health.v1`` service name upstream's relay reports and ``hubble status`` checks on
#: the Observer listener (upstream ``pkg/hubble/api/v1.ObserverServiceName``).
HUBBLE_HEALTH_SERVICE = "hubble.server.Observer"
HEALTH_NAMES = (OBSERVER_SERVICE, HUBBLE_HEALTH_SERVICE)


class PeerConnectionCollector(Collector):
    """``hubble_relay_pool_peer_connection_status{status}``: peers per channel state.

    ``status`` is the gRPC connectivity state name or ``NIL_CONNECTION`` for a peer
    without a channel (upstream relay pool metric).
    """

    STATES = ("NIL_CONNECTION", *(s.name for s in grpc.ChannelConnectivity))

    def __init__(self, peers: PeerManager) -> None:
        self.peers = peers

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Yield the gauge family, one sample per state (zeros included)."""
        counts = dict.fromkeys(self.STATES, 0)
        for peer in self.peers.list():
            state = peer.state()
            counts["NIL_CONNECTION" if state is None else state.name] += 1
        family = GaugeMetricFamily(
            "hubble_relay_pool_peer_connection_status",
            "Number of peers by connection status",
            labels=["status"],
        )
        for state, count in counts.items():
            family.add_metric([state], count)
        yield family


class Relay:
    """The running relay.

    Args:
        config: validated configuration.

    Attributes (after :meth:`start`):
        peers: the :class:`PeerManager`.
        observer: the :class:`RelayObserver` servicer.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.peers = PeerManager(
            config.peer_service,
            dial_timeout=config.dial_timeout,
            retry_timeout=config.retry_timeout,
            client_tls=config.client_tls,
            plaintext_only=config.disable_client_tls,
            on_peer_service=self._on_peer_service,
        )
        self.observer = RelayObserver(
            self.peers,
            ObserverOptions(
                sort_buffer_len_max=config.sort_buffer_len_max,
                sort_buffer_drain_timeout=config.sort_buffer_drain_timeout,
                peer_update_interval=config.peer_update_interval,
                error_aggregation_window=config.error_aggregation_window,
                peer_call_timeout=config.dial_timeout,
                flow_batches=config.peer_flow_batch_size > 0,
                max_batch=config.peer_flow_batch_size,
            ),
        )
        self._servers: list[tuple[grpc.aio.Server, Any]] = []
        self._metrics_server: MetricsServer | None = None
        self._front: h2server.GrpcH2Server | None = None
        self._private_dir: str | None = None
        self.addresses: dict[str, str] = {}

    async def _on_peer_service(self, connected: bool) -> None:
        for _, health in self._servers:
            await grpcserver.set_serving(health, HEALTH_NAMES, serving=connected)
        log.info("health", extra={"serving": connected})

    def _server_tls(self) -> h2server.ReloadingSSLContext | None:
        """The observer API's TLS (``--tls-relay-server-*``; mutual with client CAs), or
        None (plaintext, with a warning unless ``--disable-server-tls``).

        Raises:
            TLSFileError: a TLS file is unusable.
        """
        tls = self.config.server_tls
        if tls is None:
            if not self.config.disable_server_tls:
                log.warning(
                    "observer API is plaintext: give --tls-relay-server-cert-file and "
                    "--tls-relay-server-key-file (or --disable-server-tls to mean it)"
                )
            return None
        context = h2server.server_ssl_context(tls)
        log.info("observer API uses TLS", extra={"mutual": bool(tls.client_ca_files)})
        return context

    async def _start_observer(self) -> str:
        """The grpcio server behind a private unix socket, then the h2 front on
        ``--listen-address``; returns the front's bound address.

        Raises:
            cilia_common.grpcserver.BindError: the address cannot be bound.
        """
        tls = self._server_tls()
        self._private_dir = tempfile.mkdtemp(prefix="cilia-relay-")  # mode 0700
        backend = f"unix:{self._private_dir}/observer.sock"
        service = grpcserver.Service(add_relay_observer_to_server, self.observer, OBSERVER_SERVICE)
        server, health, _ = await grpcserver.start_server_with_ports([service], [backend])
        self._servers.append((server, health))
        front = h2server.GrpcH2Server(
            forward_to=backend,
            ssl_context=None if tls is None else tls.context,
            max_concurrent_streams=self.config.observer_max_concurrent_streams,
            send_buffer_bytes=self.config.observer_send_buffer_bytes,
        )
        front.add_unary_stream(
            f"/{OBSERVER_SERVICE}/GetFlows",
            self.observer.GetFlows,
            observer_pb2.GetFlowsRequest.FromString,
            serialize_response,
        )
        target = grpc_address(self.config.listen_address)
        try:
            bound = await front.start(target)
        except (OSError, ValueError) as exc:
            raise grpcserver.BindError(f"cannot listen on {target}: {exc}") from exc
        self._front = front
        return bound

    async def start(self) -> None:
        """Bind both gRPC servers, start metrics (if enabled) and the peer manager.

        Raises:
            cilia_common.grpcserver.BindError: an address cannot be bound (nothing is
                left running).
        """
        try:
            self.addresses["observer"] = await self._start_observer()
            target = grpc_address(self.config.health_listen_address)
            server, health, ports = await grpcserver.start_server_with_ports([], [target])
            self._servers.append((server, health))
            bound = grpcserver.bound_port(target, ports[target]) if target in ports else target
            self.addresses["health"] = bound
            if self.config.prometheus_serve_addr:
                registry = CollectorRegistry()
                registry.register(PeerConnectionCollector(self.peers))
                self._metrics_server = start_metrics_server(
                    self.config.prometheus_serve_addr, registry, flag="--prometheus-serve-addr"
                )
                self.addresses["metrics"] = self._metrics_server.address
        except grpcserver.BindError:
            await self.stop(0)
            raise
        for name, bound in self.addresses.items():
            announce_listening(log, name, bound)
        await self.peers.start()
        log.info(
            "relay started",
            extra={"peer_service": self.config.peer_service, "version": __version__},
        )

    async def stop(self, grace: float) -> None:
        """Report NOT_SERVING, stop the servers (``grace`` seconds for in-flight RPCs),
        then the peer manager (so clients never see their agents vanish) and metrics."""
        for _, health in self._servers:
            await grpcserver.set_serving(health, HEALTH_NAMES, serving=False)
        front, self._front = self._front, None
        stops = [server.stop(grace) for server, _ in self._servers]
        if front is not None:  # together: one grace period for every listener, not two
            stops.append(front.stop(grace))
        await asyncio.gather(*stops)
        self._servers = []
        if self._private_dir is not None:
            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
        await self.peers.stop()
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None


async def serve(config: Config) -> None:
    """Run the relay until SIGTERM or SIGINT.

    Raises:
        cilia_common.grpcserver.BindError: an address cannot be bound.
    """
    relay = Relay(config)
    started = False

    async def start() -> None:
        nonlocal started
        await relay.start()  # a failed start stops what it started itself
        started = True

    async def stop() -> None:
        if started:
            log.info("shutting down", extra={"grace_seconds": config.shutdown_grace_period})
            await relay.stop(config.shutdown_grace_period)

    await run_until_signal(start, stop)


def run(config: Config) -> None:
    """Blocking entry point used by ``cilia-relay serve``.

    Raises:
        cilia_common.grpcserver.BindError: an address cannot be bound.
    """
    asyncio.run(serve(config))
