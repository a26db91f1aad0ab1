"""Load the endpoint datapath (``bpf/bpf_lxc.c``) with bcc and attach it with tc.

The C source is compiled once per configuration when the agent starts —
never per endpoint (DESIGN.md §4). Maps are pinned under ``pin_dir`` so
they, and the tc filters holding the programs, outlive the agent: on restart
the new programs replace the old ones with ``replace-filter`` on every
endpoint while traffic flows (measured here: 0 of 60 pings lost,
environment-notes.md).

Attachment per endpoint, on its host-side veth (``lxc…``), as tc ``clsact``
direct-action filters:

* ingress hook (parent ``ffff:fff2``): ``cil_from_container`` — pod egress;
* egress hook (parent ``ffff:fff3``): ``cil_to_container`` — pod ingress.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cilia_agent.datapath.errors import BpfUnavailable
from cilia_agent.datapath.layout import (
    EndpointInfo,
    IpcacheKey,
    IpcacheValue,
    ip_to_map,
)

log = logging.getLogger(__name__)

PARENT_INGRESS = "ffff:fff2"
PARENT_EGRESS = "ffff:fff3"
PROG_FROM_CONTAINER = "cil_from_container"
PROG_TO_CONTAINER = "cil_to_container"
_ENOENT = 2
_EEXIST = 17
_EINVAL = 22


def bcc_cflags(bpf_dir: pathlib.Path, pin_dir: pathlib.Path, **defines: object) -> list[str]:
    """bcc compiler flags of one of ``bpf/``'s programs: ``-I<bpf_dir>`` (for ``lib/``),
    ``-DCILIA_PIN_DIR="<pin_dir>"``, one ``-DNAME=value`` per keyword (in order) and ``-w``."""
    return [
        f"-I{bpf_dir}",
        f'-DCILIA_PIN_DIR="{pin_dir}"',
        *(f"-D{name}={value}" for name, value in defines.items()),
        "-w",
    ]


def default_bpf_dir() -> pathlib.Path:
    """Where the C sources are: ``$CILIA_BPF_DIR``, the repository's ``bpf/``, or ``/usr/lib/cilia/bpf``."""
    env = os.environ.get("CILIA_BPF_DIR")
    if env:
        return pathlib.Path(env)
    repo = pathlib.Path(__file__).resolve().parents[5] / "bpf"
    if (repo / "bpf_lxc.c").is_file():
        return repo
    return pathlib.Path("/usr/lib/cilia/bpf")


@dataclass(frozen=True)
class DatapathConfig:
    """Build-time options of the datapath (each maps to a ``-D`` of ``bpf/lib/common.h``).

    Attributes:
        bpf_dir: directory holding ``bpf_lxc.c`` and ``lib/``.
        pin_dir: bpffs directory for pinned maps (upstream: ``/sys/fs/bpf/tc/globals``).
        ipcache_max: ipcache entries (``--bpf-ipcache-map-max``, default 512000 as upstream).
        policy_max: policy entries for all endpoints (``--bpf-policy-map-max``, default 65536).
        ct_max: conntrack entries, LRU (``--bpf-ct-global-max``, default 262144).
        endpoints_max: local endpoints (default 65535).
        events_pages: ring buffer pages, a power of two (``--bpf-events-ringbuf-pages``, 64).
        events_wakeup_events: the reader is woken for every N-th event of a CPU only
            (1 = every event, as the packet tests read; the agent passes
            ``--bpf-events-wakeup-events`` and drains the buffer on a timer as well).
        monitor_aggregation: 0 none, 1 lowest, 2 low, 3 medium, 4 maximum
            (``--monitor-aggregation``, upstream default medium; see bpf/lib/common.h).
        monitor_aggregation_interval_ns: periodic update of an active connection
            (``--monitor-aggregation-interval``, 5 s).
        monitor_aggregation_flags: TCP flag bits (byte 13) reported when first seen in a
            direction (``--monitor-aggregation-flags``, default SYN|FIN|RST = 0x07).
    """

    bpf_dir: pathlib.Path
    pin_dir: pathlib.Path = pathlib.Path("/sys/fs/bpf/cilia")
    ipcache_max: int = 512000
    policy_max: int = 65536
    ct_max: int = 262144
    endpoints_max: int = 65535
    events_pages: int = 64
    events_wakeup_events: int = 1
    monitor_aggregation: int = 3
    monitor_aggregation_interval_ns: int = 5_000_000_000
    monitor_aggregation_flags: int = 0x07

    def cflags(self) -> list[str]:
        """Compiler flags for bcc, one ``-D`` per option."""
        return bcc_cflags(
            self.bpf_dir,
            self.pin_dir,
            CILIA_IPCACHE_MAX=self.ipcache_max,
            CILIA_POLICY_MAX=self.policy_max,
            CILIA_CT_MAX=self.ct_max,
            CILIA_ENDPOINTS_MAX=self.endpoints_max,
            CILIA_EVENTS_PAGES=self.events_pages,
            CILIA_EVENTS_WAKEUP_EVENTS=self.events_wakeup_events,
            CILIA_MONITOR_AGGREGATION=self.monitor_aggregation,
            CILIA_MONITOR_AGGREGATION_INTERVAL_NS=f"{self.monitor_aggregation_interval_ns}ULL",
            CILIA_MONITOR_AGGREGATION_FLAGS=f"{self.monitor_aggregation_flags:#x}",
        )


class Datapath:
    """The compiled programs and handles on their pinned maps.

    Create with :meth:`load`. Methods raise :class:`pyroute2.netlink.exceptions.NetlinkError`
    only for unexpected kernel errors; missing devices on detach are ignored.
    """

    def __init__(self, config: DatapathConfig, bpf: Any, fds: dict[str, int]) -> None:
        self.config = config
        self.bpf = bpf
        self._fds = fds

    @classmethod
    def load(cls, config: DatapathConfig) -> Datapath:
        """Compile ``bpf_lxc.c`` once and load both programs.

        Raises:
            BpfUnavailable: bcc missing, bpffs not mounted, or compilation/verification failed.
        """
        try:
            from bcc import BPF
        except ImportError as exc:
            raise BpfUnavailable(
                "bcc is not importable: install Debian's python3-bpfcc (scripts/setup.sh links it "
                "into the venv)"
            ) from exc
        if not (config.bpf_dir / "bpf_lxc.c").is_file():
            raise BpfUnavailable(f"no bpf_lxc.c in {config.bpf_dir}: set --bpf-dir")
        try:
            config.pin_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BpfUnavailable(
                f"cannot create {config.pin_dir}: is bpffs mounted? ({exc})"
            ) from exc
        try:
            bpf = BPF(src_file=str(config.bpf_dir / "bpf_lxc.c").encode(), cflags=config.cflags())
            fds = {
                name: bpf.load_func(name.encode(), BPF.SCHED_CLS).fd
                for name in (PROG_FROM_CONTAINER, PROG_TO_CONTAINER)
            }
        except Exception as exc:  # bcc raises bare Exception on compile/verify errors
            raise BpfUnavailable(f"cannot load {config.bpf_dir / 'bpf_lxc.c'}: {exc}") from exc
        log.info("datapath loaded", extra={"pin_dir": str(config.pin_dir)})
        return cls(config, bpf, fds)

    def prog_fd(self, name: str) -> int:
        """File descriptor of a loaded program (``cil_from_container`` / ``cil_to_container``),
        e.g. for ``BPF_PROG_TEST_RUN``.

        Raises:
            KeyError: no such program.
        """
        return self._fds[name]

    # ----- tc attachment -------------------------------------------------------------------

    def attach(self, ifindex: int) -> None:
        """Attach both programs to the host veth ``ifindex`` (idempotent; replaces older programs)."""
        with IPRoute() as ipr:
            try:
                ipr.tc("add", "clsact", ifindex)
            except NetlinkError as exc:
                if exc.code != _EEXIST:
                    raise
            for parent, prog in (
                (PARENT_INGRESS, PROG_FROM_CONTAINER),
                (PARENT_EGRESS, PROG_TO_CONTAINER),
            ):
                ipr.tc(
                    "replace-filter",
                    "bpf",
                    ifindex,
                    ":1",
                    fd=self._fds[prog],
                    name=prog,
                    parent=parent,
                    classid=1,
                    direct_action=True,
                )

    def detach(self, ifindex: int) -> None:
        """Remove the clsact qdisc (and with it both filters); a missing device is not an error."""
        with IPRoute() as ipr:
            try:
                ipr.tc("del", "clsact", ifindex)
            except NetlinkError as exc:
                if exc.code not in (_ENOENT, _EINVAL, 19):
                    raise

    # ----- maps ----------------------------------------------------------------------------

    def table(self, name: str) -> Any:
        """The bcc table ``name`` (``cilia_ipcache``, ``cilia_endpoints``, ``cilia_policy``...)."""
        return self.bpf[name.encode()]

    def set_endpoint(self, ifindex: int, info: EndpointInfo) -> None:
        """Register (or update) the endpoint behind host veth ``ifindex``."""
        table = self.table("cilia_endpoints")
        table[table.Key(ifindex)] = info

    def delete_endpoint(self, ifindex: int) -> None:
        """Forget the endpoint behind ``ifindex`` (absent is fine)."""
        table = self.table("cilia_endpoints")
        with contextlib.suppress(KeyError):
            del table[table.Key(ifindex)]

    def endpoints(self) -> dict[int, EndpointInfo]:
        """Current endpoint map: ifindex → info."""
        return {int(k.value): v for k, v in self.table("cilia_endpoints").items()}

    def upsert_ipcache(
        self, cidr_ip: str, prefixlen: int, identity: int, node_ip: str = ""
    ) -> None:
        """Map ``cidr_ip/prefixlen`` to ``identity`` in the ipcache."""
        self.table("cilia_ipcache")[IpcacheKey(prefixlen, ip_to_map(cidr_ip))] = IpcacheValue(
            identity, ip_to_map(node_ip) if node_ip else 0
        )

    def delete_ipcache(self, cidr_ip: str, prefixlen: int) -> None:
        """Remove an ipcache entry (absent is fine)."""
        with contextlib.suppress(KeyError):
            del self.table("cilia_ipcache")[IpcacheKey(prefixlen, ip_to_map(cidr_ip))]

    def close(self) -> None:
        """Release the programs' file descriptors held by this process.

        Attached filters and pinned maps stay in the kernel (pods keep their
        enforcement while the agent is down).
        """
        self.bpf.cleanup()


def remove_pins(pin_dir: pathlib.Path) -> None:
    """Delete every pinned map under ``pin_dir`` (state clean; only when no endpoint uses them)."""
    if not pin_dir.is_dir():
        return
    for pinned in pin_dir.iterdir():
        pinned.unlink()
    pin_dir.rmdir()
