"""Decoding ``struct flow_event`` records (bpf/lib/common.h)."""

from __future__ import annotations

import ctypes
import re
import socket
from pathlib import Path

import pytest

from cilia_agent.hubble import events
from cilia_agent.hubble.errors import EventDecodeError

COMMON_H = Path(__file__).resolve().parents[5] / "bpf" / "lib" / "common.h"


class CFlowEvent(ctypes.Structure):
    """Independent ctypes mirror of struct flow_event (natural C alignment)."""

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


def crafted() -> bytes:
    ev = CFlowEvent(
        ts_ns=123_456_789_012,
        saddr=int.from_bytes(socket.inet_aton("10.200.0.10"), "little"),
        daddr=int.from_bytes(socket.inet_aton("10.200.0.20"), "little"),
        sport=socket.htons(40000),
        dport=socket.htons(8080),
        proto=6,
        event_type=1,
        verdict=2,
        drop_reason=181,
        src_identity=1001,
        dst_identity=1002,
        ep_id=42,
        ifindex=7,
        len=74,
        dir=1,
        is_reply=0,
        tcp_flags=0x12,
    )
    return bytes(ev)


def test_struct_layout_matches_common_h_field_list() -> None:
    text = COMMON_H.read_text()
    body = re.search(r"struct flow_event \{(.*?)\};", text, re.S)
    assert body is not None
    names = re.findall(r"\b(\w+);", body.group(1))
    assert names == [field[0] for field in CFlowEvent._fields_]
    assert ctypes.sizeof(CFlowEvent) == events.FLOW_EVENT_SIZE == 48


def test_decode_reads_every_field_with_network_order_addresses_and_ports() -> None:
    ev = events.decode(crafted())
    assert ev == events.FlowEvent(
        ts_ns=123_456_789_012,
        saddr="10.200.0.10",
        daddr="10.200.0.20",
        sport=40000,
        dport=8080,
        proto=6,
        event_type=1,
        verdict=2,
        drop_reason=181,
        src_identity=1001,
        dst_identity=1002,
        ep_id=42,
        ifindex=7,
        length=74,
        direction=1,
        is_reply=False,
        tcp_flags=0x12,
        obs_point=0,
    )


def test_a_trace_carries_its_observation_point_and_a_hand_built_one_gets_its_hooks() -> None:
    raw = bytearray(crafted())
    raw[21], raw[47] = events.EVENT_TRACE, events.TRACE_TO_STACK  # event_type, obs_point
    ev = events.decode(bytes(raw))
    assert (ev.obs_point, ev.point()) == (events.TRACE_TO_STACK, events.TRACE_TO_STACK)
    assert ev.pack() == bytes(raw)
    ev.obs_point = None  # built by hand: the hook's own point
    assert ev.point() == events.TRACE_FROM_LXC  # direction 1 = egress
    ev.direction = events.DIR_INGRESS
    assert ev.point() == events.TRACE_TO_LXC
    ev.event_type = events.EVENT_DROP
    assert ev.point() == 0


def test_pack_round_trips_to_the_same_bytes() -> None:
    raw = crafted()
    assert events.decode(raw).pack() == raw


@pytest.mark.parametrize("size", [0, 47, 49, 64])
def test_decode_refuses_records_of_the_wrong_size(size: int) -> None:
    with pytest.raises(EventDecodeError, match=f"{size} bytes.*48"):
        events.decode(b"\x00" * size)
