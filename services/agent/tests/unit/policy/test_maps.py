"""Policy-map encoding (struct policy_key/policy_value) and the entry diff."""

from __future__ import annotations

import ctypes

import pytest

from cilia_agent.policy.compiler import PolicyEntry, Verdict
from cilia_agent.policy.maps import (
    PolicyKey,
    PolicyValue,
    UnencodableEntry,
    decode_key,
    decode_value,
    diff,
    encode_key,
    encode_value,
    prefix_len,
)

E = PolicyEntry
A, D = Verdict.ALLOW, Verdict.DENY


def test_layouts_match_common_h_sizes() -> None:
    assert ctypes.sizeof(PolicyKey) == 16
    assert ctypes.sizeof(PolicyValue) == 24
    assert PolicyKey.dport.offset == 14 and PolicyValue.packets.offset == 8


@pytest.mark.parametrize(
    ("entry", "prefix"),
    [(E(0, 0, 0, 0), 72), (E(1000, 1, 6, 0), 80), (E(1000, 0, 17, 53), 96)],
)
def test_prefix_length_follows_wildcards(entry: PolicyEntry, prefix: int) -> None:
    assert prefix_len(entry) == prefix


@pytest.mark.parametrize(
    "entry", [E(1, 0, 0, 80), E(1, 2, 6, 80), E(1, 0, 256, 0), E(1, 0, 6, 70000), E(-1, 0, 0, 0)]
)
def test_unencodable_entries_are_refused(entry: PolicyEntry) -> None:
    with pytest.raises(UnencodableEntry):
        encode_key(7, entry)


def test_key_bytes_carry_port_in_network_order_and_round_trip() -> None:
    key = encode_key(42, E(1000, 1, 6, 8080))
    raw = bytes(key)
    assert raw[4:8] == (42).to_bytes(4, "little")
    assert raw[8:12] == (1000).to_bytes(4, "little")
    assert raw[12:14] == b"\x01\x06"
    assert raw[14:16] == (8080).to_bytes(2, "big")
    assert decode_key(key) == (42, E(1000, 1, 6, 8080))


def test_value_flags_bit0_is_deny() -> None:
    assert encode_value(D).flags == 1 and encode_value(A).flags == 0
    assert decode_value(encode_value(D)) is D and decode_value(encode_value(A)) is A


@pytest.mark.parametrize(
    ("current", "desired", "upserts", "deletes", "growth"),
    [
        ({}, {}, {}, {}, 0),
        ({E(1, 0, 0, 0): A}, {E(1, 0, 0, 0): A}, {}, {}, 0),
        ({}, {E(1, 0, 6, 80): A}, {E(1, 0, 6, 80): A}, {}, 1),
        ({E(1, 0, 6, 80): A}, {}, {}, {E(1, 0, 6, 80): A}, -1),
        ({E(1, 0, 6, 80): A}, {E(1, 0, 6, 80): D}, {E(1, 0, 6, 80): D}, {}, 0),
        (
            {E(1, 0, 0, 0): A, E(2, 0, 0, 0): A, E(3, 1, 17, 53): D},
            {E(1, 0, 0, 0): A, E(3, 1, 17, 53): D, E(4, 0, 6, 443): A},
            {E(4, 0, 6, 443): A},
            {E(2, 0, 0, 0): A},
            0,
        ),
    ],
)
def test_diff_contains_only_changes(
    current: dict[PolicyEntry, Verdict],
    desired: dict[PolicyEntry, Verdict],
    upserts: dict[PolicyEntry, Verdict],
    deletes: dict[PolicyEntry, Verdict],
    growth: int,
) -> None:
    change = diff(current, desired)
    assert dict(change.upserts) == upserts
    assert dict(change.deletes) == deletes
    assert change.growth == growth
    assert bool(change) is bool(upserts or deletes)
