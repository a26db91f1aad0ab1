"""One object holding the agent's whole Hubble: the entry point ``app.py`` wires.

Typical wiring (inside the agent's event loop)::

    hubble = Hubble(hubble_config(cfg, __version__, node_addresses),
                    resolver=OwnerResolver(endpoints=regeneration, ipcache=ipcache,
                                           identities=identity_allocator),
                    registry=agent_metrics.registry)
    await hubble.start_reader(datapath)         # the loaded datapath.loader.Datapath
    server = ...hubble.services()...            # Observer + Peer (api.serve_api)
    supervisor.spawn("watch-nodes", ... hubble.peers.consume_watch ...)
    metrics.scrape_hook.refresh = hubble.refresh_datapath_counters
    if hubble.metrics.enabled:                  # --hubble-metrics, on --hubble-metrics-server
        start_metrics_server(address, hubble.metrics.flow_registry, flag=...)
    ...
    await hubble.stop(); await server.stop(grace)

The resolver reads the owners of node state through getters (upstream Hubble's parser
getters); Hubble holds no copy of their data. Without a resolver, a :class:`MemoryResolver`
(the hand-fed fake of tests and replays) is used.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health
from prometheus_client import REGISTRY, CollectorRegistry

from cilia.flowbatch.v1 import flowbatch_pb2_grpc
from cilia.hubble.flow import flow_pb2
from cilia.hubble.peer import peer_pb2_grpc
from cilia_agent.config import Config
from cilia_agent.hubble.enrich import MemoryResolver, Resolver
from cilia_agent.hubble.eventlog import EventLog, agent_started_event
from cilia_agent.hubble.flowstore import FlowStore
from cilia_agent.hubble.metrics import HandlerSpec, HubbleMetrics, parse_metrics, read_counters
from cilia_agent.hubble.observer import (
    FlowBatchServicer,
    ObserverServicer,
    add_observer_to_server,
)
from cilia_agent.hubble.parser import BootClock, Parser
from cilia_agent.hubble.peer import (
    DEFAULT_PEER_BUFFER,
    PeerInfo,
    PeerRegistry,
    PeerServicer,
    join_host_port,
)
from cilia_agent.hubble.reader import (
    DEFAULT_POLL_TIMEOUT_MS,
    DEFAULT_QUEUE_SIZE,
    EventReader,
    LibbpfRingBuffer,
    RecordSource,
)
from cilia_agent.hubble.ring import DEFAULT_CAPACITY, validate_capacity
from cilia_common import grpcserver

OBSERVER_SERVICE = "observer.Observer"
#: Cilia-private: the GetFlows stream in batches, for the relay (proto cilia/flowbatch/v1).
FLOW_BATCH_SERVICE = "cilia.flowbatch.v1.FlowBatchService"
PEER_SERVICE = "peer.Peer"
#: The ``grpc.health.v1`` service name upstream Hubble servers report and ``hubble status``
#: checks (upstream ``pkg/hubble/api/v1.ObserverServiceName``) — not the proto service name.
HUBBLE_HEALTH_SERVICE = "hubble.server.Observer"


@dataclass(frozen=True)
class HubbleConfig:
    """Hubble settings (each maps to an agent flag).

    Attributes:
        node_name: ``--node-name``.
        capacity: ``--hubble-event-buffer-capacity`` (2^n-1, 1..65535, default 4095).
        advertise_address: ``host:port`` other nodes/the relay reach this node's Hubble
            at (GetNodes address, the local PEER_ADDED entry).
        version: reported by ServerStatus/GetNodes.
        queue_size: ``--hubble-event-queue-size``: records waiting between the
            ring-buffer poll thread and the loop (default 1000).
        poll_timeout_ms: ring buffer poll timeout (stop latency), default 100.
        peer_buffer: Notify changes queued per subscriber before disconnecting it.
        tls_cluster: the cluster name when Hubble's TCP server uses TLS (peers are then
            announced with their TLS names); None without TLS.
        metrics: ``--hubble-metrics`` parsed: the metric handlers to enable.
    """

    node_name: str
    capacity: int = DEFAULT_CAPACITY
    advertise_address: str = ""
    version: str = ""
    queue_size: int = DEFAULT_QUEUE_SIZE
    poll_timeout_ms: int = DEFAULT_POLL_TIMEOUT_MS
    peer_buffer: int = DEFAULT_PEER_BUFFER
    tls_cluster: str | None = None
    metrics: tuple[HandlerSpec, ...] = ()


class Hubble:
    """The agent's Hubble: flow ring, parser, reader, Observer and Peer servicers, metrics.

    Args:
        config: settings (validated here).
        resolver: enrichment lookups (the agent's ``OwnerResolver``); default a fresh
            :class:`MemoryResolver` fed by hand (tests, replays).
        registry: Prometheus registry for the metrics (default the global one).
        clock: monotonic → wall conversion (tests inject a fixed offset).

    Raises:
        InvalidCapacity: ``config.capacity`` is not 2^n-1 in 1..65535.
    """

    def __init__(
        self,
        config: HubbleConfig,
        *,
        resolver: Resolver | None = None,
        registry: CollectorRegistry = REGISTRY,
        clock: BootClock | None = None,
    ) -> None:
        validate_capacity(config.capacity)
        self.config = config
        self.resolver: Resolver = resolver if resolver is not None else MemoryResolver()
        self.metrics = HubbleMetrics(registry, handlers=config.metrics)
        self.store = FlowStore(
            config.capacity,
            node_name=config.node_name,
            version=config.version,
            on_lost=self.metrics.events_lost,
        )
        self.parser = Parser(self.resolver, config.node_name, clock)
        self.peers = PeerRegistry(
            PeerInfo(config.node_name, config.advertise_address),
            max_buffer=config.peer_buffer,
            tls_cluster=config.tls_cluster,
        )
        # Upstream's agent announces its start as an AGENT_STARTED agent event.
        self.agent_events: EventLog[flow_pb2.AgentEvent] = EventLog()
        started_ns = time.time_ns()
        self.agent_events.add(agent_started_event(started_ns), started_ns)
        self.debug_events: EventLog[flow_pb2.DebugEvent] = EventLog()
        self.observer_servicer = ObserverServicer(
            self.store,
            config.advertise_address,
            agent_events=self.agent_events,
            debug_events=self.debug_events,
        )
        self.peer_servicer = PeerServicer(self.peers)
        self.flow_batch_servicer = FlowBatchServicer(self.store)
        self.reader: EventReader | None = None
        self._bpf: Any = None

    def services(self) -> list[grpcserver.Service]:
        """The Observer, Peer and (Cilia-private, for the relay) FlowBatch services for
        :func:`cilia_common.grpcserver.start_server`."""
        return [
            grpcserver.Service(
                add_observer_to_server,  # GetFlows sends the ring's bytes as they are
                self.observer_servicer,
                OBSERVER_SERVICE,
            ),
            grpcserver.Service(
                peer_pb2_grpc.add_PeerServicer_to_server, self.peer_servicer, PEER_SERVICE
            ),
            grpcserver.Service(
                flowbatch_pb2_grpc.add_FlowBatchServiceServicer_to_server,
                self.flow_batch_servicer,
                FLOW_BATCH_SERVICE,
            ),
        ]

    def health_names(self) -> list[str]:
        """Service names to report SERVING in ``grpc.health.v1``: the proto services and
        :data:`HUBBLE_HEALTH_SERVICE` (what ``hubble status`` checks)."""
        return [*(s.full_name for s in self.services()), HUBBLE_HEALTH_SERVICE]

    async def serve(
        self, addresses: list[str], *, socket_mode: int = 0o600
    ) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
        """Start a gRPC server with Observer + Peer (+ health, reflection), marked SERVING.

        Args:
            addresses: e.g. ``["unix:/var/run/cilia/hubble.sock", ":4244"]``.

        Raises:
            cilia_common.grpcserver.BindError: an address could not be bound.
        """
        server, health_servicer = await grpcserver.start_server(
            self.services(), addresses, socket_mode=socket_mode
        )
        await grpcserver.set_serving(health_servicer, self.health_names())
        return server, health_servicer

    async def start_reader(self, bpf: Any = None, *, source: RecordSource | None = None) -> None:
        """Start consuming datapath events.

        Args:
            bpf: the loaded ``datapath.loader.Datapath`` (ring buffer ``cilia_events``), or
            source: any :class:`RecordSource` (tests, replay).

        Raises:
            ValueError: neither or both given.
            RuntimeError: already started.
        """
        if (bpf is None) == (source is None):
            raise ValueError("pass exactly one of bpf or source")
        if self.reader is not None:
            raise RuntimeError("Hubble reader already started")
        self._bpf = bpf
        record_source = source if source is not None else LibbpfRingBuffer(bpf)
        self.reader = EventReader(
            record_source,
            self.parser,
            self.store,
            self.metrics,
            queue_size=self.config.queue_size,
            poll_timeout_ms=self.config.poll_timeout_ms,
        )
        await self.reader.start()

    def refresh_datapath_counters(self) -> None:
        """Read the datapath's per-CPU ``cilia_metrics`` map into the drop/forward counters
        (called at each scrape; nothing without a datapath)."""
        if self._bpf is not None:
            self.metrics.update_datapath_counters(read_counters(self._bpf.metrics_map))

    async def stop(self) -> None:
        """Stop the reader (flushing queued events into the ring). Servers are the caller's."""
        if self.reader is not None:
            await self.reader.stop()
            self.reader = None

    def close_metrics(self) -> None:
        """Unregister the metrics (when the registry outlives this object)."""
        self.metrics.close()


EVENT_QUEUE_PER_CPU = 1024
"""Default hand-off queue slots per CPU (upstream's monitor queue size per CPU)."""
EVENT_QUEUE_MAX_DEFAULT = 16384
"""Upper bound of the computed default (upstream's per-CPU maximum)."""


def default_event_queue_size(cpus: int | None = None) -> int:
    """``--hubble-event-queue-size 0``: 1024 slots per CPU (``cpus``, default
    ``os.cpu_count()``), at most 16384 — upstream derives the Hubble event queue from its
    monitor queue size the same way (2,048 on this 2-core machine)."""
    n = cpus if cpus is not None else (os.cpu_count() or 1)
    return min(EVENT_QUEUE_PER_CPU * max(1, n), EVENT_QUEUE_MAX_DEFAULT)


def hubble_advertise_address(cfg: Config, addresses: Sequence[str]) -> str:
    """``host:port`` other nodes and the relay reach this node's Hubble TCP server at
    ("" when TCP is disabled, its port is 0, or the node has no address): the host of
    ``--hubble-listen-address`` when given, else the node's first IP."""
    port = cfg.hubble_port()
    if not cfg.hubble_listen_address or port == 0:
        return ""
    host = cfg.hubble_listen_address.rpartition(":")[0]
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = addresses[0] if addresses else ""
    return join_host_port(host, port) if host else ""


def hubble_config(cfg: Config, version: str, addresses: Sequence[str]) -> HubbleConfig:
    """The :class:`HubbleConfig` of the agent's flags (``--hubble-event-buffer-capacity``,
    ``--hubble-event-queue-size``, ``--node-name``, ``--hubble-metrics``) for a node with
    ``addresses``.

    Raises:
        cilia_agent.hubble.metrics.MetricsConfigError: ``--hubble-metrics`` is malformed.
    """
    return HubbleConfig(
        node_name=cfg.node_name,
        capacity=cfg.hubble_event_buffer_capacity,
        advertise_address=hubble_advertise_address(cfg, addresses),
        version=version,
        queue_size=cfg.hubble_event_queue_size or default_event_queue_size(),
        tls_cluster=cfg.cluster_name if cfg.hubble_tls is not None else None,
        metrics=tuple(parse_metrics(cfg.hubble_metrics)),
    )
