"""The UI's one validated configuration (flags of ``cilia-hubble-ui serve``).

Upstream's hubble-ui backend takes its settings from environment variables
(``FLOWS_API_ADDR``, ``TLS_TO_RELAY_ENABLED``, ``TLS_RELAY_SERVER_NAME``,
``TLS_RELAY_CA_CERT_FILES``, ``TLS_RELAY_CLIENT_CERT_FILE``, ``TLS_RELAY_CLIENT_KEY_FILE``)
and serves on 8081; Cilia writes them as flags with the same meaning
(``--hubble-relay-address``, ``--tls-relay-*``, ``--disable-tls``), generated from
:class:`Config` like every Cilia service's flags. TLS to the relay is used when CA files are
given and ``--disable-tls`` is not; the relay's certificate is checked against
``--tls-relay-server-name`` (upstream's relay certificates are ``*.hubble-relay.cilium.io``).

Every limit is a flag with a documented default: flows kept per open page
(``--flows-buffer``), open pages (``--max-clients``), how often a page is updated
(``--update-interval``), rows of the flow table (``--table-rows``), the relay's dial and
retry timeouts, the deadline of a one-off snapshot (``--snapshot-timeout``) and the grace
period at stop (``--shutdown-grace-period``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cilia_common.addresses import Address, TCPAddress
from cilia_common.flags import Flag, GoDuration, split_list
from cilia_common.tls import ClientTLS

DEFAULT_LISTEN_ADDRESS = ":8081"
"""Upstream hubble-ui's container port (its Service maps port 80 to it)."""
RELAY_SERVER_NAME = "ui.hubble-relay.cilium.io"
"""Upstream hubble-ui's default ``TLS_RELAY_SERVER_NAME`` (matches ``*.hubble-relay.cilium.io``)."""


class Config(BaseModel):
    """Validated UI configuration; each field's description, default and range are its
    flag's help, default and range (:func:`cilia_common.flags.add_model_flags`).

    Durations are seconds (floats) given as Go durations (``1s``, ``500ms``).

    Raises (on construction):
        pydantic.ValidationError: a field is out of range or malformed, or the TLS flags
            contradict each other; the message names the flags.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hubble_relay_address: Address = Field(
        default="localhost:4245",
        description="address of the relay's observer.Observer API, host:port or unix:/path",
    )
    listen_address: TCPAddress = Field(
        default=DEFAULT_LISTEN_ADDRESS,
        description="[host]:port the web page and its API are served on (port 0: any free "
        "port, announced in the 'listening' log line)",
    )
    flows_buffer: int = Field(
        default=2000,
        ge=1,
        le=100_000,
        description="flows kept per open page (the graph and table are drawn from the last "
        "this many flows; also how many past flows are asked of the relay when a page opens)",
    )
    max_clients: int = Field(
        default=20,
        ge=1,
        le=1000,
        description="pages followed at once (each holds one GetFlows stream to the relay); "
        "more are answered 503",
    )
    max_request_line_bytes: int = Field(
        default=8190,
        ge=1024,
        le=1_048_576,
        description="longest request line (method, path and query string) read; a longer one "
        "is answered 414 URI Too Long (aiohttp's default limit)",
    )
    update_interval: GoDuration = Field(
        default=1.0,
        ge=0.05,
        le=60,
        description="how often an open page gets the new graph and table (only when flows came)",
    )
    table_rows: int = Field(
        default=100, ge=1, le=10_000, description="newest flows sent for the flow table"
    )
    dial_timeout: GoDuration = Field(
        default=5.0, gt=0, description="how long to wait for the connection to the relay"
    )
    retry_timeout: GoDuration = Field(
        default=2.0,
        gt=0,
        description="after a lost or refused relay stream, reopen it after this long",
    )
    snapshot_timeout: GoDuration = Field(
        default=10.0,
        gt=0,
        description="deadline of the one-off GetFlows behind /api/graph",
    )
    shutdown_grace_period: GoDuration = Field(
        default=5.0, ge=0, description="time requests in flight get on SIGTERM"
    )
    tls_relay_ca_cert_files: Annotated[list[str], Flag(metavar="PATH")] = Field(
        default_factory=list,
        description="PEM CA bundles the relay's certificate must chain to; given, the relay "
        "is dialled with TLS; repeat or comma-separate",
    )
    tls_relay_client_cert_file: Annotated[str, Flag(metavar="PATH")] = Field(
        default="", description="PEM client certificate presented to the relay (mutual TLS)"
    )
    tls_relay_client_key_file: Annotated[str, Flag(metavar="PATH")] = Field(
        default="", description="PEM private key of --tls-relay-client-cert-file"
    )
    tls_relay_server_name: str = Field(
        default=RELAY_SERVER_NAME,
        description="name the relay's certificate must carry",
    )
    disable_tls: bool = Field(default=False, description="dial the relay in plaintext on purpose")
    prometheus_serve_addr: TCPAddress = Field(
        default="", description="[host]:port of the metrics endpoint; empty disables"
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="log level"
    )

    @field_validator("tls_relay_ca_cert_files")
    @classmethod
    def _ca_files(cls, value: list[str]) -> list[str]:
        return split_list(value)

    @model_validator(mode="after")
    def _tls(self) -> Config:
        if bool(self.tls_relay_client_cert_file) != bool(self.tls_relay_client_key_file):
            raise ValueError(
                "--tls-relay-client-cert-file and --tls-relay-client-key-file: give both or none"
            )
        if self.tls_relay_client_cert_file and not self.tls_relay_ca_cert_files:
            raise ValueError("--tls-relay-client-cert-file needs --tls-relay-ca-cert-files")
        if self.disable_tls and self.tls_relay_ca_cert_files:
            raise ValueError("--disable-tls contradicts --tls-relay-ca-cert-files")
        return self

    @property
    def relay_tls(self) -> ClientTLS | None:
        """How the relay is dialled; None: plaintext."""
        if self.disable_tls or not self.tls_relay_ca_cert_files:
            return None
        return ClientTLS(
            tuple(self.tls_relay_ca_cert_files),
            self.tls_relay_client_cert_file,
            self.tls_relay_client_key_file,
            self.tls_relay_server_name,
        )
