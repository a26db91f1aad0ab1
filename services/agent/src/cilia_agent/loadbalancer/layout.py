"""ctypes mirrors of the load-balancer maps in ``bpf/lib/lb.h`` (upstream's IPv4 layouts).

Addresses and ports are stored in network byte order: fill them with
:func:`cilia_agent.datapath.layout.ip_to_map` / ``port_to_map``. Every structure has the
size the C side has (checked by the packet tests in ``bpf/tests``).

Map names and pins (under ``--bpf-pin-dir``) are upstream's:

==============================  ==========================================  ==============
map                             key -> value                                kind
==============================  ==========================================  ==============
``cilium_lb4_services_v2``      :class:`Lb4Key` -> :class:`Lb4Service`     hash
``cilium_lb4_backends_v3``      ``u32 backend_id`` -> :class:`Lb4Backend`  hash
``cilium_lb4_reverse_nat``      ``u16 rev_nat_index`` -> :class:`Lb4ReverseNat`  hash
``cilium_lb4_reverse_sk``       :class:`RevNatTuple` -> :class:`RevNatEntry`  LRU hash
``cilium_lb4_affinity``         :class:`AffinityKey` -> :class:`AffinityValue`  LRU hash
``cilium_lb_affinity_match``    :class:`AffinityMatch` -> ``u8``            hash
``cilia_lb4_alias_use``         ``u32 VIP`` -> ``u64`` last use (ns)        hash
``cilia_lb4_node_addrs``        ``u32 node address`` -> ``u8`` (unused)     hash
``cilium_snat_v4_external``     :class:`NatTuple` -> :class:`NatEntry`      LRU hash
``cilium_ipmasq_v4``            :class:`MasqLpmKey` -> ``u8``               LPM trie
``cilia_masq_src_v4``           :class:`MasqLpmKey` -> ``u8``               LPM trie
``cilia_masq_dev_v4``           ``u32 ifindex`` -> ``u32`` node address     hash
``cilia_nat_stats``             ``u32 NAT_STAT_*`` -> ``u64`` per CPU       per-CPU array
==============================  ==========================================  ==============

``cilium_snat_v4_external`` is ``bpf/bpf_host.c``'s (NodePort and BPF masquerade translation
state, both directions of each flow), and so are the masquerade maps below it; the others
are created by ``bpf/bpf_sock.c`` and shared.
"""

from __future__ import annotations

import ctypes
from typing import Any

SERVICES_MAP = "cilium_lb4_services_v2"
BACKENDS_MAP = "cilium_lb4_backends_v3"
REVNAT_MAP = "cilium_lb4_reverse_nat"
REVERSE_SK_MAP = "cilium_lb4_reverse_sk"
AFFINITY_MAP = "cilium_lb4_affinity"
AFFINITY_MATCH_MAP = "cilium_lb_affinity_match"
ALIAS_USE_MAP = "cilia_lb4_alias_use"
NODE_ADDRS_MAP = "cilia_lb4_node_addrs"
MAPS = (
    SERVICES_MAP,
    BACKENDS_MAP,
    REVNAT_MAP,
    REVERSE_SK_MAP,
    AFFINITY_MAP,
    AFFINITY_MATCH_MAP,
    ALIAS_USE_MAP,
    NODE_ADDRS_MAP,
)
"""The maps of ``bpf_sock.o`` (those of :data:`HOST_SHARED_MAPS` are ``bpf_host.o``'s too)."""
HOST_SHARED_MAPS = (SERVICES_MAP, BACKENDS_MAP, AFFINITY_MAP, AFFINITY_MATCH_MAP)
"""The maps ``bpf_host.o`` shares with ``bpf_sock.o`` (``bpf/lib/lb.h``); its own is :data:`NAT_MAP`."""
NAT_MAP = "cilium_snat_v4_external"
IPMASQ_MAP = "cilium_ipmasq_v4"
"""Destinations never masqueraded (LPM trie; upstream's name)."""
MASQ_SRC_MAP = "cilia_masq_src_v4"
"""Sources masqueraded: this node's masqueraded pod CIDRs (LPM trie)."""
MASQ_DEV_MAP = "cilia_masq_dev_v4"
"""Masquerading devices: ifindex → the node address their packets leave from."""
NAT_STATS_MAP = "cilia_nat_stats"
"""Per-CPU counters of ``bpf_host.c``, indexed by ``NAT_STAT_*``."""
NAT_STAT_MASQ_NEW = 0
NAT_STAT_MASQ_EXHAUSTED = 1
NAT_STAT_NODEPORT_EXHAUSTED = 2
#: ``lb4_nat_entry.flags``: a masqueraded pod flow (not a NodePort flow).
NAT_F_MASQ = 1

LB_LOOKUP_SCOPE_EXT = 0
SVC_FLAG_NODEPORT = 1 << 1
SVC_FLAG_EXT_LOCAL_SCOPE = 1 << 2
SVC_FLAG_AFFINITY = 1 << 4
SVC_FLAG_ROUTABLE = 1 << 6
#: ``flags2`` bit (upstream SVC_FLAG_INT_LOCAL_SCOPE): internalTrafficPolicy Local.
SVC_FLAG_INT_LOCAL_SCOPE = 1 << 4
NAT_DIR_FWD = 0
NAT_DIR_REPLY = 1
BE_STATE_ACTIVE = 0
BE_STATE_TERMINATING = 1
BACKEND_STATE_TEXT = {BE_STATE_ACTIVE: "active", BE_STATE_TERMINATING: "terminating"}

IPPROTO_ICMP = 1
IPPROTO_TCP = 6
IPPROTO_UDP = 17
PROTOCOLS = {"TCP": IPPROTO_TCP, "UDP": IPPROTO_UDP}
PROTOCOL_TEXT = {v: k for k, v in PROTOCOLS.items()}


class Lb4Key(ctypes.Structure):
    """``struct lb4_key``: VIP, port (network order), slot (0 = master), protocol, scope."""

    _fields_ = [
        ("address", ctypes.c_uint32),
        ("dport", ctypes.c_uint16),
        ("backend_slot", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("scope", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 2),
    ]


class Lb4Service(ctypes.Structure):
    """``struct lb4_service``: slot 0 holds the affinity timeout (s) in ``backend_id``, the
    active backend ``count`` and the flags; slots 1..count hold a ``backend_id``."""

    _fields_ = [
        ("backend_id", ctypes.c_uint32),
        ("count", ctypes.c_uint16),
        ("rev_nat_index", ctypes.c_uint16),
        ("flags", ctypes.c_uint8),
        ("flags2", ctypes.c_uint8),
        ("qcount", ctypes.c_uint16),
    ]


class Lb4Backend(ctypes.Structure):
    """``struct lb4_backend``: address and port (network order), protocol, ``BE_STATE_*``."""

    _fields_ = [
        ("address", ctypes.c_uint32),
        ("port", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("cluster_id", ctypes.c_uint16),
        ("zone", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


class Lb4ReverseNat(ctypes.Structure):
    """``struct lb4_reverse_nat``: the VIP and port a rev-NAT index stands for."""

    _fields_ = [("address", ctypes.c_uint32), ("port", ctypes.c_uint16), ("pad", ctypes.c_uint16)]


class RevNatTuple(ctypes.Structure):
    """``struct ipv4_revnat_tuple``: socket cookie and the backend it reached."""

    _fields_ = [
        ("cookie", ctypes.c_uint64),
        ("address", ctypes.c_uint32),
        ("port", ctypes.c_uint16),
        ("pad", ctypes.c_uint16),
    ]


class RevNatEntry(ctypes.Structure):
    """``struct ipv4_revnat_entry``: the VIP and port the socket addressed."""

    _fields_ = [
        ("address", ctypes.c_uint32),
        ("port", ctypes.c_uint16),
        ("rev_nat_index", ctypes.c_uint16),
    ]


class AffinityKey(ctypes.Structure):
    """``struct lb4_affinity_key``: client network namespace cookie and frontend."""

    _fields_ = [
        ("client_cookie", ctypes.c_uint64),
        ("rev_nat_id", ctypes.c_uint16),
        ("netns", ctypes.c_uint8),
        ("pad1", ctypes.c_uint8),
        ("pad2", ctypes.c_uint32),
    ]


class AffinityValue(ctypes.Structure):
    """``struct lb_affinity_val``: last use (``bpf_ktime_get_ns``) and the backend."""

    _fields_ = [
        ("last_used", ctypes.c_uint64),
        ("backend_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class AffinityMatch(ctypes.Structure):
    """``struct lb_affinity_match``: present = the backend is active in that frontend."""

    _fields_ = [
        ("backend_id", ctypes.c_uint32),
        ("rev_nat_id", ctypes.c_uint16),
        ("pad", ctypes.c_uint16),
    ]


class NatTuple(ctypes.Structure):
    """``struct lb4_nat_tuple``: a flow's tuple as one direction's packets carry it
    (network order), protocol, ``NAT_DIR_*``."""

    _fields_ = [
        ("daddr", ctypes.c_uint32),
        ("saddr", ctypes.c_uint32),
        ("dport", ctypes.c_uint16),
        ("sport", ctypes.c_uint16),
        ("nexthdr", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]


class NatEntry(ctypes.Structure):
    """``struct lb4_nat_entry``: the source/destination the packet gets (0 = kept), the
    backend chosen, the frontend's rev-NAT index, ``NAT_F_*`` flags, and ``created``
    (``bpf_ktime_get_ns``; a masqueraded flow refreshes it on each forward packet: its
    last use)."""

    _fields_ = [
        ("to_saddr", ctypes.c_uint32),
        ("to_daddr", ctypes.c_uint32),
        ("to_sport", ctypes.c_uint16),
        ("to_dport", ctypes.c_uint16),
        ("backend_id", ctypes.c_uint32),
        ("rev_nat_index", ctypes.c_uint16),
        ("flags", ctypes.c_uint16),
        ("created", ctypes.c_uint64),
    ]


class HostProgramConfig(ctypes.Structure):
    """``struct host_config`` of ``bpf/bpf_host.c``: its ``CONFIG``, written into the
    object's ``.rodata`` at load (``datapath.objects.BpfObject.load``).

    Fields:
        tunnel: 1 with ``--routing-mode tunnel`` (a backend routed through a gateway is
            another node's pod behind the tunnel device, so its flows are SNATed), else 0.
        masquerade: 1 with ``--enable-bpf-masquerade``.
        nat_port_min, nat_port_max: the NAT port range, inclusive, host order
            (``--bpf-nat-port-range``).
    """

    _fields_ = [
        ("tunnel", ctypes.c_uint32),
        ("masquerade", ctypes.c_uint32),
        ("nat_port_min", ctypes.c_uint32),
        ("nat_port_max", ctypes.c_uint32),
    ]


class MasqLpmKey(ctypes.Structure):
    """``struct masq_lpm_key``: prefix length (0..32) and address (network order)."""

    _fields_ = [("prefixlen", ctypes.c_uint32), ("addr", ctypes.c_uint32)]


HOST_MAP_LAYOUTS: dict[
    str,
    tuple[
        type[ctypes.Structure] | type[ctypes._SimpleCData[Any]],
        type[ctypes.Structure] | type[ctypes._SimpleCData[Any]],
    ],
] = {
    NAT_MAP: (NatTuple, NatEntry),
    IPMASQ_MAP: (MasqLpmKey, ctypes.c_uint8),
    MASQ_SRC_MAP: (MasqLpmKey, ctypes.c_uint8),
    MASQ_DEV_MAP: (ctypes.c_uint32, ctypes.c_uint32),
}
"""Map name in ``bpf/bpf_host.c`` → (key, value) mirrors (checked against the BTF)."""


MAP_LAYOUTS: dict[
    str,
    tuple[
        type[ctypes.Structure] | type[ctypes._SimpleCData[Any]],
        type[ctypes.Structure] | type[ctypes._SimpleCData[Any]],
    ],
] = {
    SERVICES_MAP: (Lb4Key, Lb4Service),
    BACKENDS_MAP: (ctypes.c_uint32, Lb4Backend),
    REVNAT_MAP: (ctypes.c_uint16, Lb4ReverseNat),
    REVERSE_SK_MAP: (RevNatTuple, RevNatEntry),
    AFFINITY_MAP: (AffinityKey, AffinityValue),
    AFFINITY_MATCH_MAP: (AffinityMatch, ctypes.c_uint8),
    ALIAS_USE_MAP: (ctypes.c_uint32, ctypes.c_uint64),
    NODE_ADDRS_MAP: (ctypes.c_uint32, ctypes.c_uint8),
}
"""Map name in ``bpf/bpf_sock.c`` → (key, value) mirrors (checked against the BTF)."""
