"""The operator's validated configuration: one field per ``cilia-operator serve`` flag.

Each field is its flag, written once (name, help, default, range): ``__main__`` generates the
flags with :func:`cilia_common.flags.add_model_flags`. Durations (:data:`Duration`) take Go
durations (``15m``) or seconds.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cilia_common.addresses import split_host_port
from cilia_common.flags import Duration, Flag, require_all_or_none, split_list
from cilia_common.tls import ServerTLS

from .ipam.flags import PoolFlagError, parse_auto_create_pools
from .ipam.pool import PoolSpec, no_pod_address


class Config(BaseModel):
    """``cilia-operator serve`` settings; each field's description, default and range are its
    flag's help, default and range.

    Raises (on construction):
        pydantic.ValidationError: a value out of range or malformed; the message names the
            flag (``--cluster-pool-ipv4-mask-size: ...``) or the field is the flag.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="store: redis://HOST:PORT/DB, or 'kubernetes' (CRDs via the API server, "
        "see --kubeconfig)",
    )
    listen: str = Field(
        default="127.0.0.1:4250", description="gRPC listen address HOST:PORT or unix:PATH"
    )
    prometheus_serve_addr: str = Field(
        default=":9963", description="metrics listen address [HOST]:PORT, '' disables"
    )
    auto_create_cilium_pod_ip_pools: Annotated[list[str], Flag(metavar="SPEC")] = Field(
        default_factory=list,
        description="pools to create at start-up unless they exist: "
        "'<pool>=ipv4-cidrs:<c>[,<c>...];ipv4-mask-size:<n>[;allow-first-ip:<b>]"
        "[;allow-last-ip:<b>]'; several pools separated by spaces or by repeating the flag",
    )
    ipam_default_ip_pool: str = Field(
        default="default", description="pool agents allocate from by default"
    )
    log_level: Annotated[str, Flag(metavar="{debug,info,warning,error}")] = Field(
        default="info", description="log level"
    )
    store_key_prefix: str = Field(default="cilia/", description="prefix of every Redis key")
    store_event_history: int = Field(
        default=10000,
        ge=1,
        description="change events kept per kind for watches; a watcher further behind relists",
    )
    store_watch_block_timeout: float = Field(
        default=5.0, gt=0, description="seconds one blocking stream read waits"
    )
    store_watch_batch_size: int = Field(
        default=500, ge=1, description="max events read per watch round trip"
    )
    store_connect_timeout: Duration = Field(
        default=5.0, gt=0, description="time to connect to the store (Go duration or seconds)"
    )
    store_request_timeout: Duration = Field(
        default=10.0, gt=0, description="time to wait for a store reply (Go duration or seconds)"
    )
    store_retry_interval: Duration = Field(
        default=1.0,
        gt=0,
        description="time between retries after a store error (Go duration or seconds)",
    )
    store_conflict_retries: int = Field(
        default=5, ge=1, description="attempts of a write that hits a resourceVersion conflict"
    )
    shutdown_grace_period: Duration = Field(
        default=5.0, ge=0, description="time in-flight RPCs get on SIGTERM (Go duration or seconds)"
    )
    shutdown_timeout: Duration = Field(
        default=5.0,
        ge=0,
        description="time (Go duration or seconds) the process waits, once stopped, for background tasks still running (cancelled) before it exits without them, naming them in a warning (e.g. a Redis watch stuck in its connect)",
    )
    node_cidr_release_grace_period: Duration = Field(
        default=30.0,
        ge=0,
        description="how long the pod CIDRs of a deleted CiliumNode stay held for it before they are released for other nodes (Go duration or seconds; 0 releases at once); a node registering again within it keeps them",
    )
    identity_gc_interval: Duration = Field(
        default=900.0,
        ge=0,
        description="identity GC period (Go duration or seconds); 0 disables",
    )
    identity_heartbeat_timeout: Duration = Field(
        default=1800.0, ge=0, description="how long an identity nothing references lives on"
    )
    identity_gc_rate_interval: Duration = Field(
        default=60.0, gt=0, description="window of --identity-gc-rate-limit"
    )
    identity_gc_rate_limit: int = Field(
        default=2500,
        ge=1,
        description="max identities deleted per --identity-gc-rate-interval",
    )
    cilium_endpoint_gc_interval: Duration = Field(
        default=300.0,
        ge=0,
        description="CiliumEndpoint GC period (Go duration or seconds): records whose node has no CiliumNode, or in Kubernetes mode whose Pod is gone, are deleted; 0 disables",
    )
    cilium_endpoint_gc_max_per_run: int = Field(
        default=1000,
        ge=1,
        description="max CiliumEndpoints the endpoint GC deletes in one run (the rest wait for the next)",
    )
    enable_cilium_endpoint_slice: bool = Field(
        default=False,
        description="batch CiliumEndpoints into CiliumEndpointSlices (cilium.io/v2alpha1), "
        "grouped by namespace and identity (upstream enable-cilium-endpoint-slice)",
    )
    ces_max_ciliumendpoints_per_ces: int = Field(
        default=100, ge=1, le=10000, description="endpoints in one CiliumEndpointSlice at most"
    )
    ces_write_qps_limit: float = Field(
        default=10.0, gt=0, description="CiliumEndpointSlice writes per second (sustained)"
    )
    ces_write_qps_burst: int = Field(
        default=20, ge=1, description="CiliumEndpointSlice writes allowed in a burst"
    )
    identity_max_id: int = Field(
        default=65535,
        ge=256,
        le=65535,
        description="largest cluster identity (allocation starts at 256)",
    )
    watch_list_chunk_size: int = Field(
        default=1000,
        ge=1,
        description="max events per message of a watch stream's initial listing",
    )
    watch_max_message_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=64 * 1024,
        description="max bytes of one watch-stream message (every stream: nodes, ipcache, "
        "policies, pods, services, identities); the default is grpcio's default receive "
        "limit (4 MiB), which the agent keeps unless --operator-max-message-bytes raises it; "
        "must exceed --apply-max-record-bytes so one stored object always fits",
    )
    watch_buffer_size: int = Field(
        default=1000,
        ge=1,
        description="changes buffered per watch stream before its store watch waits (it "
        "relists if it falls behind --store-event-history)",
    )
    ipam: Literal["cluster-pool", "multi-pool", "kubernetes"] = Field(
        default="multi-pool",
        description="IPAM mode (upstream operator flag `ipam`; upstream's default is "
        "cluster-pool); kubernetes: each node's pod CIDRs are its Node's spec.podCIDRs (set "
        "by kube-controller-manager or the cluster's tooling), the operator allocates "
        "nothing (needs --store kubernetes)",
    )
    cluster_pool_ipv4_cidr: Annotated[list[str], Flag(metavar="CIDR")] = Field(
        default_factory=list,
        description="cluster-pool mode: CIDRs node blocks are carved from; repeat the flag or "
        "separate with commas (required with --ipam cluster-pool)",
    )
    cluster_pool_ipv4_mask_size: int = Field(
        default=24,
        ge=1,
        le=32,
        description="cluster-pool mode: prefix length of each node's block",
    )
    enable_cluster_pool_to_multi_pool_migration: bool = Field(
        default=False,
        description="adopt every node's spec.ipam.podCIDRs into the default pool's allocations "
        "before allocating (one-way; needs --ipam multi-pool)",
    )
    service_cluster_ip_range: Annotated[list[str], Flag(metavar="CIDR")] = Field(
        default_factory=lambda: ["10.96.0.0/12"],
        description="service CIDRs (kube-apiserver's default is 10.96.0.0/12): no pod block "
        "overlapping one is handed out (--cluster-pool-ipv4-cidr may contain one: its blocks "
        "there are skipped; an applied pool may not overlap one); repeat or comma-separate. Standalone: the default ServiceCIDR "
        "'kubernetes' ClusterIPs are allocated from (created at start unless it exists)",
    )
    service_node_port_range: Annotated[str, Flag(metavar="FIRST-LAST")] = Field(
        default="30000-32767",
        description="standalone: the NodePorts of NodePort/LoadBalancer Services are allocated "
        "from this inclusive range (kube-apiserver's flag and default)",
    )
    service_alias_grace_period: Duration = Field(
        default=3600.0,
        gt=0,
        description="standalone, ServiceCIDR migration: an old ClusterIP kept as an alias of "
        "the new one is released once no node has seen a connection to it for this long "
        "(Go duration or seconds)",
    )
    service_alias_check_interval: Duration = Field(
        default=5.0,
        gt=0,
        description="standalone: how often the aliases of migrated Services are checked "
        "against the grace period (Go duration or seconds)",
    )
    max_endpoints_per_slice: int = Field(
        default=100,
        ge=1,
        le=1000,
        description="standalone: endpoints in one EndpointSlice the operator keeps at most "
        "(kube-controller-manager's --max-endpoints-per-slice)",
    )
    kubeconfig: Annotated[str, Flag(aliases=("--k8s-kubeconfig-path",))] = Field(
        default="",
        description="--store kubernetes: kubeconfig file, alias --k8s-kubeconfig-path "
        "(upstream's name); '' = in-cluster config (env KUBERNETES_SERVICE_HOST/"
        "KUBERNETES_SERVICE_PORT, which the chart sets to k8sServiceHost/k8sServicePort, and "
        "the service-account token), else $KUBECONFIG / ~/.kube/config",
    )
    k8s_api_server: str = Field(
        default="",
        description="--store kubernetes: API server URL https://HOST:PORT replacing the "
        "server of the kubeconfig or of the in-cluster env (upstream k8s-api-server); alone "
        "(no kubeconfig, no env) it is used without credentials",
    )
    nodes_gc_interval: Duration = Field(
        default=300.0,
        ge=0,
        description="--store kubernetes: period of the CiliumNode GC (upstream nodes-gc-interval, 5m0s): a CiliumNode whose Node is gone is deleted (one with an ownerReference at once, one without after a second pass); a Node deletion is acted on at once besides; 0 disables the periodic pass",
    )
    store_watch_timeout: int = Field(
        default=300,
        ge=1,
        description="--store kubernetes: seconds one watch request lasts before it is reopened "
        "from the last seen resourceVersion",
    )
    enable_leader_election: bool = Field(
        default=False,
        description="run the leader-only controllers (IPAM allocation, migration, identity GC) "
        "only while holding the leader lock: a Redis key or a coordination.k8s.io Lease "
        "(false = always leader)",
    )
    leader_election_lease_duration: Duration = Field(
        default=15.0, gt=0, description="how long a leader's lock outlives its last renewal"
    )
    leader_election_renew_deadline: Duration = Field(
        default=10.0,
        gt=0,
        description="the leader steps down when it could not renew for this long",
    )
    leader_election_retry_period: Duration = Field(
        default=2.0, gt=0, description="interval of acquire/renew attempts"
    )
    leader_election_lease_name: str = Field(
        default="cilia-operator-resource-lock",
        description="Lease name (kubernetes) / Redis key suffix",
    )
    leader_election_lease_namespace: str = Field(
        default="kube-system", description="namespace of the Lease (--store kubernetes)"
    )
    leader_election_id: Annotated[
        str, Flag(default_text="$POD_NAME or hostname, plus a random suffix")
    ] = Field(default="", description="this replica's identity in the lock")
    apply_max_manifest_bytes: int = Field(
        default=3 * 1024 * 1024, ge=1,
        description="UTF-8 bytes of one apply manifest (3 MiB: the Kubernetes API server's "
        "request body limit)",
    )  # fmt: skip
    apply_max_documents: int = Field(
        default=1000, ge=1, description="documents in one apply manifest"
    )
    apply_max_depth: int = Field(
        default=100, ge=2, le=200,
        description="nesting of mappings/sequences in a manifest, YAML aliases expanded",
    )  # fmt: skip
    apply_max_alias_nodes: int = Field(
        default=10_000, ge=0,
        description="YAML nodes aliases may add to a manifest once expanded",
    )  # fmt: skip
    apply_max_record_bytes: int = Field(
        default=1536 * 1024, ge=1,
        description="one manifest document as stored JSON (1.5 MiB: etcd's request limit)",
    )  # fmt: skip
    apply_max_concurrent_parses: int = Field(
        default=1, ge=1,
        description="manifests parsed and validated at once; more wait without using CPU",
    )  # fmt: skip
    apply_outcomes_max: int = Field(
        default=10_000, ge=1,
        description="finished applies whose outcome ApplyOutcome can still tell (oldest "
        "forgotten first)",
    )  # fmt: skip
    apply_outcome_retention: Duration = Field(
        default=600.0, gt=0,
        description="how long ApplyOutcome can tell what became of a finished apply",
    )  # fmt: skip
    grpc_max_receive_message_bytes: int = Field(
        default=128 * 1024 * 1024, ge=4 * 1024 * 1024,
        description="largest gRPC message the server takes in (above "
        "--apply-max-manifest-bytes, so an oversized manifest gets apply's INVALID_ARGUMENT "
        "naming that flag, not a transport error)",
    )  # fmt: skip

    tls_cert_file: Annotated[str, Flag(metavar="PATH")] = Field(
        default="",
        description="PEM certificate (chain) the gRPC listener serves; with --tls-key-file and "
        "--tls-client-ca-files it turns on mutual TLS and authorisation by client "
        "certificate; re-read when the file changes (upstream hubble-tls-cert-file)",
    )
    tls_key_file: Annotated[str, Flag(metavar="PATH")] = Field(
        default="", description="PEM private key of --tls-cert-file (upstream hubble-tls-key-file)"
    )
    tls_client_ca_files: Annotated[list[str], Flag(metavar="PATH")] = Field(
        default_factory=list,
        description="PEM CA bundles client certificates must chain to; repeat or "
        "comma-separate (upstream hubble-tls-client-ca-files)",
    )
    grpc_health_listen: str = Field(
        default="",
        description="extra plaintext listener HOST:PORT serving only grpc.health.v1 (the same "
        "statuses as --listen), for probes that cannot do mutual TLS (kubelet gRPC probes, "
        "the image HEALTHCHECK); '' = none",
    )
    disable_tls: bool = Field(
        default=False,
        description="serve gRPC in plaintext without authorisation on a non-loopback --listen "
        "(local development only; logged as a warning); a loopback or unix: --listen without "
        "TLS files is plaintext too, also with a warning",
    )

    @field_validator("tls_client_ca_files")
    @classmethod
    def _ca_files(cls, value: list[str]) -> list[str]:
        return split_list(value)

    @model_validator(mode="after")
    def _message_fits_record(self) -> Config:
        if self.watch_max_message_bytes <= self.apply_max_record_bytes:
            raise ValueError(
                f"--watch-max-message-bytes {self.watch_max_message_bytes}: must exceed "
                f"--apply-max-record-bytes {self.apply_max_record_bytes} (one stored object "
                "must fit in one stream message)"
            )
        return self

    @model_validator(mode="after")
    def _tls(self) -> Config:
        from cilia_common.tls import is_loopback

        files = {
            "--tls-cert-file": self.tls_cert_file,
            "--tls-key-file": self.tls_key_file,
            "--tls-client-ca-files": self.tls_client_ca_files,
        }
        require_all_or_none(files, "mutual TLS")
        given = all(files.values())
        if given and self.disable_tls:
            raise ValueError("--disable-tls: conflicts with --tls-cert-file")
        if not given and not self.disable_tls and not is_loopback(self.listen):
            raise ValueError(
                f"--listen {self.listen}: reachable from other hosts, so it needs mutual TLS "
                "(--tls-cert-file, --tls-key-file, --tls-client-ca-files; "
                "'cilia-operator certs generate' makes them), or --disable-tls for local "
                "development"
            )
        return self

    @property
    def server_tls(self) -> ServerTLS | None:
        """The TLS files of the gRPC listener, or None for plaintext."""
        if not self.tls_cert_file:
            return None
        return ServerTLS(self.tls_cert_file, self.tls_key_file, tuple(self.tls_client_ca_files))

    @field_validator("cluster_pool_ipv4_cidr", "service_cluster_ip_range")
    @classmethod
    def _cidrs(cls, value: list[str], info: ValidationInfo) -> list[str]:
        flag = "--" + str(info.field_name).replace("_", "-")
        out = []
        for item in value:
            for part in item.split(","):
                if not part.strip():
                    continue
                try:
                    out.append(str(ipaddress.IPv4Network(part.strip(), strict=True)))
                except ValueError as exc:
                    raise ValueError(f"{flag}: {part!r} is not an IPv4 CIDR: {exc}") from None
        return out

    @model_validator(mode="after")
    def _ipam_modes(self) -> Config:
        nets = [ipaddress.IPv4Network(c) for c in self.cluster_pool_ipv4_cidr]
        if self.ipam == "cluster-pool" and not nets:
            raise ValueError("--cluster-pool-ipv4-cidr: required with --ipam cluster-pool")
        if self.ipam == "kubernetes" and self.store != "kubernetes":
            raise ValueError(
                "--ipam kubernetes: needs --store kubernetes (the pod CIDRs are the Node "
                "objects' spec.podCIDRs in the API server)"
            )
        why = no_pod_address(self.cluster_pool_ipv4_mask_size, False, False)
        if why:
            raise ValueError(
                f"--cluster-pool-ipv4-mask-size: {self.cluster_pool_ipv4_mask_size}: {why}"
            )
        for net in nets:
            if self.cluster_pool_ipv4_mask_size < net.prefixlen:
                raise ValueError(
                    f"--cluster-pool-ipv4-mask-size: {self.cluster_pool_ipv4_mask_size} is "
                    f"shorter than the prefix of --cluster-pool-ipv4-cidr {net}"
                )
            for svc in self.service_cidrs:
                if net.subnet_of(svc):  # an overlap is fine: those blocks are skipped
                    raise ValueError(
                        f"--cluster-pool-ipv4-cidr: {net} lies inside --service-cluster-ip-range "
                        f"{svc}: no block of it could be handed out"
                    )
        for i, net in enumerate(nets):
            for other in nets[:i]:
                if net.overlaps(other):
                    raise ValueError(f"--cluster-pool-ipv4-cidr: {net} overlaps {other}")
        if self.enable_cluster_pool_to_multi_pool_migration and self.ipam != "multi-pool":
            raise ValueError(
                "--enable-cluster-pool-to-multi-pool-migration: needs --ipam multi-pool"
            )
        return self

    @property
    def cluster_pool_cidrs(self) -> tuple[ipaddress.IPv4Network, ...]:
        """Parsed ``--cluster-pool-ipv4-cidr``."""
        return tuple(ipaddress.IPv4Network(c) for c in self.cluster_pool_ipv4_cidr)

    @property
    def service_cidrs(self) -> tuple[ipaddress.IPv4Network, ...]:
        """Parsed ``--service-cluster-ip-range``."""
        return tuple(ipaddress.IPv4Network(c) for c in self.service_cluster_ip_range)

    @field_validator("service_node_port_range")
    @classmethod
    def _node_ports(cls, value: str) -> str:
        first, sep, last = value.partition("-")
        if not sep or not first.strip().isdigit() or not last.strip().isdigit():
            raise ValueError(f"--service-node-port-range: {value!r}: expected FIRST-LAST")
        low, high = int(first), int(last)
        if not 1 <= low <= high <= 65535:
            raise ValueError(
                f"--service-node-port-range: {value!r}: need 1 <= FIRST <= LAST <= 65535"
            )
        return f"{low}-{high}"

    @property
    def node_port_range(self) -> tuple[int, int]:
        """Parsed ``--service-node-port-range`` (first, last), inclusive."""
        first, _, last = self.service_node_port_range.partition("-")
        return int(first), int(last)

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        url = urllib.parse.urlparse(value)
        if value == "kubernetes":
            return value
        if url.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"--store: {value!r}: expected redis://HOST:PORT/DB or kubernetes")
        return value

    @model_validator(mode="after")
    def _leader_election(self) -> Config:
        from .leader import validate_durations

        validate_durations(
            self.leader_election_lease_duration,
            self.leader_election_renew_deadline,
            self.leader_election_retry_period,
        )
        return self

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        if not value.startswith("unix:"):
            split_host_port(value, flag="--listen")
        return value

    @field_validator("grpc_health_listen")
    @classmethod
    def _health_listen(cls, value: str) -> str:
        if value:
            split_host_port(value, flag="--grpc-health-listen")
        return value

    @field_validator("prometheus_serve_addr")
    @classmethod
    def _metrics(cls, value: str) -> str:
        if value:
            split_host_port(value, flag="--prometheus-serve-addr")
        return value

    @field_validator("auto_create_cilium_pod_ip_pools")
    @classmethod
    def _pools(cls, value: list[str]) -> list[str]:
        try:
            parse_auto_create_pools(value)
        except PoolFlagError as exc:
            raise ValueError(str(exc)) from None
        return value

    @field_validator("log_level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"--log-level: {value!r}: use debug, info, warning or error")
        return value.lower()

    @property
    def auto_create_pools(self) -> dict[str, PoolSpec]:
        """Parsed ``--auto-create-cilium-pod-ip-pools`` (validated at construction)."""
        return parse_auto_create_pools(self.auto_create_cilium_pod_ip_pools)
