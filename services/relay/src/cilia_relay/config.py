"""The relay's one validated configuration (flags of ``cilia-relay serve``).

Flag names and defaults follow upstream ``hubble-relay serve`` where one exists
(``--peer-service``, ``--listen-address``, ``--health-listen-address``,
``--sort-buffer-len-max``, ``--sort-buffer-drain-timeout``, ``--dial-timeout``,
``--retry-timeout``, ``--prometheus-serve-addr``; reference: cilium-upstream.md §6).
Durations are Go-style strings (``1s``, ``500ms``, ``1m30s``) as upstream.
Every limit and timeout is a flag; :data:`FLAG_HELP` documents each one and its default.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cilia_common import durations


def parse_duration(text: str) -> float:
    """A Go duration (``"1s"``, ``"250ms"``, ``"1m30s"``, ``"0"``) in seconds, as upstream
    hubble-relay's flags take it: a unit is required except for ``0``
    (:func:`cilia_common.durations.parse_duration` with ``bare_seconds=False``).

    Raises:
        ValueError: not a non-negative Go duration.
    """
    return durations.parse_duration(text, bare_seconds=False)


FLAG_HELP: dict[str, str] = {
    "peer_service": "address of the agent's peer.Peer service, host:port or unix:/path "
    "(default unix:/var/run/cilia/hubble.sock)",
    "listen_address": "address the observer.Observer API listens on, host:port, :port "
    "(all interfaces) or unix:/path (default :4245)",
    "health_listen_address": "address of the gRPC health server (default :4222)",
    "sort_buffer_len_max": "maximum number of flows held in the time-ordering buffer of "
    "GetFlows, >= 1 (default 100)",
    "sort_buffer_drain_timeout": "after this long without a flow, buffered flows older than "
    "now minus this are sent (default 1s)",
    "dial_timeout": "how long to wait for a connection to a peer (and for each per-peer "
    "ServerStatus call) (default 5s)",
    "retry_timeout": "time after which a failed peer connection or a lost Peer-service "
    "stream is retried (default 30s)",
    "peer_update_interval": "how often a follow GetFlows re-lists peers to pick up new or "
    "recovered agents (default 2s)",
    "error_aggregation_window": "NODE_ERROR events with identical messages within this "
    "window are merged into one (default 10s)",
    "prometheus_serve_addr": "[host]:port of the metrics endpoint; empty disables (default '')",
    "shutdown_grace_period": "time in-flight RPCs get on SIGTERM (default 5s)",
    "log_level": "debug, info, warning or error (default info)",
}

DURATION_FIELDS = (
    "sort_buffer_drain_timeout",
    "dial_timeout",
    "retry_timeout",
    "peer_update_interval",
    "error_aggregation_window",
    "shutdown_grace_period",
)


def _is_address(value: str) -> bool:
    if value.startswith("unix:"):
        return len(value) > len("unix:")
    host, sep, port = value.rpartition(":")
    del host
    return bool(sep) and port.isdigit() and int(port) <= 65535


class Config(BaseModel):
    """Validated relay configuration; see :data:`FLAG_HELP` for each field.

    Durations are seconds (floats); string values are parsed with :func:`parse_duration`.

    Raises (on construction):
        pydantic.ValidationError: a field is out of range or malformed; the
            message names the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    peer_service: str = "unix:/var/run/cilia/hubble.sock"
    listen_address: str = ":4245"
    health_listen_address: str = ":4222"
    sort_buffer_len_max: int = Field(default=100, ge=1, le=1_000_000)
    sort_buffer_drain_timeout: float = Field(default=1.0, gt=0)
    dial_timeout: float = Field(default=5.0, gt=0)
    retry_timeout: float = Field(default=30.0, gt=0)
    peer_update_interval: float = Field(default=2.0, gt=0)
    error_aggregation_window: float = Field(default=10.0, ge=0)
    prometheus_serve_addr: str = ""
    shutdown_grace_period: float = Field(default=5.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator(*DURATION_FIELDS, mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_duration(value)
        return value

    @field_validator("peer_service", "listen_address", "health_listen_address")
    @classmethod
    def _address(cls, value: str) -> str:
        if not _is_address(value):
            raise ValueError(f"{value!r} is not host:port, :port or unix:/path")
        return value

    @field_validator("prometheus_serve_addr")
    @classmethod
    def _metrics(cls, value: str) -> str:
        if value and (value.startswith("unix:") or not _is_address(value)):
            raise ValueError(f"{value!r} is not [host]:port")
        return value


def grpc_address(address: str) -> str:
    """Translate a Go-style ``:PORT`` (all interfaces) into gRPC's ``[::]:PORT``.

    Other forms (``host:port``, ``unix:/path``) are returned unchanged.
    """
    return f"[::]{address}" if address.startswith(":") else address


def dial_target(address: str) -> str:
    """Turn a peer or server address into a gRPC dial target.

    ``:PORT`` becomes ``localhost:PORT``; ``host:port`` and ``unix:/path`` are unchanged.
    """
    return f"localhost{address}" if address.startswith(":") else address
