"""Wiring of the operator: start/stop order and signal handling.

Start: store (ping) -> metrics endpoint -> gRPC server (health NOT_SERVING; mutual TLS
and authorisation by client certificate when the TLS files are set, see
``controlplane/authz.py``) ->
auto-create pools (existing ones skipped) -> without leader election: IPAM controller
restores every node's CIDRs -> identity and endpoint GC (and CiliumEndpointSlices, and in
standalone mode the Service controller: default ServiceCIDR, EndpointSlices) start -> health
SERVING. With --enable-leader-election: the replica follows the store (allocation streams
served, nothing allocated) and is SERVING at once; when it becomes leader the controller
restores and allocates, the GC and slices start; when it loses the lock they stop and it
follows again. Stop (SIGTERM/SIGINT): health NOT_SERVING -> gRPC server drains for
``--shutdown-grace-period`` -> endpoint and identity GC -> controller -> store
-> metrics endpoint. Tasks still running after that (a Redis watch cancelled inside its
connect may never return) get ``--shutdown-timeout`` seconds, then the process exits without
them (``__main__`` runs :func:`run` through ``cilia_common.runtime.run_bounded``).
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from cilia.controlplane.v1 import controlplane_pb2_grpc as pb_grpc
from cilia_common.grpcserver import (
    BindError,
    Service,
    bound_port,
    set_serving,
    start_server_with_ports,
)
from cilia_common.metrics import MetricsServer, start_metrics_server
from cilia_common.runtime import announce_listening, run_until_signal
from cilia_common.tls import CertificateReloader, TLSFileError, server_credentials

from .addresses import special_ranges
from .config import Config
from .controlplane.applyfence import ApplyFences
from .controlplane.authz import AuthorizationInterceptor
from .controlplane.endpoint import EndpointServicer
from .controlplane.identity import IdentityServicer
from .controlplane.ipam import IPAMServicer
from .controlplane.node import NodeServicer
from .controlplane.pod import PodServicer
from .controlplane.policy import PolicyServicer
from .controlplane.resources import ResourceServicer
from .controlplane.resources import add_to_server as add_resource_service
from .controlplane.service import ServiceServicer
from .endpoint.gc import EndpointGC
from .endpoint.slices import SliceController
from .identity.allocator import IdentityAllocator
from .identity.gc import IdentityGC
from .ipam.changes import overlap_errors
from .ipam.controller import IPAMController
from .ipam.nodegc import NodeGC
from .ipam.pool import pool_manifest, pool_overlaps, pool_specs
from .kinds import POOL, SERVICE_CIDR
from .leader import KubernetesLease, LeaderElector, Lock, RedisLock
from .manifests import ManifestLimits
from .metrics import Metrics
from .policy.reporter import PolicyReporter
from .service.allocation import ServiceSettings, named_service_cidrs
from .service.controller import ServiceController
from .store import AlreadyExists, Snapshot, StoreError, Write
from .store.kubernetes import KubernetesStore
from .store.redis import RedisStore

log = logging.getLogger(__name__)

SERVICE_NAMES = (
    "cilia.controlplane.v1.NodeService",
    "cilia.controlplane.v1.IPAMService",
    "cilia.controlplane.v1.ResourceService",
    "cilia.controlplane.v1.IdentityService",
    "cilia.controlplane.v1.EndpointService",
    "cilia.controlplane.v1.PolicyService",
    "cilia.controlplane.v1.PodService",
    "cilia.controlplane.v1.ServiceService",
)


class StartupError(RuntimeError):
    """The operator cannot start (store unreachable, port taken, conflicting pool)."""


class Operator:
    """One running operator. ``await start()``, then ``await stop()``.

    Attributes (after start):
        address: the bound gRPC address (``127.0.0.1:PORT`` when listening on port 0).
        metrics_port: the bound metrics port (None when disabled).
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.store: RedisStore | KubernetesStore
        if config.store == "kubernetes":
            self.store = KubernetesStore(
                kubeconfig=config.kubeconfig,
                api_server=config.k8s_api_server,
                request_timeout=config.store_request_timeout,
                watch_timeout=config.store_watch_timeout,
            )
        else:
            self.store = RedisStore(
                config.store,
                prefix=config.store_key_prefix,
                event_history=config.store_event_history,
                watch_block_timeout=config.store_watch_block_timeout,
                watch_batch_size=config.store_watch_batch_size,
                connect_timeout=config.store_connect_timeout,
                request_timeout=config.store_request_timeout,
            )
        self.controller = IPAMController(
            self.store,
            self.metrics,
            mode=config.ipam,
            default_pool=config.ipam_default_ip_pool,
            cluster_cidrs=config.cluster_pool_cidrs,
            cluster_mask_size=config.cluster_pool_ipv4_mask_size,
            migrate=config.enable_cluster_pool_to_multi_pool_migration,
            conflict_retries=config.store_conflict_retries,
            retry_interval=config.store_retry_interval,
            release_grace=config.node_cidr_release_grace_period,
            service_cidrs=config.service_cidrs,
        )
        self.identities = IdentityAllocator(
            self.store,
            max_id=config.identity_max_id,
            conflict_retries=config.store_conflict_retries,
        )
        self.identity_gc = IdentityGC(
            self.store,
            self.identities,
            interval=config.identity_gc_interval,
            heartbeat_timeout=config.identity_heartbeat_timeout,
            rate_interval=config.identity_gc_rate_interval,
            rate_limit=config.identity_gc_rate_limit,
            metrics=self.metrics,
        )
        self.endpoint_gc = EndpointGC(
            self.store,
            interval=config.cilium_endpoint_gc_interval,
            check_pods=config.store == "kubernetes",
            max_per_run=config.cilium_endpoint_gc_max_per_run,
            metrics=self.metrics,
        )
        # --store kubernetes: a CiliumNode follows its Node (ownerReference, Node-deletion GC)
        self.node_gc = (
            NodeGC(
                self.store,
                interval=config.nodes_gc_interval,
                release=self.controller.node_gone,
                retry_interval=config.store_retry_interval,
                conflict_retries=config.store_conflict_retries,
            )
            if config.store == "kubernetes"
            else None
        )
        self.controller.on_node_deleted(self._node_endpoints_gone)
        self.elector: LeaderElector | None = None
        self.slices = (
            SliceController(
                self.store,
                max_per_slice=config.ces_max_ciliumendpoints_per_ces,
                qps=config.ces_write_qps_limit,
                burst=config.ces_write_qps_burst,
                retry_interval=config.store_retry_interval,
                sync_counter=self.metrics.ces_sync,
            )
            if config.enable_cilium_endpoint_slice
            else None
        )
        # Kubernetes mode: the API server accepts policies Cilia cannot enforce as written;
        # a Warning Event on each says the agents enforce it fail closed (standalone
        # mode refuses them at apply)
        self.policy_reporter = PolicyReporter(self.store) if config.store == "kubernetes" else None
        # standalone: the operator keeps EndpointSlices and ServiceCIDRs (with --store
        # kubernetes, kube-controller-manager and the API server do)
        self.services = (
            ServiceController(
                self.store,
                config.service_cidrs,
                max_per_slice=config.max_endpoints_per_slice,
                retry_interval=config.store_retry_interval,
                alias_grace=config.service_alias_grace_period,
                alias_check_interval=config.service_alias_check_interval,
                pod_cidrs=config.cluster_pool_cidrs,
            )
            if config.store != "kubernetes"
            else None
        )
        if config.enable_leader_election:
            self.elector = LeaderElector(
                self._leader_lock(),
                identity=config.leader_election_id,
                lease_duration=config.leader_election_lease_duration,
                renew_deadline=config.leader_election_renew_deadline,
                retry_period=config.leader_election_retry_period,
                on_started=self._start_leading,
                on_stopped=self._stop_leading,
            )
        self.address = config.listen
        self.metrics_port: int | None = None
        self._server: Any = None
        self._health: Any = None
        self._metrics_server: MetricsServer | None = None
        self.tls_reloader: CertificateReloader | None = None
        self._health_server: Any = None
        self.health_address = ""
        self._stopped = False

    async def start(self) -> None:
        """Start everything; returns once health is SERVING. A failed start stops what it had
        started (gRPC servers, watches) before raising: a gRPC server left running would be
        shut down by grpc-aio from the garbage collector, where that shutdown can hang the
        process.

        Raises:
            StartupError: with a one-line reason.
        """
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        for net in self.config.cluster_pool_cidrs:
            for name, special in special_ranges(net):
                # as apply refuses for pools (ipam/pool.py validate_pool), in every mode
                raise StartupError(
                    f"--cluster-pool-ipv4-cidr: {net} overlaps the {name} range {special}: "
                    "not usable for pods"
                )
        try:
            await self.store.ping()
            if self.config.cluster_pool_cidrs:
                await self._check_cluster_pool_vs_service_cidrs()
        except StoreError as exc:
            raise StartupError(str(exc)) from None
        if self.config.prometheus_serve_addr:
            try:
                self._metrics_server = start_metrics_server(
                    self.config.prometheus_serve_addr,
                    self.metrics.registry,
                    flag="--prometheus-serve-addr",
                )
            except BindError as exc:
                raise StartupError(str(exc)) from None
            self.metrics_port = self._metrics_server.port
            announce_listening(log, "metrics", self._metrics_server.address)
        config = self.config
        conflict_retries = self.config.store_conflict_retries
        streams = {
            "chunk_size": self.config.watch_list_chunk_size,
            "queue_size": self.config.watch_buffer_size,
            "max_bytes": self.config.watch_max_message_bytes,
        }
        services = [
            Service(
                pb_grpc.add_NodeServiceServicer_to_server,
                NodeServicer(
                    self.store,
                    self.controller,
                    self.config.ipam_default_ip_pool,
                    conflict_retries,
                    pods_from_api=config.store == "kubernetes",
                    record_alias_use=True,
                    nodes_from_api=config.store == "kubernetes",
                    chunk_size=config.watch_list_chunk_size,
                    max_bytes=config.watch_max_message_bytes,
                ),
                SERVICE_NAMES[0],
            ),
            Service(
                pb_grpc.add_IPAMServiceServicer_to_server,
                IPAMServicer(
                    self.store,
                    self.controller,
                    conflict_retries,
                    config.ipam_default_ip_pool,
                    service_cidrs=config.service_cidrs,
                ),
                SERVICE_NAMES[1],
            ),
            Service(
                add_resource_service,
                ResourceServicer(
                    self.store,
                    self.identities,
                    config.service_cidrs,
                    limits=ManifestLimits(
                        max_bytes=config.apply_max_manifest_bytes,
                        max_documents=config.apply_max_documents,
                        max_depth=config.apply_max_depth,
                        max_alias_nodes=config.apply_max_alias_nodes,
                        max_record_bytes=config.apply_max_record_bytes,
                    ),
                    attempts=conflict_retries,
                    default_pool=config.ipam_default_ip_pool,
                    parse_concurrency=config.apply_max_concurrent_parses,
                    fences=ApplyFences(config.apply_outcomes_max, config.apply_outcome_retention),
                    services=ServiceSettings(
                        service_cidrs=config.service_cidrs,
                        node_port_range=config.node_port_range,
                        allocate=config.store != "kubernetes",
                        pod_cidrs=config.cluster_pool_cidrs,
                    ),
                ),
                SERVICE_NAMES[2],
            ),
            Service(
                pb_grpc.add_IdentityServiceServicer_to_server,
                IdentityServicer(self.store, self.identities, metrics=self.metrics, **streams),
                SERVICE_NAMES[3],
            ),
            Service(
                pb_grpc.add_EndpointServiceServicer_to_server,
                EndpointServicer(
                    self.store,
                    conflict_retries=conflict_retries,
                    pods_from_api=config.store == "kubernetes",
                    **streams,
                ),
                SERVICE_NAMES[4],
            ),
            Service(
                pb_grpc.add_PolicyServiceServicer_to_server,
                PolicyServicer(self.store, **streams),
                SERVICE_NAMES[5],
            ),
            Service(
                pb_grpc.add_PodServiceServicer_to_server,
                PodServicer(self.store, enabled=config.store == "kubernetes", **streams),
                SERVICE_NAMES[6],
            ),
            Service(
                pb_grpc.add_ServiceServiceServicer_to_server,
                ServiceServicer(self.store, **streams),
                SERVICE_NAMES[7],
            ),
        ]
        listen = self.config.listen
        credentials, interceptors = self._tls()
        try:
            self._server, self._health, ports = await start_server_with_ports(
                services,
                [listen],
                options=[
                    ("grpc.max_receive_message_length", config.grpc_max_receive_message_bytes)
                ],
                credentials=credentials,
                interceptors=interceptors,
            )
        except Exception as exc:
            raise StartupError(str(exc)) from None
        self.address = bound_port(listen, ports[listen]) if listen in ports else listen
        announce_listening(log, "grpc", self.address)
        if config.grpc_health_listen:
            await self._start_health_listener(config.grpc_health_listen)
        try:
            await self._auto_create_pools()
            if self.elector is None:
                await self._start_leading()
        except StoreError as exc:
            raise StartupError(str(exc)) from None
        if self.elector is not None:
            # a follower serves agents too (reads, watches, writes the leader reconciles):
            # every replica is ready, so a Deployment rollout of two replicas can finish
            try:
                await self.controller.observe()
            except StoreError as exc:
                raise StartupError(str(exc)) from None
            if self._health is not None:
                await set_serving(self._health, SERVICE_NAMES)
            self.elector.start()
        log.info("operator serving", extra={"listen": self.address, "metrics": self.metrics_port})

    async def _check_cluster_pool_vs_service_cidrs(self) -> None:
        """Refuse to start when a ``--cluster-pool-ipv4-cidr`` overlaps a stored ServiceCIDR
        (the reverse, a ServiceCIDR applied over the cluster-pool CIDRs, is refused by apply).

        Raises:
            StartupError: naming both; StoreError: the list failed.
        """
        stored = (await self.store.list(SERVICE_CIDR.kind)).items
        for name, svc_net in named_service_cidrs(stored, self.config.service_cidrs):
            for net in self.config.cluster_pool_cidrs:
                if net.overlaps(svc_net):
                    raise StartupError(
                        f"--cluster-pool-ipv4-cidr: {net} overlaps ServiceCIDR {name!r} {svc_net}"
                    )

    async def _start_health_listener(self, address: str) -> None:
        """Serve the main server's health servicer alone, in plaintext, on ``address``
        (``--grpc-health-listen``), so probes without client certificates see readiness.

        Raises:
            StartupError: the address cannot be bound.
        """
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise StartupError(f"--grpc-health-listen: cannot listen on {address}: {exc}") from None
        if port == 0:
            raise StartupError(f"--grpc-health-listen: cannot listen on {address}")
        await server.start()
        self._health_server = server
        self.health_address = bound_port(address, port)
        announce_listening(log, "health", self.health_address)

    def _tls(self) -> tuple[Any, list[Any]]:
        """``(server credentials or None, interceptors)`` of the gRPC listener: mutual TLS
        with authorisation by client certificate when the TLS files are configured, else
        plaintext without authorisation (a warning says so). With ``--store kubernetes``
        resource writes are refused to every caller either way (``controlplane/authz.py``).

        Raises:
            StartupError: a TLS file is unusable.
        """
        tls = self.config.server_tls
        kubernetes = self.config.store == "kubernetes"
        if tls is None:
            log.warning(
                "gRPC listener is plaintext: no client is authenticated or authorised "
                "(local development only; production: --tls-cert-file, --tls-key-file, "
                "--tls-client-ca-files)",
                extra={"listen": self.config.listen, "disable_tls": self.config.disable_tls},
            )
            # Kubernetes mode refuses resource writes over gRPC even without TLS
            return None, [
                AuthorizationInterceptor(authorise=False, kubernetes=True)
            ] if kubernetes else []
        try:
            credentials, self.tls_reloader = server_credentials(tls)
        except TLSFileError as exc:
            raise StartupError(f"TLS: {exc}") from None
        log.info(
            "gRPC listener uses mutual TLS",
            extra={"cert_file": tls.cert_file, "serial": f"{self.tls_reloader.serial:x}"},
        )
        return credentials, [AuthorizationInterceptor(kubernetes=kubernetes)]

    def _leader_lock(self) -> Lock:
        c = self.config
        if isinstance(self.store, KubernetesStore):
            return KubernetesLease(
                self.store,
                c.leader_election_lease_name,
                c.leader_election_lease_namespace,
                c.leader_election_lease_duration,
            )
        return RedisLock(
            c.store,
            f"{c.store_key_prefix}leader/{c.leader_election_lease_name}",
            c.leader_election_lease_duration,
            c.store_request_timeout,
        )

    @property
    def is_leader(self) -> bool:
        """Whether the leader-only controllers (IPAM allocation, migration, identity GC)
        run here: always True without ``--enable-leader-election``."""
        return self.elector is None or self.elector.is_leader

    async def _start_leading(self) -> None:
        """Leader-only work: the IPAM controller (restore, migration, allocation), the
        identity GC and the CiliumEndpointSlices; then health SERVING (a follower is
        SERVING too: it serves agents, and the leader allocates what they ask for)."""
        await self.controller.start()
        self.identity_gc.start()
        self.endpoint_gc.start()
        if self.node_gc is not None:
            self.node_gc.start()
        if self.slices is not None:
            await self.slices.start()
        if self.services is not None:
            await self.services.start()
        if self.policy_reporter is not None:
            self.policy_reporter.start()
        if self._health is not None:
            await set_serving(self._health, SERVICE_NAMES)

    async def _stop_leading(self) -> None:
        """Leadership lost: the leader-only work stops; the replica goes on serving agents
        as a follower (its allocation streams follow the store)."""
        if self.policy_reporter is not None:
            await self.policy_reporter.stop()
        if self.services is not None:
            await self.services.stop()
        if self.slices is not None:
            await self.slices.stop()
        if self.node_gc is not None:
            await self.node_gc.stop()
        await self.endpoint_gc.stop()
        await self.identity_gc.stop()
        await self.controller.stop()
        try:
            await self.controller.observe()
        except StoreError as exc:
            log.error("follower cannot follow the store", extra={"error": str(exc)})
            if self._health is not None:
                await set_serving(self._health, SERVICE_NAMES, serving=False)

    async def _node_endpoints_gone(self, name: str) -> None:
        """A CiliumNode was deleted (its Node went, or ``cilia-operator delete ciliumnodes``
        in standalone mode): one endpoint GC pass now deletes its CiliumEndpoints, so their
        addresses leave every agent's ipcache at once instead of at the next
        ``--cilium-endpoint-gc-interval``."""
        result = await self.endpoint_gc.run_once()
        log.info("endpoints of a deleted node collected",
                 extra={"node": name, "deleted": result.node_gone})  # fmt: skip

    async def _auto_create_pools(self) -> None:
        """Create the ``--auto-create-cilium-pod-ip-pools`` pools that do not exist (an
        existing one is skipped, never updated: upstream), in one store transaction that
        re-checks overlaps with the stored pools, so a concurrent apply or another
        replica starting cannot slip an overlapping pool in between.

        Raises:
            StartupError: a pool overlaps a stored pool, ``--service-cluster-ip-range`` or a
                stored ServiceCIDR.
        """
        wanted = self.config.auto_create_pools
        if not wanted:
            return
        created: list[str] = []

        async def plan(snapshot: Snapshot) -> list[Write]:
            existing = pool_specs(snapshot[POOL.kind].items)
            present = {o["metadata"]["name"] for o in snapshot[POOL.kind].items}
            named = named_service_cidrs(
                snapshot[SERVICE_CIDR.kind].items, self.config.service_cidrs
            )
            writes = []
            created.clear()
            for name, spec in wanted.items():
                if name in present:
                    log.info("auto-create pool skipped: it exists", extra={"pool": name})
                    continue
                overlaps = pool_overlaps(name, spec.cidrs, existing.values()) + overlap_errors(
                    spec.cidrs, service_cidrs=self.config.service_cidrs, named_service_cidrs=named
                )
                if overlaps:
                    raise StartupError(
                        f"--auto-create-cilium-pod-ip-pools: pool {name!r}: {overlaps[0].reason}"
                    )
                existing[name] = spec
                writes.append(Write("create", pool_manifest(spec)))
                created.append(name)
            return writes

        for _ in range(self.config.store_conflict_retries):
            try:
                await self.store.transact(
                    [POOL.kind, SERVICE_CIDR.kind],
                    plan,
                    attempts=self.config.store_conflict_retries,
                )
                break
            except AlreadyExists:  # Kubernetes store: created meanwhile; plan again
                created.clear()
        for name in created:
            log.info("pool auto-created", extra={"pool": name})

    async def stop(self) -> None:
        """Stop in reverse order; safe after a (partial) start, and a second call does nothing."""
        if self._stopped:
            return
        self._stopped = True
        if self._health is not None:
            await set_serving(self._health, SERVICE_NAMES, serving=False)
        if self._server is not None:
            await self._server.stop(self.config.shutdown_grace_period)
        if self._health_server is not None:
            await self._health_server.stop(None)
        if self.elector is not None:
            await self.elector.stop()
        if self.policy_reporter is not None:
            await self.policy_reporter.stop()
        if self.services is not None:
            await self.services.stop()
        if self.slices is not None:
            await self.slices.stop()
        if self.node_gc is not None:
            await self.node_gc.stop()
        await self.endpoint_gc.stop()
        await self.identity_gc.stop()
        await self.controller.stop()
        await self.store.close()
        if self._metrics_server is not None:
            self._metrics_server.close()
            self._metrics_server = None
        log.info("operator stopped")


async def run(config: Config) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit status.

    Exit 0 on a clean stop; 2 when start-up fails (reason logged and on stderr); 1 when
    this replica lost the leader election (as upstream: restart and compete again).

    Raises:
        StartupError: the operator could not start (it was stopped again).
    """
    operator = Operator(config)
    lost = operator.elector.lost if operator.elector is not None else None
    started = False

    async def start() -> None:
        nonlocal started
        try:
            await operator.start()
        except StartupError as exc:
            log.error("operator failed to start", extra={"error": str(exc)})
            raise
        started = True

    async def stop() -> None:
        if started:
            leader_lost = lost is not None and lost.is_set()
            log.info(
                "leader election lost; exiting" if leader_lost else "signal received; shutting down"
            )
        await operator.stop()

    await run_until_signal(start, stop, until=[lost] if lost is not None else [])
    return 1 if lost is not None and lost.is_set() else 0
