"""The operator's validated configuration (one field per ``serve`` flag)."""

from __future__ import annotations

import urllib.parse

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .ipam.flags import PoolFlagError, parse_auto_create_pools
from .ipam.pool import PoolSpec


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

    @field_validator("store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        url = urllib.parse.urlparse(value)
        if url.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"--store: {value!r}: expected redis://HOST:PORT/DB")
        return value

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
