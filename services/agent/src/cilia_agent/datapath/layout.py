"""ctypes mirrors of the BPF map keys/values in ``bpf/lib/common.h``.

One place for every layout the agent reads or writes; the packet tests in
``bpf/tests`` check the C side against the same shapes. Fields that the C
code stores in network byte order are documented as such; use
:func:`ip_to_map` / :func:`port_to_map` to fill them.
"""

from __future__ import annotations

import ctypes
import ipaddress
import socket

from cilia_common import reserved_identities as reserved

# Reserved identities the datapath knows (bpf/lib/common.h; the table: cilia_common.reserved_identities).
IDENTITY_HOST = reserved.HOST
IDENTITY_WORLD = reserved.WORLD

DIR_INGRESS = 0  # to the pod (tc egress of the host veth)
DIR_EGRESS = 1  # from the pod (tc ingress of the host veth)

# A trace event's observation point (flow_event.obs_point; upstream monitor/api trace
# observation points, which are also the Hubble event sub_type of a trace).
TRACE_TO_LXC = 0  # delivered to the endpoint: Hubble's TO_ENDPOINT
TRACE_TO_STACK = 3  # handed by the endpoint's program to the host stack, not to a local pod
TRACE_FROM_LXC = 5  # sent by the endpoint: Hubble's FROM_ENDPOINT

# Upstream drop reasons used by the datapath (flow.DropReason).
DROP_INVALID_SIP = 132  # a pod's packet whose source is not the pod's address
DROP_POLICY_DENIED = 133
DROP_POLICY_DENY = 181
DROP_REASON_TEXT = {
    DROP_INVALID_SIP: "Invalid source ip",
    DROP_POLICY_DENIED: "Policy denied",
    DROP_POLICY_DENY: "Policy denied by denylist",
}


def ip_to_map(address: str) -> int:
    """IPv4 text → the u32 whose memory holds the address in network order."""
    return int.from_bytes(socket.inet_aton(address), "little")


def ip_from_map(value: int) -> str:
    """Inverse of :func:`ip_to_map`."""
    return str(ipaddress.IPv4Address(value.to_bytes(4, "little")))


def port_to_map(port: int) -> int:
    """Host port → the u16 whose memory holds it in network order."""
    return socket.htons(port)


class IpcacheKey(ctypes.Structure):
    """``struct ipcache_key``: prefixlen 0..32, ip in network order."""

    _fields_ = [("prefixlen", ctypes.c_uint32), ("ip", ctypes.c_uint32)]


class IpcacheValue(ctypes.Structure):
    """``struct ipcache_value``: identity and hosting node address (network order, 0 = local)."""

    _fields_ = [("sec_identity", ctypes.c_uint32), ("node_ip", ctypes.c_uint32)]


class EndpointInfo(ctypes.Structure):
    """``struct endpoint_info``, keyed by the host veth ifindex (u32)."""

    _fields_ = [
        ("ep_id", ctypes.c_uint32),
        ("sec_identity", ctypes.c_uint32),
        ("ipv4", ctypes.c_uint32),
        ("enforce_ingress", ctypes.c_uint8),
        ("enforce_egress", ctypes.c_uint8),
        ("policy_audit", ctypes.c_uint8),  # 1 = audit mode (--policy-audit-mode)
        ("pad", ctypes.c_uint8),
    ]


POLICY_PREFIX_STATIC = 72  # ep_id + sec_label + egress
POLICY_PREFIX_PROTO = 80
POLICY_PREFIX_FULL = 96
POLICY_FLAG_DENY = 1


class PolicyKey(ctypes.Structure):
    """``struct policy_key``: LPM over (ep_id, sec_label 0=any, egress, protocol 0=any, dport 0=any).

    ``dport`` is in network order (:func:`port_to_map`); prefixlen is 72, 80 or 96.
    """

    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("ep_id", ctypes.c_uint32),
        ("sec_label", ctypes.c_uint32),
        ("egress", ctypes.c_uint8),
        ("protocol", ctypes.c_uint8),
        ("dport", ctypes.c_uint16),
    ]


class PolicyValue(ctypes.Structure):
    """``struct policy_value``: flags bit0 = deny; packet/byte counters kept by the datapath."""

    _fields_ = [
        ("flags", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 7),
        ("packets", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
    ]


def policy_key(
    ep_id: int, peer: int, egress: int, protocol: int = 0, port: int = 0, port_bits: int = 16
) -> PolicyKey:
    """Build a policy key; the prefix length follows from which fields are wildcards:
    72 (any protocol), 80 (a protocol, any port), 80 + ``port_bits`` (a port; ``port_bits``
    < 16 makes the key cover the 2**(16 - port_bits) ports from ``port`` on: a port range
    block, as upstream encodes ``endPort`` ranges).

    Raises:
        ValueError: a port without a protocol (upstream keys need the protocol first), or
            ``port_bits`` outside 1..16.
    """
    if port and not protocol:
        raise ValueError("a policy entry with a port needs a protocol")
    if not 1 <= port_bits <= 16:
        raise ValueError(f"port_bits {port_bits} outside 1..16")
    prefix = (
        POLICY_PREFIX_PROTO + port_bits
        if port
        else POLICY_PREFIX_PROTO
        if protocol
        else POLICY_PREFIX_STATIC
    )
    return PolicyKey(prefix, ep_id, peer, egress, protocol, port_to_map(port) if port else 0)


class FlowEvent(ctypes.Structure):
    """``struct flow_event``: one ring-buffer record (48 bytes, no padding).

    Decoded by :mod:`cilia_agent.hubble.events` (field meanings there); this mirror lets the
    layout be checked against the compiled type's BTF. Addresses and ports in network order.
    """

    _fields_ = [
        ("ts_ns", ctypes.c_uint64),
        ("saddr", ctypes.c_uint32),
        ("daddr", ctypes.c_uint32),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("event_type", ctypes.c_uint8),
        ("verdict", ctypes.c_uint8),
        ("drop_reason", ctypes.c_uint8),
        ("src_identity", ctypes.c_uint32),
        ("dst_identity", ctypes.c_uint32),
        ("ep_id", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),
        ("len", ctypes.c_uint32),
        ("dir", ctypes.c_uint8),
        ("is_reply", ctypes.c_uint8),
        ("tcp_flags", ctypes.c_uint8),
        ("obs_point", ctypes.c_uint8),
    ]


class MetricsKey(ctypes.Structure):
    """``struct metrics_key``: reason (0 = forwarded, else a drop reason), dir (0 ingress)."""

    _fields_ = [("reason", ctypes.c_uint8), ("dir", ctypes.c_uint8), ("pad", ctypes.c_uint16)]


class MetricsValue(ctypes.Structure):
    """``struct metrics_value``: packets and bytes of one CPU (``cilia_metrics`` is per-CPU)."""

    _fields_ = [("packets", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


#: ``ct_value.ct_flags`` bits (bpf/lib/common.h).
CT_REPLY_SEEN, CT_TX_FIN, CT_RX_FIN = 0x01, 0x02, 0x04


class CtKey(ctypes.Structure):
    """``struct ct_key`` of ``cilia_ct``: the tuple as the endpoint first saw it (addresses
    and ports in network byte order), ``proto`` (IP protocol), ``dir`` (``CT_DIR_*``: which
    hook of the endpoint made it). 16 bytes."""

    _fields_ = [
        ("saddr", ctypes.c_uint32), ("daddr", ctypes.c_uint32), ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16), ("proto", ctypes.c_uint8), ("dir", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]  # fmt: skip


class CtValue(ctypes.Structure):
    """``struct ct_value``: ``created_ns``/``last_seen_ns`` (the datapath's conntrack clock,
    CLOCK_MONOTONIC, coarse where the kernel has it), packets both ways, TCP flags seen
    both ways, ``ct_flags`` (:data:`CT_REPLY_SEEN`, :data:`CT_TX_FIN`, :data:`CT_RX_FIN`),
    and monitor-aggregation report state. 32 bytes."""

    _fields_ = [
        ("created_ns", ctypes.c_uint64), ("last_seen_ns", ctypes.c_uint64),
        ("packets", ctypes.c_uint64), ("tcp_flags_seen", ctypes.c_uint8),
        ("ct_flags", ctypes.c_uint8), ("tx_flags_reported", ctypes.c_uint8),
        ("rx_flags_reported", ctypes.c_uint8), ("tx_report", ctypes.c_uint16),
        ("rx_report", ctypes.c_uint16),
    ]  # fmt: skip


class LxcConfig(ctypes.Structure):
    """``struct lxc_config`` (bpf/bpf_lxc.c ``CONFIG``), written into the object before load.

    Fields: ``monitor_aggregation_interval_ns`` (u64), ``monitor_aggregation`` (0 none …
    4 maximum), ``events_wakeup_events`` (>= 1), ``monitor_aggregation_flags`` (TCP flag bits
    of byte 13), ``ct_clock_coarse`` (1: conntrack timestamps from
    ``bpf_ktime_get_coarse_ns``, 0: ``bpf_ktime_get_ns``), ``host_legacy_routing`` (1: a
    packet between two local pods goes through the host's IP stack, 0: the program delivers
    it); meanings in
    :class:`cilia_agent.datapath.loader.DatapathConfig`. 24 bytes.
    """

    _fields_ = [
        ("monitor_aggregation_interval_ns", ctypes.c_uint64),
        ("monitor_aggregation", ctypes.c_uint32),
        ("events_wakeup_events", ctypes.c_uint32),
        ("monitor_aggregation_flags", ctypes.c_uint8),
        ("ct_clock_coarse", ctypes.c_uint8),
        ("host_legacy_routing", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 5),
    ]


MAP_LAYOUTS: dict[
    str,
    tuple[
        type[ctypes.Structure] | type[ctypes.c_uint32],
        type[ctypes.Structure] | type[ctypes.c_uint32],
    ],
] = {
    "cilia_ipcache": (IpcacheKey, IpcacheValue),
    "cilia_endpoints": (ctypes.c_uint32, EndpointInfo),
    "cilia_lxc": (ctypes.c_uint32, ctypes.c_uint32),
    "cilia_policy": (PolicyKey, PolicyValue),
    "cilia_metrics": (MetricsKey, MetricsValue),
    "cilia_ct": (CtKey, CtValue),
}
"""Map name in ``bpf/bpf_lxc.c`` → (key, value) mirrors, for every map the agent reads or
writes (``cilia_ct``: the programs write it, the agent's conntrack GC reads and deletes)."""

STRUCT_LAYOUTS: dict[str, type[ctypes.Structure]] = {
    "flow_event": FlowEvent,
    "lxc_config": LxcConfig,
}
"""C struct name → mirror, for types that are not a map's key or value (ring-buffer records)."""
