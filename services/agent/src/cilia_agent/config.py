"""The agent's one validated configuration (flags of ``cilia-agent serve``).

Flag names follow upstream ``cilium-agent`` where one exists
(``--ipam``, ``--ipam-multi-pool-pre-allocation``, ``--prometheus-serve-addr``,
``--cni-log-file``, ``--mtu``, ``--ipam-default-ip-pool``). Every limit and
timeout is a flag; :data:`FLAG_HELP` documents each one and its default.
"""

from __future__ import annotations

import pathlib
import re
import socket
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Path flags of ``cilia-agent serve``: a relative value is made absolute against the working
# directory at start and logged (Config.relative_path_notes).
PATH_FLAGS = (
    "state_dir",
    "socket",
    "cni_conf_dir",
    "cni_log_file",
    "cni_del_queue_dir",
    "bpf_dir",
    "bpf_pin_dir",
    "hubble_socket",
)

_IFNAME = re.compile(r"^[A-Za-z0-9_.\-]{1,15}$")
_POOL = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def parse_pre_allocation(text: str) -> dict[str, int]:
    """Parse ``pool=N[,pool=N...]`` (upstream ``ipam-multi-pool-pre-allocation``).

    An empty string gives ``{}``.

    Raises:
        ValueError: an entry is not ``pool=N`` with a valid pool name and N >= 0.
    """
    out: dict[str, int] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not _POOL.match(name) or not value.strip().isdigit():
            raise ValueError(
                f"ipam-multi-pool-pre-allocation: {item!r} is not 'pool=N' "
                "(pool a DNS-1123 name, N a non-negative integer)"
            )
        out[name] = int(value)
    return out


def parse_bool(text: str) -> bool:
    """Parse ``true|false|1|0|yes|no`` (case-insensitive). Raises ValueError."""
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use true or false)")


FLAG_HELP: dict[str, str] = {
    "node_name": "name of this node as registered with the operator (default: hostname)",
    "operator": "operator gRPC address host:port; empty disables the operator client "
    "(default 127.0.0.1:4250)",
    "state_dir": "directory of endpoint and node state files (default /var/run/cilia/state)",
    "socket": "unix socket of the CNI/debug gRPC API, mode 0600 (default /var/run/cilia/cilia.sock)",
    "state_fsync": "fsync state files and their directory on every write, for state dirs "
    "on persistent disks (default false: the rename alone is crash-atomic)",
    "cni_conf_dir": "directory the CNI conflist is written to once ready (default /etc/cni/net.d)",
    "cni_conf_name": "file name of the CNI conflist (default 05-cilia.conflist)",
    "cni_log_file": "log file the CNI plugin should use; empty = none (default '')",
    "cni_del_queue_dir": "directory of the plugin's DEL queue (DELs queued while the agent "
    "was unreachable), replayed before serving; written into the conflist as del-queue-dir "
    "(default /var/run/cilia/del-queue)",
    "cni_del_queue_replay_interval": "seconds between replays of the DEL queue while serving "
    "(a DEL queued while the agent was starting up is not left until the next restart) "
    "(default 5)",
    "cni_exclusive": "move every other CNI config in --cni-conf-dir aside to <name>.cilia_bak "
    "when the conflist is written (upstream cni-exclusive; default false)",
    "cni_uninstall": "on a clean shutdown remove the conflist and restore the configs "
    "--cni-exclusive moved aside (upstream cni-uninstall; default false: a restarting agent "
    "keeps serving its pods)",
    "mtu": "MTU of pod veth pairs in bytes, 68..65535 (default 1500)",
    "ipam": "IPAM mode, as the operator's: cluster-pool (addresses from the node's podCIDRs, "
    "no demand sent) or multi-pool (per-pod pools via the operator's ResolvePool, demand with "
    "pre-allocation, unneeded CIDRs handed back) (default multi-pool)",
    "ipam_multi_pool_pre_allocation": "pool=N,...: free addresses kept per pool (default default=8)",
    "ipam_default_ip_pool": "pool used when a request names none and the operator announces "
    "none (default default)",
    "ipam_pending_allocation_ttl": "seconds a failed allocation keeps counting in the demand "
    "(default 300, upstream pendingAllocationTTL)",
    "ipam_allocation_wait": "seconds an ADD whose pool has no free address on this node waits "
    "for the operator's allocation before failing with 'retry' (CNI code 11); only with an "
    "operator; a pool the operator reports exhausted fails at once with code 101 (default 5)",
    "host_device_name": "dummy device holding the router IP (default cilia_host)",
    "prometheus_serve_addr": "[host]:port of the metrics endpoint; empty disables (default :9962)",
    "install_iptables_rules": "manage the CILIA_FORWARD chain and FORWARD jump (default true)",
    "iptables_timeout": "seconds one iptables command may take (default 10)",
    "iptables_reconcile_interval": "seconds between checks that CILIA_FORWARD holds its two "
    "rules and FORWARD jumps to it before any DROP/REJECT; what is missing is re-installed "
    "(dockerd restarts and firewall reloads remove them); only with --install-iptables-rules; "
    "0 disables (default 10)",
    "log_level": "debug, info, warning or error (default info)",
    "operator_timeout": "deadline in seconds of each unary call to the operator (default 10)",
    "operator_reconnect_min_backoff": "first reconnect delay in seconds after the operator "
    "stream fails (default 1)",
    "operator_reconnect_max_backoff": "cap of the doubling reconnect delay in seconds (default 30)",
    "datapath_workers": "threads doing netlink/state-file work concurrently (default 4)",
    "shutdown_grace_period": "seconds in-flight RPCs get on SIGTERM (default 5)",
    "enable_bpf": "load the eBPF datapath (identities, policy, Hubble flows); false = pod "
    "plumbing only, for hosts without BPF (default true)",
    "bpf_dir": "directory holding bpf_lxc.c and lib/ (default: $CILIA_BPF_DIR, the "
    "repository's bpf/, else /usr/lib/cilia/bpf)",
    "bpf_pin_dir": "bpffs directory of the pinned maps, alias --bpf-root; bpffs is mounted on "
    "/sys/fs/bpf when it is not (default /sys/fs/bpf/cilia)",
    "bpf_policy_map_max": "policy map entries for all endpoints together (default 65536)",
    "bpf_ct_global_max": "conntrack entries, LRU (default 262144)",
    "bpf_ipcache_map_max": "ipcache entries (default 512000)",
    "bpf_events_ringbuf_pages": "pages of the datapath event ring buffer, a power of two "
    "(default 64)",
    "hubble_event_buffer_capacity": "flows kept by Hubble, 2^n-1 in 1..65535 (default 4095)",
    "hubble_event_queue_size": "datapath events waiting between the ring-buffer thread and "
    "the flow parser; more are counted as lost (default 1000)",
    "hubble_socket": "unix socket of Hubble's Observer and Peer, mode 0600 (default "
    "<directory of --socket>/hubble.sock)",
    "hubble_listen_address": "[host]:port of Hubble's TCP server, announced to the operator as "
    "<first node IP>:<port>; empty disables TCP (default :4244)",
    "enable_policy": "default (enforce a direction once a policy selects the endpoint for "
    "it), always (enforce both directions on every endpoint) or never (default default)",
    "endpoint_policy_wait_timeout": "seconds an Add waits for the identity and policy streams "
    "to sync before answering UNAVAILABLE (default 10)",
}


class Config(BaseModel):
    """Validated agent configuration; see :data:`FLAG_HELP` for each field.

    Raises (on construction):
        pydantic.ValidationError: a field is out of range or malformed; the
            message names the field.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    node_name: str = Field(default_factory=socket.gethostname, min_length=1, max_length=253)
    operator: str = "127.0.0.1:4250"
    state_dir: pathlib.Path = pathlib.Path("/var/run/cilia/state")
    state_fsync: bool = False
    socket: pathlib.Path = pathlib.Path("/var/run/cilia/cilia.sock")
    cni_conf_dir: pathlib.Path = pathlib.Path("/etc/cni/net.d")
    cni_conf_name: str = "05-cilia.conflist"
    cni_log_file: str = ""
    cni_del_queue_dir: pathlib.Path = pathlib.Path("/var/run/cilia/del-queue")
    cni_del_queue_replay_interval: float = Field(default=5.0, gt=0)
    cni_exclusive: bool = False
    cni_uninstall: bool = False
    mtu: int = Field(default=1500, ge=68, le=65535)
    ipam: Literal["cluster-pool", "multi-pool"] = "multi-pool"
    ipam_multi_pool_pre_allocation: dict[str, int] = Field(default_factory=lambda: {"default": 8})
    ipam_default_ip_pool: str = "default"
    ipam_pending_allocation_ttl: float = Field(default=300.0, gt=0)
    ipam_allocation_wait: float = Field(default=5.0, ge=0)
    host_device_name: str = "cilia_host"
    prometheus_serve_addr: str = ":9962"
    install_iptables_rules: bool = True
    iptables_timeout: float = Field(default=10.0, gt=0)
    iptables_reconcile_interval: float = Field(default=10.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    operator_timeout: float = Field(default=10.0, gt=0)
    operator_reconnect_min_backoff: float = Field(default=1.0, gt=0)
    operator_reconnect_max_backoff: float = Field(default=30.0, gt=0)
    datapath_workers: int = Field(default=4, ge=1, le=64)
    shutdown_grace_period: float = Field(default=5.0, ge=0)
    enable_bpf: bool = True
    bpf_dir: pathlib.Path | None = None
    bpf_pin_dir: pathlib.Path = pathlib.Path("/sys/fs/bpf/cilia")
    bpf_policy_map_max: int = Field(default=65536, ge=16, le=1 << 24)
    bpf_ct_global_max: int = Field(default=262144, ge=1024, le=1 << 26)
    bpf_ipcache_map_max: int = Field(default=512000, ge=16, le=1 << 24)
    bpf_events_ringbuf_pages: int = Field(default=64, ge=1, le=1 << 16)
    hubble_event_buffer_capacity: int = 4095
    hubble_event_queue_size: int = Field(default=1000, ge=1, le=1 << 20)
    hubble_socket: pathlib.Path | None = None
    hubble_listen_address: str = ":4244"
    enable_policy: Literal["default", "always", "never"] = "default"
    endpoint_policy_wait_timeout: float = Field(default=10.0, gt=0)

    @field_validator("ipam_multi_pool_pre_allocation", mode="before")
    @classmethod
    def _pre_alloc(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_pre_allocation(value)
        return value

    @field_validator(
        "install_iptables_rules",
        "state_fsync",
        "enable_bpf",
        "cni_exclusive",
        "cni_uninstall",
        mode="before",
    )
    @classmethod
    def _bool(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_bool(value)
        return value

    @field_validator("host_device_name")
    @classmethod
    def _ifname(cls, value: str) -> str:
        if not _IFNAME.match(value):
            raise ValueError(f"{value!r} is not a valid interface name (1-15 of [A-Za-z0-9_.-])")
        return value

    @field_validator("ipam_default_ip_pool")
    @classmethod
    def _pool(cls, value: str) -> str:
        if not _POOL.match(value):
            raise ValueError(f"{value!r} is not a valid pool name")
        return value

    @field_validator("cni_conf_name")
    @classmethod
    def _conf_name(cls, value: str) -> str:
        if "/" in value or not value.endswith(".conflist"):
            raise ValueError(f"{value!r} must be a plain file name ending in .conflist")
        return value

    @field_validator("socket", "state_dir", "cni_conf_dir", "bpf_pin_dir", "cni_del_queue_dir")
    @classmethod
    def _absolute(cls, value: pathlib.Path) -> pathlib.Path:
        return value.absolute()

    @field_validator("bpf_dir", "hubble_socket")
    @classmethod
    def _absolute_opt(cls, value: pathlib.Path | None) -> pathlib.Path | None:
        return value.absolute() if value is not None else None

    @field_validator("cni_log_file")
    @classmethod
    def _absolute_log(cls, value: str) -> str:
        return str(pathlib.Path(value).absolute()) if value else ""

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

    @field_validator("operator")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value and (":" not in value or not value.rsplit(":", 1)[1].isdigit()):
            raise ValueError(f"{value!r} is not host:port")
        return value

    @field_validator("prometheus_serve_addr", "hubble_listen_address")
    @classmethod
    def _listen(cls, value: str) -> str:
        if value:
            port = value.rsplit(":", 1)[-1]
            if ":" not in value or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"{value!r} is not [host]:port")
        return value

    @model_validator(mode="after")
    def _backoff(self) -> Config:
        if self.operator_reconnect_max_backoff < self.operator_reconnect_min_backoff:
            raise ValueError(
                "operator_reconnect_max_backoff must be >= operator_reconnect_min_backoff"
            )
        return self

    def relative_path_notes(self, given: Mapping[str, Any]) -> list[str]:
        """One line per path flag in ``given`` (the raw flag values, by field name) that
        was relative: ``--state-dir: relative path 'state' resolved against the working
        directory to /root/state``. Every path flag (:data:`PATH_FLAGS`) is resolved against
        the agent's working directory at start (as a Go agent's ``os.Open`` would): the
        conflist and the CNI plugin, which run from the kubelet's working directory, need
        absolute paths. The agent logs these lines at start so a relative path is never
        silent.
        """
        notes = []
        for name in PATH_FLAGS:
            raw = given.get(name)
            if raw is None or str(raw) == "" or pathlib.Path(str(raw)).is_absolute():
                continue
            flag = "--" + name.replace("_", "-")
            notes.append(
                f"{flag}: relative path {str(raw)!r} resolved against the working directory "
                f"to {getattr(self, name)}"
            )
        return notes

    def hubble_socket_path(self) -> pathlib.Path:
        """``--hubble-socket``, default ``hubble.sock`` next to ``--socket``."""
        return self.hubble_socket or self.socket.parent / "hubble.sock"

    def hubble_listen(self) -> str | None:
        """gRPC listen address of Hubble's TCP server (``:4244`` → ``0.0.0.0:4244``), or None."""
        if not self.hubble_listen_address:
            return None
        host, _, port = self.hubble_listen_address.rpartition(":")
        return f"{host or '0.0.0.0'}:{port}"

    def hubble_port(self) -> int:
        """Port of ``--hubble-listen-address`` (0 when TCP is disabled)."""
        if not self.hubble_listen_address:
            return 0
        return int(self.hubble_listen_address.rpartition(":")[2])

    def metrics_listen(self) -> tuple[str, int] | None:
        """``(host, port)`` of the metrics endpoint, or None when disabled."""
        if not self.prometheus_serve_addr:
            return None
        host, _, port = self.prometheus_serve_addr.rpartition(":")
        return (host or "0.0.0.0", int(port))
