"""``check-kernel``: the kernel's version and the BPF features Cilia's programs use, probed.

Two checks, in this order (upstream's check-linux-kernel init container checks only the
release against a constraint; the agent itself probes features at start):

1. the release (``uname -r`` up to the first ``-``, e.g. ``6.1.0``) against a minimum
   (``--min-kernel-version``; default: the newest version any feature in use needs, see
   :data:`FEATURES` — 5.10 (``bpf_redirect_neigh``), with or without the socket load
   balancer; ``bpf_set_retval`` (5.18) is optional: without it the agent loads
   ``bpf_sock_compat.o``);
2. every feature of :data:`FEATURES` the configuration uses, probed for real: program and
   map types through libbpf's own probes (``libbpf_probe_bpf_prog_type`` /
   ``libbpf_probe_bpf_map_type``: they load a trivial program / create a one-entry map),
   helpers and attach types by loading a three-instruction program through libbpf's
   ``bpf_prog_load`` and reading the verifier's answer.

Helpers and attach types are probed by :func:`cilia_agent.datapath.libbpf.helper_available`
and :func:`~cilia_agent.datapath.libbpf.attach_type_available` (the loader probes its
optional helpers with the same function); why not ``bpftool feature probe`` or
``libbpf_probe_bpf_helper`` is written there.
"""

from __future__ import annotations

import ctypes
import errno
import re
from dataclasses import dataclass
from typing import Literal

from cilia_agent.datapath.libbpf import (
    LibbpfError,
    attach_type_available,
    helper_available,
    libbpf,
)

# enum bpf_prog_type / bpf_map_type / bpf_func_id / bpf_attach_type (include/uapi/linux/bpf.h)
PROG_SCHED_CLS = 3
PROG_CGROUP_SOCK_ADDR = 18
PROG_TYPES = {PROG_SCHED_CLS: "sched_cls", PROG_CGROUP_SOCK_ADDR: "cgroup_sock_addr"}
ATTACH_CGROUP_INET4_CONNECT = 10
ATTACH_CGROUP_INET4_GETPEERNAME = 29

Need = Literal["bpf", "socklb", "optional"]
"""Which part of the agent needs a feature: ``bpf`` the tc datapath (``bpf/bpf_lxc.c``,
off with ``--enable-bpf=false``), ``socklb`` the socket load balancer (``bpf/bpf_sock.c``,
off with ``--bpf-lb-sock=false`` or ``--kube-proxy-replacement=false``), ``optional`` used
when present (the agent probes it and loads a variant without it, so it is neither checked
here nor part of the minimum)."""


@dataclass(frozen=True)
class Feature:
    """One kernel BPF feature the agent's programs use.

    Attributes:
        kind: "program type", "map type", "helper" or "attach type".
        name: upstream's name (``lpm_trie``, ``bpf_ringbuf_output``, ...).
        number: the kernel enum value (map/program type, helper id, attach type).
        prog_type: for helpers and attach types, the program type it is probed in.
        since: the first mainline kernel that has it, ``(major, minor)``.
        used_for: what Cilia uses it for (goes into the message).
        need: which part of the agent needs it.
    """

    kind: str
    name: str
    number: int
    prog_type: int
    since: tuple[int, int]
    used_for: str
    need: Need

    def describe(self) -> str:
        """``map type ringbuf (kernel 5.8+, the datapath's event ring buffer)``."""
        where = ""
        if self.kind in ("helper", "attach type"):
            where = f" in {PROG_TYPES[self.prog_type]} programs"
        since = f"{self.since[0]}.{self.since[1]}"
        return f"{self.kind} {self.name}{where} (kernel {since}+, {self.used_for})"


_TC, _SOCK = PROG_SCHED_CLS, PROG_CGROUP_SOCK_ADDR
FEATURES: tuple[Feature, ...] = (
    Feature("program type", "sched_cls", _TC, 0, (4, 1), "tc programs on pod veths", "bpf"),
    Feature("map type", "hash", 1, 0, (3, 19), "endpoint map", "bpf"),
    Feature("map type", "lpm_trie", 11, 0, (4, 11), "ipcache and policy maps", "bpf"),
    Feature("map type", "lru_hash", 9, 0, (4, 10), "connection tracking", "bpf"),
    Feature("map type", "percpu_hash", 5, 0, (4, 6), "datapath metrics", "bpf"),
    Feature("map type", "ringbuf", 27, 0, (5, 8), "flow events for Hubble", "bpf"),
    Feature("helper", "bpf_map_lookup_elem", 1, _TC, (4, 1), "map lookups", "bpf"),
    Feature("helper", "bpf_map_update_elem", 2, _TC, (4, 1), "conntrack entries", "bpf"),
    Feature("helper", "bpf_map_delete_elem", 3, _TC, (4, 1), "conntrack entries", "bpf"),
    Feature("helper", "bpf_ktime_get_ns", 5, _TC, (4, 1), "event timestamps", "bpf"),
    Feature("map type", "percpu_array", 6, 0, (4, 6), "datapath counters", "bpf"),
    Feature("helper", "bpf_skb_store_bytes", 9, _TC, (4, 1), "address rewrites (NAT)", "bpf"),
    Feature("helper", "bpf_l3_csum_replace", 10, _TC, (4, 1), "IP checksum fixes", "bpf"),
    Feature("helper", "bpf_l4_csum_replace", 11, _TC, (4, 1), "TCP/UDP checksum fixes", "bpf"),
    Feature("helper", "bpf_redirect", 23, _TC, (4, 4), "delivery to a pod's veth", "bpf"),
    Feature("helper", "bpf_skb_load_bytes", 26, _TC, (4, 5), "NodePort header reads", "bpf"),
    Feature("helper", "bpf_fib_lookup", 69, _TC, (4, 18), "next hop of forwarded packets", "bpf"),
    Feature(
        "helper", "bpf_redirect_neigh", 152, _TC, (5, 10), "forwarding with the neighbour", "bpf"
    ),
    Feature("helper", "bpf_ringbuf_output", 130, _TC, (5, 8), "flow events", "bpf"),
    Feature("helper", "bpf_ringbuf_query", 134, _TC, (5, 8), "event wakeups", "bpf"),
    Feature(
        "program type", "cgroup_sock_addr", _SOCK, 0, (4, 17), "socket-LB connect hooks", "socklb"
    ),
    Feature(
        "attach type",
        "cgroup/getpeername4",
        ATTACH_CGROUP_INET4_GETPEERNAME,
        _SOCK,
        (5, 8),
        "socket-LB getpeername hooks",
        "socklb",
    ),
    Feature("map type", "hash", 1, 0, (3, 19), "Service and backend maps", "socklb"),
    Feature("map type", "lru_hash", 9, 0, (4, 10), "socket reverse-NAT and affinity", "socklb"),
    Feature("helper", "bpf_map_lookup_elem", 1, _SOCK, (4, 17), "Service lookups", "socklb"),
    Feature("helper", "bpf_map_update_elem", 2, _SOCK, (4, 17), "reverse-NAT entries", "socklb"),
    Feature("helper", "bpf_ktime_get_ns", 5, _SOCK, (4, 17), "session affinity", "socklb"),
    Feature("helper", "bpf_get_prandom_u32", 7, _SOCK, (4, 17), "backend choice", "socklb"),
    Feature("helper", "bpf_get_socket_cookie", 46, _SOCK, (4, 19), "reverse-NAT keys", "socklb"),
    Feature("helper", "bpf_get_netns_cookie", 122, _SOCK, (5, 7), "session affinity", "socklb"),
    Feature(
        "helper",
        "bpf_set_retval",
        187,
        _SOCK,
        (5, 18),
        "refusing a Service without backends with ECONNREFUSED (without it: EPERM, "
        "bpf_sock_compat.o)",
        "optional",
    ),
)
"""Every kernel feature ``bpf/bpf_lxc.c``, ``bpf/bpf_host.c`` and ``bpf/bpf_sock.c`` use (first
kernel from the
kernel's git history, as bcc's "BPF Features by Linux Kernel Version" lists them). BPF links
on cgroups (``BPF_LINK_CREATE``/``UPDATE``, 5.7) come with getpeername4 (5.8)."""


class KernelTooOld(Exception):
    """The running kernel misses something (the message names it and what to do)."""


def parse_version(text: str) -> tuple[int, ...]:
    """``"6.1.0-18-amd64"`` → ``(6, 1, 0)``: the dotted numbers before the first ``-``
    (as upstream's check-kernel-version reads ``uname -r``); a missing part is 0.

    Raises:
        ValueError: ``text`` does not start with ``<major>.<minor>``.
    """
    head = text.strip().split("-", 1)[0]
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?", head)
    if not m:
        raise ValueError(f"{text!r} is not a kernel version (<major>.<minor>[.<patch>])")
    return tuple(int(p or 0) for p in m.groups())


def required_version(needs: set[str]) -> tuple[int, int]:
    """The newest ``since`` among the features of ``needs`` ((0, 0) when none)."""
    return max((f.since for f in FEATURES if f.need in needs), default=(0, 0))


def check_version(release: str, minimum: str, needs: set[str]) -> str:
    """Compare ``release`` (``uname -r``) with ``minimum`` (dotted; "" = :func:`required_version`).

    Returns:
        one line for the log, e.g. ``kernel 6.18.44 >= 5.18``.

    Raises:
        KernelTooOld: the kernel is older; the message names the features that need more
            and what to do.
        ValueError: ``release`` or ``minimum`` is not a version.
    """
    have = parse_version(release)
    want = parse_version(minimum) if minimum else required_version(needs)
    want_text = ".".join(str(p) for p in want)
    have_text = ".".join(str(p) for p in have)
    if have >= tuple(want):
        return f"kernel {have_text} >= {want_text}"
    newer = [f for f in FEATURES if f.need in needs and f.since > have[:2]]
    if not newer:
        raise KernelTooOld(
            f"kernel {have_text} is older than {want_text} (--min-kernel-version); boot a "
            f"kernel >= {want_text} or lower --min-kernel-version"
        )
    why = "; ".join(f.describe() for f in newer[:3])
    more = f" and {len(newer) - 3} more" if len(newer) > 3 else ""
    raise KernelTooOld(
        f"kernel {have_text} is older than {want_text} (needed by {why}{more}); boot a kernel "
        f">= {want_text} or turn off what needs it (--bpf-lb-sock=false, --enable-bpf=false)"
    )


# --- probes ---------------------------------------------------------------------------


def _attach_for(prog_type: int) -> int:
    # cgroup_sock_addr programs need an expected attach type; connect4 allows every helper
    # the socket-LB calls (bpf_set_retval is refused for getpeername/recvmsg hooks)
    return ATTACH_CGROUP_INET4_CONNECT if prog_type == PROG_CGROUP_SOCK_ADDR else 0


def probe(feature: Feature) -> bool:
    """True when the running kernel has ``feature`` (needs CAP_BPF/root).

    Raises:
        LibbpfError: libbpf is missing, or the probe itself failed (EPERM: not root).
    """
    lib = libbpf()
    if feature.kind in ("program type", "map type"):
        fn = (
            lib.libbpf_probe_bpf_prog_type
            if feature.kind == "program type"
            else lib.libbpf_probe_bpf_map_type
        )
        fn.argtypes = [ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        rc = int(fn(feature.number, None))
        if rc < 0 and -rc not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise LibbpfError(f"cannot probe {feature.kind} {feature.name}", -rc)
        return rc == 1
    if feature.kind == "attach type":
        return attach_type_available(feature.prog_type, feature.number)
    return helper_available(feature.prog_type, feature.number, _attach_for(feature.prog_type))


def missing_features(needs: set[str]) -> list[Feature]:
    """The features of ``needs`` this kernel lacks, in :data:`FEATURES` order (each probed once).

    Raises:
        LibbpfError: libbpf missing or not allowed to probe (not root).
    """
    seen: dict[tuple[str, int, int], bool] = {}
    missing = []
    for f in FEATURES:
        if f.need not in needs:
            continue
        key = (f.kind, f.number, f.prog_type)
        if key not in seen:
            seen[key] = probe(f)
        if not seen[key]:
            missing.append(f)
    return missing


def check_features(needs: set[str]) -> str:
    """Probe every feature of ``needs``; returns a log line (``22 BPF features present``).

    Raises:
        KernelTooOld: one or more are missing (each named with its kernel and use).
        LibbpfError: the probes cannot run (libbpf missing, not root).
    """
    missing = missing_features(needs)
    if missing:
        names = "; ".join(f.describe() for f in missing)
        raise KernelTooOld(
            f"the kernel lacks BPF features Cilia uses: {names}; boot a newer kernel or turn "
            f"off what needs them (--bpf-lb-sock=false, --enable-bpf=false)"
        )
    count = len({(f.kind, f.number, f.prog_type) for f in FEATURES if f.need in needs})
    return f"{count} BPF features present"
