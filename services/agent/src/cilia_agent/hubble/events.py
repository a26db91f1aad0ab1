"""Decode one ring-buffer record of ``struct flow_event`` (bpf/lib/common.h).

Layout (48 bytes, host byte order except where noted, no implicit padding)::

    offset size field
         0    8 ts_ns          bpf_ktime_get_ns(), CLOCK_MONOTONIC
         8    4 saddr          network byte order
        12    4 daddr          network byte order
        16    2 sport          network byte order (ICMP echo: the echo id)
        18    2 dport          network byte order (ICMP echo: the echo id)
        20    1 proto          IP protocol number
        21    1 event_type     4 trace, 1 drop, 5 policy verdict (upstream monitor message
                               types; 5 only in audit mode)
        22    1 verdict        1 FORWARDED, 2 DROPPED, 4 AUDIT (flow.Verdict numbers)
        23    1 drop_reason    0, 132 INVALID_SOURCE_IP, 133 POLICY_DENIED, 181 POLICY_DENY
                               (an AUDIT event: the drop the policy would have made)
        24    4 src_identity
        28    4 dst_identity
        32    4 ep_id          local endpoint the hook belongs to
        36    4 ifindex        host-side veth of that endpoint
        40    4 len            bytes on the wire
        44    1 dir            0 ingress (to the pod), 1 egress (from the pod)
        45    1 is_reply       1 = packet of the reverse direction of a tracked connection
        46    1 tcp_flags      byte 13 of the TCP header
        47    1 obs_point      a trace's observation point: 0 to-endpoint, 3 to-stack,
                               5 from-endpoint (upstream monitor/api numbers); drops 0

Change this module together with ``struct flow_event``; the size check below
catches a layout change that alters the size.
"""

from __future__ import annotations

import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

from cilia_agent.datapath import layout
from cilia_agent.hubble.errors import EventDecodeError

# "=" = host byte order, standard sizes, no alignment padding (the C struct has none).
_FIELDS = "Q4s4sHHBBBBIIIIIBBBB"
_LAYOUT = struct.Struct("=" + _FIELDS)
_ntohs = socket.ntohs  # the ports are unpacked in host order, stored in network order
FLOW_EVENT_SIZE = _LAYOUT.size
assert FLOW_EVENT_SIZE == 48, FLOW_EVENT_SIZE

RECORD = _LAYOUT
"""``struct flow_event`` as a :class:`struct.Struct`; ``RECORD.unpack(record)`` gives the
*record tuple* the fast path works on: the fields in the order of the table above (ports
still in network byte order, addresses as 4 raw bytes, ``obs_point`` last)."""
RINGBUF_HEADER_SIZE = 8
BLOCK_RECORD = struct.Struct(f"={RINGBUF_HEADER_SIZE}x{_FIELDS}")
"""One record of a ring-buffer block (its 8-byte ring-buffer header skipped, see
:meth:`cilia_agent.datapath.objects.RingBuffer.drain`): ``BLOCK_RECORD.iter_unpack(block)``
gives record tuples."""
assert BLOCK_RECORD.size == FLOW_EVENT_SIZE + RINGBUF_HEADER_SIZE

# The same 48 bytes as 10 native integers, the reader's fast path: a flow's template key is
# (addresses, bytes 20-28, bytes 28-36, ifindex, dir+is_reply, tcp_flags+obs_point) - six
# integers, cheap to hash and compare, where the record tuple's 14 key fields include two
# fresh ``bytes`` objects (measured with timeit: 523 → 258 ns per record for the shape lookup).
_KEYED_FIELDS = "QQHHQQIIHH"
KEYED = struct.Struct("=" + _KEYED_FIELDS)
"""``struct flow_event`` as a *keyed tuple*: ``(ts_ns, addresses, sport, dport, w20, w28,
ifindex, len, dir_reply, flags_point)``; ``addresses`` is saddr and daddr as one native
integer, ``w20`` the bytes 20-28 (proto, event_type, verdict, drop_reason, src_identity),
``w28`` the bytes 28-36 (dst_identity, ep_id), ``dir_reply`` the bytes 44-45,
``flags_point`` the bytes 46-47 (tcp_flags, obs_point); ports stay in network byte order.
:func:`record_of_keyed` gives back the record tuple."""
BLOCK_KEYED = struct.Struct(f"={RINGBUF_HEADER_SIZE}x{_KEYED_FIELDS}")
""":data:`KEYED` after a ring-buffer record header, as :data:`BLOCK_RECORD`."""
assert KEYED.size == FLOW_EVENT_SIZE and BLOCK_KEYED.size == BLOCK_RECORD.size
#: Shift of the protocol byte (offset 20) within a keyed tuple's ``w20``.
KEYED_PROTO_SHIFT = 0 if sys.byteorder == "little" else 56


def record_of_keyed(k: tuple[int, ...]) -> tuple[Any, ...]:
    """The record tuple (:data:`RECORD`) of a keyed tuple (:data:`KEYED`): the same bytes
    read the other way."""
    return _LAYOUT.unpack(KEYED.pack(*k))


EVENT_DROP = 1
EVENT_TRACE = 4
EVENT_POLICY_VERDICT = 5
DIR_INGRESS = layout.DIR_INGRESS
DIR_EGRESS = layout.DIR_EGRESS
TRACE_TO_LXC = layout.TRACE_TO_LXC
TRACE_TO_STACK = layout.TRACE_TO_STACK
TRACE_FROM_LXC = layout.TRACE_FROM_LXC
VERDICT_FORWARDED = 1
VERDICT_DROPPED = 2
VERDICT_AUDIT = 4
DROP_POLICY_DENIED = layout.DROP_POLICY_DENIED
DROP_POLICY_DENY = layout.DROP_POLICY_DENY

IPPROTO_ICMP = 1
IPPROTO_TCP = 6
IPPROTO_UDP = 17

TCP_FIN = 0x01
TCP_SYN = 0x02
TCP_RST = 0x04
TCP_PSH = 0x08
TCP_ACK = 0x10
TCP_URG = 0x20
TCP_ECE = 0x40
TCP_CWR = 0x80


@dataclass(slots=True)
class FlowEvent:
    """One decoded ``struct flow_event``; ports are host-order ints, addresses dotted quads
    (not frozen: building it is on the per-event path, and no one mutates it).
    ``obs_point`` None (only in events built by hand) stands for the hook's own point:
    :data:`TRACE_FROM_LXC` at egress, :data:`TRACE_TO_LXC` at ingress; a drop's is 0."""

    ts_ns: int
    saddr: str
    daddr: str
    sport: int
    dport: int
    proto: int
    event_type: int
    verdict: int
    drop_reason: int
    src_identity: int
    dst_identity: int
    ep_id: int
    ifindex: int
    length: int
    direction: int
    is_reply: bool
    tcp_flags: int
    obs_point: int | None = None

    def pack(self) -> bytes:
        """Encode back to the exact 48 bytes the datapath writes (used by tests and tools)."""
        return _LAYOUT.pack(
            self.ts_ns,
            socket.inet_aton(self.saddr),
            socket.inet_aton(self.daddr),
            socket.htons(self.sport),
            socket.htons(self.dport),
            self.proto,
            self.event_type,
            self.verdict,
            self.drop_reason,
            self.src_identity,
            self.dst_identity,
            self.ep_id,
            self.ifindex,
            self.length,
            self.direction,
            int(self.is_reply),
            self.tcp_flags,
            self.point(),
        )

    def point(self) -> int:
        """The observation point the record carries (``obs_point``, or the hook's own)."""
        if self.obs_point is not None:
            return self.obs_point
        if self.event_type != EVENT_TRACE:
            return 0
        return TRACE_FROM_LXC if self.direction == DIR_EGRESS else TRACE_TO_LXC


_ADDRESSES_MAX = 65536
_addresses: dict[bytes, str] = {}


def _ntoa(raw: bytes) -> str:
    """Dotted quad of 4 network-order bytes, remembered (a node sees few addresses)."""
    text = _addresses.get(raw)
    if text is None:
        if len(_addresses) >= _ADDRESSES_MAX:
            _addresses.clear()
        text = _addresses[raw] = socket.inet_ntoa(raw)
    return text


def decode(record: bytes | bytearray | memoryview) -> FlowEvent:
    """Decode one ring-buffer record into a :class:`FlowEvent`.

    Args:
        record: exactly :data:`FLOW_EVENT_SIZE` (48) bytes as emitted by ``emit()`` in
            bpf/bpf_lxc.c.

    Raises:
        EventDecodeError: the record does not have the size of ``struct flow_event``.
    """
    if len(record) != FLOW_EVENT_SIZE:
        raise EventDecodeError(len(record), FLOW_EVENT_SIZE)
    return from_tuple(_LAYOUT.unpack(record))


RecordTuple = tuple[Any, ...]
"""A record tuple (see :data:`RECORD`): 18 items, ints but for the two addresses (bytes)."""


def from_tuple(f: RecordTuple) -> FlowEvent:
    """The :class:`FlowEvent` of a record tuple (:data:`RECORD`, :data:`BLOCK_RECORD`)."""
    # Positional, in field order (cheaper than keywords for a slotted dataclass).
    return FlowEvent(
        f[0],
        _ntoa(f[1]),
        _ntoa(f[2]),
        _ntohs(f[3]),
        _ntohs(f[4]),
        f[5],
        f[6],
        f[7],
        f[8],
        f[9],
        f[10],
        f[11],
        f[12],
        f[13],
        f[14],
        bool(f[15]),
        f[16],
        f[17],
    )
