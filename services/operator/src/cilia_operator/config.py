"""The operator's validated configuration (one field per ``serve`` flag)."""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from .ipam.flags import PoolFlagError, parse_auto_create_pools
from .ipam.pool import PoolSpec, no_pod_address


class ConfigError(ValueError):
    """A flag value is invalid; the message names the flag."""


def split_host_port(value: str, flag: str) -> tuple[str, int]:
    """``"127.0.0.1:4250"`` / ``":9963"`` -> ``(host, port)``; host "" means all addresses.

    Raises:
        ConfigError: not ``[HOST]:PORT`` with PORT in 0..65535.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{flag}: {value!r} is not [HOST]:PORT")
    return host.strip("[]"), int(port)


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: str) -> float:
    """A Go-style duration (``15m``, ``1h30m``, ``500ms``, ``0``) or plain seconds
    (``2.5``) in seconds, as upstream's duration flags take them.

    Raises:
        ValueError: not a non-negative duration.
    """
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        if pos != len(text) or not text:
            raise ValueError(f"{value!r} is not a duration (e.g. 15m, 30s, 500ms, 1h30m)") from None
    if seconds < 0:
        raise ValueError(f"{value!r} is negative")
    return seconds


class Config(BaseModel):
    """``cilia-operator serve`` settings; defaults are the documented flag defaults."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    store: str = "redis://127.0.0.1:6379/0"
    listen: str = "127.0.0.1:4250"
    prometheus_serve_addr: str = ":9963"
    auto_create_cilium_pod_ip_pools: list[str] = Field(default_factory=list)
    ipam_default_ip_pool: str = "default"
    log_level: str = "info"
    store_key_prefix: str = "cilia/"
    store_event_history: int = Field(default=10000, ge=1)
    store_watch_block_timeout: float = Field(default=5.0, gt=0)
    store_watch_batch_size: int = Field(default=500, ge=1)
    store_connect_timeout: float = Field(default=5.0, gt=0)
    store_request_timeout: float = Field(default=10.0, gt=0)
    store_retry_interval: float = Field(default=1.0, gt=0)
    store_conflict_retries: int = Field(default=5, ge=1)
    shutdown_grace_period: float = Field(default=5.0, ge=0)
    identity_gc_interval: float = Field(default=900.0, ge=0)
    identity_heartbeat_timeout: float = Field(default=1800.0, ge=0)
    identity_gc_rate_interval: float = Field(default=60.0, gt=0)
    identity_gc_rate_limit: int = Field(default=2500, ge=1)
    identity_max_id: int = Field(default=65535, ge=256, le=65535)
    watch_list_chunk_size: int = Field(default=1000, ge=1)
    watch_buffer_size: int = Field(default=1000, ge=1)
    ipam: Literal["cluster-pool", "multi-pool"] = "multi-pool"
    cluster_pool_ipv4_cidr: list[str] = Field(default_factory=list)
    cluster_pool_ipv4_mask_size: int = Field(default=24, ge=1, le=32)
    enable_cluster_pool_to_multi_pool_migration: bool = False
    service_cluster_ip_range: list[str] = Field(default_factory=lambda: ["10.96.0.0/12"])
    kubeconfig: str = ""
    store_watch_timeout: int = Field(default=300, ge=1)
    enable_leader_election: bool = False
    leader_election_lease_duration: float = Field(default=15.0, gt=0)
    leader_election_renew_deadline: float = Field(default=10.0, gt=0)
    leader_election_retry_period: float = Field(default=2.0, gt=0)
    leader_election_lease_name: str = "cilia-operator-resource-lock"
    leader_election_lease_namespace: str = "kube-system"
    leader_election_id: str = ""
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
    grpc_max_receive_message_bytes: int = Field(
        default=128 * 1024 * 1024, ge=4 * 1024 * 1024,
        description="largest gRPC message the server takes in (above "
        "--apply-max-manifest-bytes, so an oversized manifest gets apply's INVALID_ARGUMENT "
        "naming that flag, not a transport error)",
    )  # fmt: skip

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
                if net.overlaps(svc):
                    raise ValueError(
                        f"--cluster-pool-ipv4-cidr: {net} overlaps --service-cluster-ip-range {svc}"
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
            split_host_port(value, "--listen")
        return value

    @field_validator("prometheus_serve_addr")
    @classmethod
    def _metrics(cls, value: str) -> str:
        if value:
            split_host_port(value, "--prometheus-serve-addr")
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
