"""cilia_cni.hpack (the plugin's HPACK) against the python-hyper ``hpack`` library: the
static table and Huffman code, what the library encodes (Huffman, indexing, table size
updates, eviction) decoded alike, what we encode decoded by the library, bad blocks
refused."""

from __future__ import annotations

import random

import hpack as lib
import pytest
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from cilia_cni import hpack


def test_static_table_and_huffman_code_are_the_rfcs() -> None:
    assert tuple(lib.table.HeaderTable.STATIC_TABLE) == hpack.STATIC_TABLE
    assert hpack.huffman_codes() == list(zip(REQUEST_CODES, REQUEST_CODES_LENGTH, strict=True))


FIELDS = [
    (":status", "200"),
    ("content-type", "application/grpc"),
    ("grpc-accept-encoding", "identity, deflate, gzip"),
    ("grpc-status", "0"),
    ("grpc-message", "ünïcode ✓ %20 done"),
    ("x-binary-bin", "AAECAwQ="),
    ("custom", ""),
    ("long", "v" * 1500),
]


@pytest.mark.parametrize("huffman", [True, False])
def test_decodes_what_the_library_encodes_over_many_blocks(huffman: bool) -> None:
    rng = random.Random(huffman)
    encoder, ours = lib.Encoder(), hpack.Decoder(64 * 1024)
    for round_ in range(120):
        if round_ % 30 == 29:
            encoder.header_table_size = rng.choice([0, 256, 4096])  # a size update next
        fields = rng.sample(FIELDS, rng.randrange(1, len(FIELDS)))
        sensitive = [
            lib.NeverIndexedHeaderTuple(k, v) if rng.random() < 0.2 else (k, v) for k, v in fields
        ]
        block = encoder.encode(sensitive, huffman=huffman)
        expected = [(k.encode(), v.encode()) for k, v in fields]
        assert ours.decode(block) == expected


def test_the_library_decodes_what_we_encode() -> None:
    fields = [
        (":path", "/cilia.agent.v1.AttachmentService/Add"),
        ("te", "trailers"),
        ("x", "ü" * 300),
    ]
    decoded = lib.Decoder().decode(hpack.encode(fields))
    assert decoded == fields


@pytest.mark.parametrize(
    ("block", "needle"),
    [
        (b"\x80", "index 0 does not exist"),
        (b"\xbe", "index 62 does not exist"),
        (b"\x40\x05ab", "truncated string"),
        (b"\x00\x7f", "truncated integer"),
        (b"\x00\x7f\xff\xff\xff\xff\xff\x01", "integer too large"),
        (b"\x3f\xe2\x1f", "table size update to 4097"),
        (b"\x88\x20", "size update after a header field"),
        (b"\x00\x81\x00\x01a", "invalid padding"),  # 8 zero bits: no code, no padding
        (b"\x00\x84\xff\xff\xff\xff\x01a", "contains EOS"),
    ],
)
def test_bad_blocks_are_refused(block: bytes, needle: str) -> None:
    with pytest.raises(hpack.HPACKError, match=needle):
        hpack.Decoder(64 * 1024).decode(block)


def test_header_list_bound() -> None:
    block = lib.Encoder().encode([("a", "x" * 100)] * 3)
    assert len(hpack.Decoder(3 * 133).decode(block)) == 3
    with pytest.raises(hpack.HPACKError, match="larger than 398 bytes"):
        hpack.Decoder(3 * 133 - 1).decode(block)
