"""The agent's Hubble and trace-event flags (one group of ``cilia-agent serve``'s
configuration): the datapath event ring buffer, monitor aggregation, Hubble's flow buffer,
servers, TLS and metrics. :class:`cilia_agent.config.Config` inherits them, so every field
is still ``cfg.<name>`` and one ``serve`` flag (upstream names: ``--monitor-aggregation``,
``--hubble-listen-address``, ``--hubble-tls-cert-file``, ``--hubble-metrics``, ...).
"""

from __future__ import annotations

import pathlib
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cilia_common.addresses import TCPAddress
from cilia_common.flags import Flag, require_all_or_none, split_list
from cilia_common.tls import ServerTLS

# TCP flags by name, as bits of byte 13 of the TCP header (--monitor-aggregation-flags).
TCP_FLAG_BITS = {
    "fin": 0x01, "syn": 0x02, "rst": 0x04, "psh": 0x08,
    "ack": 0x10, "urg": 0x20, "ece": 0x40, "cwr": 0x80,
}  # fmt: skip
AGGREGATION_ALL_FLAGS = 0x07  # upstream "all": SYN, FIN, RST
MONITOR_AGGREGATION_LEVELS = {"none": 0, "lowest": 1, "low": 2, "medium": 3, "maximum": 4}


class HubbleConfig(BaseModel):
    """Validated Hubble and trace-event flags (a base of the agent's ``Config``).

    Raises (on construction):
        pydantic.ValidationError: a field is out of range or malformed; the message names
            the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    bpf_events_ringbuf_pages: int = Field(
        default=64,
        ge=1,
        le=1 << 16,
        description="pages of the datapath event ring buffer, a power of two",
    )
    bpf_events_wakeup_events: int = Field(
        default=1024,
        ge=1,
        le=1 << 20,
        description="the datapath wakes Hubble's reader for every N-th event of a CPU, or "
        "when half the ring buffer is unread (1 = every event); the reader also drains the "
        "ring buffer every 100 ms",
    )
    monitor_aggregation: Literal["none", "lowest", "low", "medium", "maximum"] = Field(
        default="medium",
        description="trace events of forwarded packets (upstream --monitor-aggregation): none "
        "= every packet; lowest/low = every packet entering a pod; medium/maximum = a "
        "connection's first packet each way, its --monitor-aggregation-flags and one update "
        "per --monitor-aggregation-interval; drops are always reported",
    )
    monitor_aggregation_interval: float = Field(
        default=5.0,
        gt=0,
        le=3600,
        description="seconds between periodic trace events of an active connection",
    )
    monitor_aggregation_flags: Annotated[list[str], Flag(metavar="FLAGS")] = Field(
        default=["all"],
        description="TCP flags reported the first time a connection shows them in a direction,"
        " comma-separated of syn,fin,rst,psh,ack,urg,ece,cwr; all = syn,fin,rst",
    )
    hubble_event_buffer_capacity: int = Field(
        default=4095, description="flows kept by Hubble, 2^n-1 in 1..65535"
    )
    hubble_event_queue_size: int = Field(
        default=0,
        ge=0,
        le=1 << 20,
        description="datapath events waiting between the ring-buffer thread and the flow parser; more are counted as lost; 0 = 1024 per CPU, at most 16384 (as upstream)",
    )
    hubble_socket: Annotated[
        pathlib.Path | None, Flag(default_text="<directory of --socket>/hubble.sock")
    ] = Field(default=None, description="unix socket of Hubble's Observer and Peer, mode 0600")
    hubble_listen_address: TCPAddress = Field(
        default=":4244",
        description="[host]:port of Hubble's TCP server, announced to the operator as <first node IP>:<port>; empty disables TCP",
    )
    hubble_tls_cert_file: Annotated[str, Flag(metavar="PATH")] = Field(
        default="",
        description="PEM certificate of Hubble's TCP server (named <node>.<cluster>.hubble-"
        "grpc.cilium.io); with --hubble-tls-key-file that server uses TLS and peers are "
        "announced with their TLS names; re-read when the file changes",
    )
    hubble_tls_key_file: Annotated[str, Flag(metavar="PATH")] = Field(
        default="", description="PEM private key of --hubble-tls-cert-file"
    )
    hubble_tls_client_ca_files: Annotated[list[str], Flag(metavar="PATH")] = Field(
        default_factory=list,
        description="PEM CA bundles a client certificate must chain to (mutual TLS: the relay "
        "presents one); repeat or comma-separate; none = clients are not asked for one",
    )
    hubble_disable_tls: bool = Field(
        default=False,
        description="serve Hubble's TCP server in plaintext on purpose (without TLS files "
        "it is plaintext anyway, with a warning; the unix socket is always plaintext, mode "
        "0600)",
    )
    hubble_metrics: Annotated[str, Flag(metavar="HANDLERS")] = Field(
        default="",
        description="Hubble metric handlers to enable, space- or comma-separated, each "
        "name[:key=value;key=value...] (upstream hubble-metrics): flow, drop, tcp, "
        "port-distribution, icmp, flows-to-world; options sourceContext, destinationContext "
        "(identity|namespace|pod|pod-short|pod-name|dns|ip|reserved-identity|workload-name|"
        "app, '|' for fallbacks), labelsContext, and for flows-to-world any-drop, port, "
        "syn-only; e.g. 'drop:sourceContext=pod;destinationContext=pod tcp flow'; empty = "
        "no Hubble metrics (agent README)",
    )
    hubble_metrics_server: Annotated[TCPAddress, Flag(metavar="ADDR")] = Field(
        default=":9965",
        description="[host]:port of the Hubble metrics endpoint (GET /metrics), apart from "
        "--prometheus-serve-addr; served only when --hubble-metrics enables a handler; "
        "empty disables",
    )

    @field_validator("bpf_events_ringbuf_pages")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"{value} is not a power of two")
        return value

    @field_validator("hubble_event_buffer_capacity")
    @classmethod
    def _capacity(cls, value: int) -> int:
        if not 1 <= value <= 65535 or (value + 1) & value:
            raise ValueError(f"{value} is not 2^n-1 in 1..65535 (e.g. 4095)")
        return value

    @field_validator("hubble_tls_client_ca_files")
    @classmethod
    def _hubble_ca_files(cls, value: list[str]) -> list[str]:
        return split_list(value)

    @field_validator("monitor_aggregation_flags")
    @classmethod
    def _aggregation_flags(cls, value: list[str]) -> list[str]:
        flags = [f.lower() for f in split_list(value)]
        unknown = [f for f in flags if f != "all" and f not in TCP_FLAG_BITS]
        if unknown or not flags:
            raise ValueError(
                f"--monitor-aggregation-flags: {unknown or value!r} not in all, "
                + ", ".join(TCP_FLAG_BITS)
            )
        return flags

    def monitor_aggregation_mask(self) -> int:
        """``--monitor-aggregation-flags`` as TCP header byte 13 bits (all = SYN|FIN|RST)."""
        mask = 0
        for name in self.monitor_aggregation_flags:
            mask |= AGGREGATION_ALL_FLAGS if name == "all" else TCP_FLAG_BITS[name]
        return mask

    @model_validator(mode="after")
    def _hubble_tls_files(self) -> HubbleConfig:
        require_all_or_none(
            {
                "--hubble-tls-cert-file": self.hubble_tls_cert_file,
                "--hubble-tls-key-file": self.hubble_tls_key_file,
            }
        )
        if self.hubble_tls_client_ca_files and not self.hubble_tls_cert_file:
            raise ValueError(
                "--hubble-tls-client-ca-files needs --hubble-tls-cert-file and "
                "--hubble-tls-key-file (mutual TLS is TLS first)"
            )
        if self.hubble_disable_tls and self.hubble_tls_cert_file:
            raise ValueError("--hubble-disable-tls contradicts --hubble-tls-cert-file")
        return self

    @property
    def hubble_tls(self) -> ServerTLS | None:
        """The TLS files of Hubble's TCP server, or None for plaintext."""
        if not self.hubble_tls_cert_file:
            return None
        return ServerTLS(
            self.hubble_tls_cert_file,
            self.hubble_tls_key_file,
            tuple(self.hubble_tls_client_ca_files),
        )
