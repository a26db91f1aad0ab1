"""Port ranges (``endPort``) as aligned LPM blocks, and deny precedence over them."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from cilia_agent.policy.compiler import PolicyEntry, Verdict, apply_deny_precedence
from cilia_agent.policy.maps import decode_key, encode_key, prefix_len
from cilia_agent.policy.rules import port_blocks, port_keys


@given(st.integers(1, 65535), st.integers(0, 65535))
def test_blocks_cover_the_range_exactly_and_are_aligned(first: int, length: int) -> None:
    last = min(65535, first + length)
    blocks = port_blocks(first, last)
    covered = []
    for start, bits in blocks:
        size = 1 << (16 - bits)
        assert start % size == 0, (start, bits)
        covered += range(start, start + size)
    assert covered == list(range(first, last + 1))
    assert len(blocks) <= 30  # at most two blocks per bit


def test_known_decomposition_and_keys() -> None:
    assert port_blocks(80, 90) == [(80, 13), (88, 15), (90, 16)]
    assert port_keys("TCP", 80, 90) == ((6, 80, 13), (6, 88, 15), (6, 90, 16))
    assert port_keys("SCTP", 9000) == ((132, 9000, 16),)
    assert port_keys("ANY", 53, 54) == ((6, 53, 16), (6, 54, 16), (17, 53, 16), (17, 54, 16))


def test_a_block_round_trips_through_the_map_key() -> None:
    entry = PolicyEntry(1000, 0, 6, 88, 15)
    assert prefix_len(entry) == 95
    assert decode_key(encode_key(7, entry)) == (7, entry)
    assert decode_key(encode_key(7, PolicyEntry(1000, 0, 6, 0))) == (7, PolicyEntry(1000, 0, 6, 0))


def test_an_allow_inside_a_denied_block_becomes_a_deny_a_wider_one_stays() -> None:
    deny = PolicyEntry(5, 0, 6, 88, 15)  # 88-89
    inside = PolicyEntry(5, 0, 6, 89)
    wider = PolicyEntry(5, 0, 6, 80, 13)  # 80-87: no overlap
    widest = PolicyEntry(5, 0, 6, 64, 10)  # 64-127: contains the deny, LPM finds the deny first
    other_proto = PolicyEntry(5, 0, 17, 89)
    out = apply_deny_precedence(
        {
            deny: Verdict.DENY,
            inside: Verdict.ALLOW,
            wider: Verdict.ALLOW,
            widest: Verdict.ALLOW,
            other_proto: Verdict.ALLOW,
        }
    )
    assert out[inside] is Verdict.DENY
    assert out[wider] is Verdict.ALLOW and out[widest] is Verdict.ALLOW
    assert out[other_proto] is Verdict.ALLOW
