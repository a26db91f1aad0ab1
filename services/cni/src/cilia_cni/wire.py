"""The ``cilia.agent.v1`` messages the plugin sends and reads, in Protocol Buffers wire form,
without the protobuf runtime.

Why not the generated ``agent_pb2``: importing it (the protobuf runtime's Python layer —
``descriptor_pool``, ``python_message``, ``text_format``, ``containers`` and what they pull
in: ``pickle``, ``datetime``, ``typing``, ``enum``… — plus building the file's descriptors)
was about half of the CPU of every ADD and DEL exec (-X importtime, best of 8 runs on this
2-core host: 51 of ~100 ms), on every pod's critical path. The plugin needs nine small
messages of strings, unsigned integers, booleans, string maps and nested messages; this
module encodes and decodes exactly those (encoding: protobuf.dev "Encoding", proto3).

The schemas below restate ``proto/cilia/agent/v1/agent.proto``; the plugin's tests
(``services/cni/tests/integration/test_cni_wire.py``) check every message field for field
against the generated descriptors and round-trip values through the protobuf runtime both
ways, so a change of the contract fails there instead of on the wire.

Rules kept (proto3): a scalar field at its default (``""``, ``0``, ``False``) is not
written; repeated and map fields are written element by element, map entries as nested
messages with key = 1, value = 2; a singular message field is written when set. Decoding
skips fields it does not know (wire types 0, 1, 2, 5), takes the last value of a repeated
singular field, accepts a known field with another wire type as unknown (as protobuf
does), truncates ``uint32`` to 32 bits, and refuses with :class:`DecodeError`: a truncated
varint, length or fixed field, a varint longer than 10 bytes, a group (wire types 3/4),
field number 0, and a string that is not UTF-8.
"""

from __future__ import annotations

# typing is not imported at run time (start-up cost); mypy honours this constant.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, ClassVar, Self

#: Field kinds.
STRING = "string"
UINT32 = "uint32"
UINT64 = "uint64"
INT64 = "int64"
BOOL = "bool"
MESSAGE = "message"
MAP = "map"  # map<string, string>

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class DecodeError(ValueError):
    """The bytes are not a valid encoding of the message (the message says where)."""


class Field:
    """One field of a message schema.

    Args:
        name: the attribute (the proto field name).
        number: the field number (1..2^29-1).
        kind: one of the kinds above.
        message: the class of a ``MESSAGE`` field's values.
        repeated: a repeated field (values in a list).
    """

    __slots__ = ("kind", "message", "name", "number", "repeated")

    def __init__(
        self,
        name: str,
        number: int,
        kind: str,
        message: type[Message] | None = None,
        *,
        repeated: bool = False,
    ) -> None:
        self.name = name
        self.number = number
        self.kind = kind
        self.message = message
        self.repeated = repeated

    def default(self) -> Any:
        """A new default value: ``[]``, ``{}``, ``""``, ``0``, ``False`` or None (message)."""
        if self.repeated:
            return []
        if self.kind == MAP:
            return {}
        if self.kind == STRING:
            return ""
        if self.kind == BOOL:
            return False
        if self.kind == MESSAGE:
            return None
        return 0


class Message:
    """A message: attributes named as the proto fields, keyword arguments to build one
    (as the generated classes), :meth:`SerializeToString` and :meth:`FromString`.

    Raises (constructor): TypeError for an unknown field name.
    """

    FIELDS: ClassVar[tuple[Field, ...]] = ()
    #: The proto's full name (``cilia.agent.v1.AddRequest``).
    FULL_NAME: ClassVar[str] = ""

    def __init__(self, **values: Any) -> None:
        for f in self.FIELDS:
            setattr(self, f.name, values.pop(f.name) if f.name in values else f.default())
        if values:
            raise TypeError(f"{type(self).__name__} has no field {sorted(values)[0]!r}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, f.name) == getattr(other, f.name) for f in self.FIELDS)

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in self.FIELDS)
        return f"{type(self).__name__}({shown})"

    def SerializeToString(self) -> bytes:  # noqa: N802 - the generated classes' name
        """The message's wire encoding (bytes).

        Raises:
            ValueError: a negative value in an unsigned field, or a value out of range.
        """
        out = bytearray()
        _encode(self, out)
        return bytes(out)

    @classmethod
    def FromString(cls, data: bytes) -> Self:  # noqa: N802 - the generated classes' name
        """Decode ``data``.

        Raises:
            DecodeError: ``data`` is not an encoding of this message (see the module).
        """
        message: Self = _decode(cls, memoryview(data))
        return message


# -- encoding ---------------------------------------------------------------------------


def _varint(out: bytearray, value: int) -> None:
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _string(out: bytearray, number: int, text: str) -> None:
    data = text.encode()
    _varint(out, number << 3 | _LEN)
    _varint(out, len(data))
    out += data


def _scalar(out: bytearray, f: Field, value: Any) -> None:
    if f.kind == STRING:
        _string(out, f.number, value)
        return
    if f.kind == BOOL:
        value = int(bool(value))
    elif f.kind == INT64:
        if not -(1 << 63) <= value < 1 << 63:
            raise ValueError(f"{f.name}: {value} is out of the int64 range")
        value &= _U64
    elif not 0 <= value <= (_U32 if f.kind == UINT32 else _U64):
        raise ValueError(f"{f.name}: {value} is out of the {f.kind} range")
    _varint(out, f.number << 3 | _VARINT)
    _varint(out, value)


def _nested(out: bytearray, number: int, message: Message) -> None:
    inner = bytearray()
    _encode(message, inner)
    _varint(out, number << 3 | _LEN)
    _varint(out, len(inner))
    out += inner


def _encode(message: Message, out: bytearray) -> None:
    for f in message.FIELDS:
        value = getattr(message, f.name)
        if f.kind == MAP:
            for key, item in value.items():
                entry = bytearray()
                if key:
                    _string(entry, 1, key)
                if item:
                    _string(entry, 2, item)
                _varint(out, f.number << 3 | _LEN)
                _varint(out, len(entry))
                out += entry
        elif f.kind == MESSAGE:
            for item in value if f.repeated else ([] if value is None else [value]):
                _nested(out, f.number, item)
        elif f.repeated:
            for item in value:
                _scalar(out, f, item)
        elif value:
            _scalar(out, f, value)


# -- decoding ---------------------------------------------------------------------------


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _U64, pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def _text(raw: memoryview, where: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError:
        raise DecodeError(f"{where}: string is not valid UTF-8") from None


def _decode(cls: type[Any], data: memoryview) -> Any:
    message = cls()
    by_number = {f.number: f for f in cls.FIELDS}
    pos, end = 0, len(data)
    while pos < end:
        tag, pos = _read_varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise DecodeError(f"{cls.FULL_NAME}: field number 0")
        raw: memoryview | None = None
        if wire == _VARINT:
            value, pos = _read_varint(data, pos)
        elif wire == _LEN:
            size, pos = _read_varint(data, pos)
            if size > end - pos:
                raise DecodeError(f"{cls.FULL_NAME}: field {number} overruns the message")
            raw, pos = data[pos : pos + size], pos + size
        elif wire in (_I64, _I32):
            pos += 8 if wire == _I64 else 4
            if pos > end:
                raise DecodeError(f"{cls.FULL_NAME}: truncated fixed-size field {number}")
            continue
        else:
            raise DecodeError(f"{cls.FULL_NAME}: unsupported wire type {wire} (field {number})")
        f = by_number.get(number)
        if f is None or (raw is None) != (f.kind not in (STRING, MESSAGE, MAP)):
            continue  # unknown, or a known field with another wire type: kept unknown
        where = f"{cls.FULL_NAME}.{f.name}"
        if f.kind == STRING:
            assert raw is not None
            item: Any = _text(raw, where)
        elif f.kind == MESSAGE:
            assert raw is not None and f.message is not None
            item = _decode(f.message, raw)
        elif f.kind == MAP:
            assert raw is not None
            entry = _decode(_MapEntry, raw)
            getattr(message, f.name)[entry.key] = entry.value
            continue
        elif f.kind == BOOL:
            item = value != 0
        elif f.kind == UINT32:
            item = value & _U32
        elif f.kind == INT64:
            item = value - (1 << 64) if value >> 63 else value
        else:
            item = value
        if f.repeated:
            getattr(message, f.name).append(item)
        else:
            setattr(message, f.name, item)
    return message


class _MapEntry(Message):
    FULL_NAME = "map<string, string> entry"
    FIELDS = (Field("key", 1, STRING), Field("value", 2, STRING))
    key: str
    value: str


# -- cilia.agent.v1 (proto/cilia/agent/v1/agent.proto) ------------------------------------

#: gRPC method paths (``/<package>.<Service>/<Method>``).
ADD_METHOD = "/cilia.agent.v1.AttachmentService/Add"
DEL_METHOD = "/cilia.agent.v1.AttachmentService/Del"
CHECK_METHOD = "/cilia.agent.v1.AttachmentService/Check"
GC_METHOD = "/cilia.agent.v1.AttachmentService/GC"
STATUS_METHOD = "/cilia.agent.v1.DebugService/Status"


class AddRequest(Message):
    """``cilia.agent.v1.AddRequest``."""

    FULL_NAME = "cilia.agent.v1.AddRequest"
    FIELDS = (
        Field("container_id", 1, STRING),
        Field("ifname", 2, STRING),
        Field("netns", 3, STRING),
        Field("labels", 4, MAP),
        Field("pod_namespace", 5, STRING),
        Field("pod_name", 6, STRING),
        Field("pool", 7, STRING),
        Field("mtu", 8, UINT32),
        Field("prev_result", 9, STRING),
        Field("annotations", 10, MAP),
    )
    container_id: str
    ifname: str
    netns: str
    labels: dict[str, str]
    pod_namespace: str
    pod_name: str
    pool: str
    mtu: int
    prev_result: str
    annotations: dict[str, str]


class Interface(Message):
    """``cilia.agent.v1.Interface``."""

    FULL_NAME = "cilia.agent.v1.Interface"
    FIELDS = (
        Field("name", 1, STRING),
        Field("mac", 2, STRING),
        Field("sandbox", 3, STRING),
        Field("mtu", 4, UINT32),
    )
    name: str
    mac: str
    sandbox: str
    mtu: int


class IPConfig(Message):
    """``cilia.agent.v1.IPConfig``."""

    FULL_NAME = "cilia.agent.v1.IPConfig"
    FIELDS = (
        Field("address", 1, STRING),
        Field("gateway", 2, STRING),
        Field("interface", 3, UINT32),
    )
    address: str
    gateway: str
    interface: int


class Route(Message):
    """``cilia.agent.v1.Route``."""

    FULL_NAME = "cilia.agent.v1.Route"
    FIELDS = (Field("dst", 1, STRING), Field("gw", 2, STRING))
    dst: str
    gw: str


class AddResponse(Message):
    """``cilia.agent.v1.AddResponse``."""

    FULL_NAME = "cilia.agent.v1.AddResponse"
    FIELDS = (
        Field("interfaces", 1, MESSAGE, Interface, repeated=True),
        Field("ips", 2, MESSAGE, IPConfig, repeated=True),
        Field("routes", 3, MESSAGE, Route, repeated=True),
        Field("endpoint_id", 4, UINT64),
    )
    interfaces: list[Interface]
    ips: list[IPConfig]
    routes: list[Route]
    endpoint_id: int


class DelRequest(Message):
    """``cilia.agent.v1.DelRequest``."""

    FULL_NAME = "cilia.agent.v1.DelRequest"
    FIELDS = (
        Field("container_id", 1, STRING),
        Field("ifname", 2, STRING),
        Field("netns", 3, STRING),
    )
    container_id: str
    ifname: str
    netns: str


class DelResponse(Message):
    """``cilia.agent.v1.DelResponse``."""

    FULL_NAME = "cilia.agent.v1.DelResponse"
    FIELDS = (Field("deleted", 1, BOOL),)
    deleted: bool


class QueuedDel(Message):
    """``cilia.agent.v1.QueuedDel`` (a file of the plugin's DEL queue)."""

    FULL_NAME = "cilia.agent.v1.QueuedDel"
    FIELDS = (
        Field("request", 1, MESSAGE, DelRequest),
        Field("queued_at_unix_ms", 2, INT64),
    )
    request: DelRequest | None
    queued_at_unix_ms: int


class CheckRequest(Message):
    """``cilia.agent.v1.CheckRequest``."""

    FULL_NAME = "cilia.agent.v1.CheckRequest"
    FIELDS = (
        Field("container_id", 1, STRING),
        Field("ifname", 2, STRING),
        Field("netns", 3, STRING),
        Field("addresses", 4, STRING, repeated=True),
        Field("routes", 5, MESSAGE, Route, repeated=True),
        Field("mac", 6, STRING),
    )
    container_id: str
    ifname: str
    netns: str
    addresses: list[str]
    routes: list[Route]
    mac: str


class CheckResponse(Message):
    """``cilia.agent.v1.CheckResponse``."""

    FULL_NAME = "cilia.agent.v1.CheckResponse"
    FIELDS = (Field("endpoint_id", 1, UINT64),)
    endpoint_id: int


class Attachment(Message):
    """``cilia.agent.v1.Attachment``."""

    FULL_NAME = "cilia.agent.v1.Attachment"
    FIELDS = (Field("container_id", 1, STRING), Field("ifname", 2, STRING))
    container_id: str
    ifname: str


class GCRequest(Message):
    """``cilia.agent.v1.GCRequest``."""

    FULL_NAME = "cilia.agent.v1.GCRequest"
    FIELDS = (Field("valid_attachments", 1, MESSAGE, Attachment, repeated=True),)
    valid_attachments: list[Attachment]


class GCResponse(Message):
    """``cilia.agent.v1.GCResponse``."""

    FULL_NAME = "cilia.agent.v1.GCResponse"
    FIELDS = (Field("released", 1, MESSAGE, Attachment, repeated=True),)
    released: list[Attachment]


class StatusRequest(Message):
    """``cilia.agent.v1.StatusRequest`` (no fields)."""

    FULL_NAME = "cilia.agent.v1.StatusRequest"


class PoolStatus(Message):
    """``cilia.agent.v1.PoolStatus``."""

    FULL_NAME = "cilia.agent.v1.PoolStatus"
    FIELDS = (
        Field("pool", 1, STRING),
        Field("cidrs", 2, STRING, repeated=True),
        Field("used", 3, UINT32),
        Field("capacity", 4, UINT32),
        Field("draining_cidrs", 5, STRING, repeated=True),
    )
    pool: str
    cidrs: list[str]
    used: int
    capacity: int
    draining_cidrs: list[str]


class StatusResponse(Message):
    """``cilia.agent.v1.StatusResponse``: the fields the plugin reads (readiness, pools);
    the agent's ``datapath`` and ``hubble`` sections are skipped as unknown fields."""

    FULL_NAME = "cilia.agent.v1.StatusResponse"
    FIELDS = (
        Field("ready", 1, BOOL),
        Field("message", 2, STRING),
        Field("node_name", 3, STRING),
        Field("router_ip", 4, STRING),
        Field("pools", 5, MESSAGE, PoolStatus, repeated=True),
        Field("endpoint_count", 6, UINT32),
        Field("version", 7, STRING),
    )
    ready: bool
    message: str
    node_name: str
    router_ip: str
    pools: list[PoolStatus]
    endpoint_count: int
    version: str
