"""HPACK (RFC 7541) for the plugin's one request and one response per connection.

Why not the ``hpack`` library: it imports ``logging`` (with ``threading``, ``traceback``,
``string``, ``weakref``…) and ``typing`` at start-up, about a third of the imports of an
ADD exec on this host (-X importtime, best of 8), on every pod's critical path. The plugin
needs little of HPACK:

- encoding (:func:`encode`): every field as "Literal Header Field without Indexing — New
  Name" (§6.2.2) with plain (not Huffman) strings, so the peer's dynamic table is never
  used and a SETTINGS_HEADER_TABLE_SIZE from it changes nothing;
- decoding (:class:`Decoder`): every representation of §6 (indexed, literal with
  incremental / without / never indexing, dynamic table size update), the static table
  (Appendix A), the dynamic table with its eviction (§4), Huffman-coded strings
  (Appendix B: the code is canonical, so the code lengths below define it) and a bound on
  the decoded header list.

Errors are :class:`HPACKError` naming what was wrong; the caller makes them an HTTP/2
COMPRESSION_ERROR (its protocol error). The plugin's tests check the tables against the
``hpack`` library and decode what that library encodes (Huffman and indexing included).
"""

from __future__ import annotations


class HPACKError(ValueError):
    """A header block cannot be decoded (the message says why)."""


#: RFC 7541 Appendix A, index 1..61.
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = tuple(
    (name.encode(), value.encode())
    for name, value in (
        (":authority", ""),
        (":method", "GET"),
        (":method", "POST"),
        (":path", "/"),
        (":path", "/index.html"),
        (":scheme", "http"),
        (":scheme", "https"),
        (":status", "200"),
        (":status", "204"),
        (":status", "206"),
        (":status", "304"),
        (":status", "400"),
        (":status", "404"),
        (":status", "500"),
        ("accept-charset", ""),
        ("accept-encoding", "gzip, deflate"),
        ("accept-language", ""),
        ("accept-ranges", ""),
        ("accept", ""),
        ("access-control-allow-origin", ""),
        ("age", ""),
        ("allow", ""),
        ("authorization", ""),
        ("cache-control", ""),
        ("content-disposition", ""),
        ("content-encoding", ""),
        ("content-language", ""),
        ("content-length", ""),
        ("content-location", ""),
        ("content-range", ""),
        ("content-type", ""),
        ("cookie", ""),
        ("date", ""),
        ("etag", ""),
        ("expect", ""),
        ("expires", ""),
        ("from", ""),
        ("host", ""),
        ("if-match", ""),
        ("if-modified-since", ""),
        ("if-none-match", ""),
        ("if-range", ""),
        ("if-unmodified-since", ""),
        ("last-modified", ""),
        ("link", ""),
        ("location", ""),
        ("max-forwards", ""),
        ("proxy-authenticate", ""),
        ("proxy-authorization", ""),
        ("range", ""),
        ("referer", ""),
        ("refresh", ""),
        ("retry-after", ""),
        ("server", ""),
        ("set-cookie", ""),
        ("strict-transport-security", ""),
        ("transfer-encoding", ""),
        ("user-agent", ""),
        ("vary", ""),
        ("via", ""),
        ("www-authenticate", ""),
    )
)

#: RFC 7541 Appendix B: the Huffman code's length in bits of each symbol 0..256 (256 =
#: EOS). The code is canonical (codes of one length are consecutive, in symbol order,
#: each length's first code follows the previous length's last), so these define it.
# fmt: off
HUFFMAN_CODE_LENGTHS = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10,
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28,
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
    30,
)
# fmt: on
_EOS = 256
#: Our SETTINGS_HEADER_TABLE_SIZE: the RFC 9113 default (the plugin does not send one).
DEFAULT_TABLE_SIZE = 4096
#: Per-entry overhead of the table size accounting (§4.1).
ENTRY_OVERHEAD = 32


def huffman_codes() -> list[tuple[int, int]]:
    """``[(code, length)]`` of symbols 0..256, built from :data:`HUFFMAN_CODE_LENGTHS`."""
    codes = [(0, 0)] * len(HUFFMAN_CODE_LENGTHS)
    code = length = 0
    for symbol in sorted(range(len(HUFFMAN_CODE_LENGTHS)), key=HUFFMAN_CODE_LENGTHS.__getitem__):
        bits = HUFFMAN_CODE_LENGTHS[symbol]
        if length:
            code = (code + 1) << (bits - length)
        length = bits
        codes[symbol] = (code, bits)
    return codes


_decode_map: dict[tuple[int, int], int] = {}


def huffman_decode(data: bytes) -> bytes:
    """Decode a Huffman-coded string (§5.2).

    Raises:
        HPACKError: EOS inside the string, padding longer than 7 bits or not all ones, or
            bits that are no code.
    """
    if not _decode_map:
        _decode_map.update({(length, code): s for s, (code, length) in enumerate(huffman_codes())})
    out = bytearray()
    code = length = 0
    for byte in data:
        for shift in range(7, -1, -1):
            code = (code << 1) | ((byte >> shift) & 1)
            length += 1
            symbol = _decode_map.get((length, code))
            if symbol is None:
                if length >= 30:
                    raise HPACKError("Huffman string holds an invalid code")
                continue
            if symbol == _EOS:
                raise HPACKError("Huffman string contains EOS")
            out.append(symbol)
            code = length = 0
    if length > 7 or code != (1 << length) - 1:
        raise HPACKError("Huffman string has invalid padding")
    return bytes(out)


def _integer(out: bytearray, value: int, prefix_bits: int, first: int) -> None:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        out.append(first | value)
        return
    out.append(first | limit)
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def encode(headers: list[tuple[str, str]]) -> bytes:
    """A header block of ``headers`` (names lower-case): each a literal without indexing
    with a new name, strings not Huffman-coded (§6.2.2, §5.2)."""
    out = bytearray()
    for name, value in headers:
        out.append(0x00)
        for text in (name.encode(), value.encode()):
            _integer(out, len(text), 7, 0x00)
            out += text
    return bytes(out)


class Decoder:
    """Decodes the header blocks of one connection, in order (the dynamic table is the
    connection's).

    Args:
        max_header_list_size: largest decoded list accepted, bytes (names + values + 32
            per field, as SETTINGS_MAX_HEADER_LIST_SIZE counts it).
    """

    def __init__(self, max_header_list_size: int) -> None:
        self.max_header_list_size = max_header_list_size
        self.max_table_size = DEFAULT_TABLE_SIZE
        self._table: list[tuple[bytes, bytes]] = []  # newest first
        self._table_size = 0

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The ``(name, value)`` fields of ``block``.

        Raises:
            HPACKError: the block is truncated or malformed, refers to an index that does
                not exist, sets a table size above ours, or decodes to more than
                ``max_header_list_size`` bytes.
        """
        fields: list[tuple[bytes, bytes]] = []
        total = 0
        pos, end = 0, len(block)
        while pos < end:
            byte = block[pos]
            if byte & 0x80:  # indexed field (§6.1)
                index, pos = self._int(block, pos, 7)
                field = self._entry(index)
            elif byte & 0xC0 == 0x40:  # literal with incremental indexing (§6.2.1)
                field, pos = self._literal(block, pos, 6)
                self._add(field)
            elif byte & 0xE0 == 0x20:  # dynamic table size update (§6.3)
                if fields:
                    raise HPACKError("dynamic table size update after a header field")
                size, pos = self._int(block, pos, 5)
                if size > DEFAULT_TABLE_SIZE:
                    raise HPACKError(f"table size update to {size} above {DEFAULT_TABLE_SIZE}")
                self.max_table_size = size
                self._evict()
                continue
            else:  # literal without indexing / never indexed (§6.2.2, §6.2.3)
                field, pos = self._literal(block, pos, 4)
            total += len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
            if total > self.max_header_list_size:
                raise HPACKError(f"header list larger than {self.max_header_list_size} bytes")
            fields.append(field)
        return fields

    @staticmethod
    def _int(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
        limit = (1 << prefix_bits) - 1
        value = block[pos] & limit
        pos += 1
        if value < limit:
            return value, pos
        shift = 0
        while True:
            if pos >= len(block):
                raise HPACKError("truncated integer")
            if shift > 28:
                raise HPACKError("integer too large")
            byte = block[pos]
            pos += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value, pos

    def _string(self, block: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(block):
            raise HPACKError("truncated string")
        huffman = block[pos] & 0x80
        length, pos = self._int(block, pos, 7)
        if pos + length > len(block):
            raise HPACKError("truncated string")
        data = block[pos : pos + length]
        return (huffman_decode(data) if huffman else data), pos + length

    def _literal(self, block: bytes, pos: int, prefix_bits: int) -> tuple[tuple[bytes, bytes], int]:
        index, pos = self._int(block, pos, prefix_bits)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = self._string(block, pos)
        value, pos = self._string(block, pos)
        return (name, value), pos

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 1 <= index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        dynamic = index - len(STATIC_TABLE) - 1
        if index == 0 or dynamic >= len(self._table):
            raise HPACKError(f"header table index {index} does not exist")
        return self._table[dynamic]

    def _add(self, field: tuple[bytes, bytes]) -> None:
        self._table.insert(0, field)
        self._table_size += len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
        self._evict()

    def _evict(self) -> None:
        while self._table_size > self.max_table_size:
            name, value = self._table.pop()
            self._table_size -= len(name) + len(value) + ENTRY_OVERHEAD
